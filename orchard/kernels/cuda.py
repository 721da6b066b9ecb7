"""The paged decode and varlen kernels compiled for NVIDIA GPUs through `mx.fast.cuda_kernel` (NVRTC)."""

from __future__ import annotations

import mlx.core as mx

from orchard.kernels.launch import PagedDecodeKernels
from orchard.kernels.varlen import PagedVarlenKernels


def compile_cuda(name: str, input_names: list, output_names: list, header: str, body: str):
    return mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names, source=body, header=header)


#: paged_decode(queries, key_cache, value_cache, block_tables, context_lens, scale) -> output
paged_decode = PagedDecodeKernels("cuda", compile_cuda)

#: paged_varlen(queries, key_cache, value_cache, plan, scale) -> output (orchard/kernels/plan.py builds the plan)
paged_varlen = PagedVarlenKernels("cuda", compile_cuda)
