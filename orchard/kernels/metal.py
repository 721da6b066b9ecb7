"""The paged decode and varlen kernels compiled for Apple GPUs through `mx.fast.metal_kernel`.

Same kernel text as orchard/kernels/cuda.py (see orchard/kernels/source.py); only the compiler differs.
"""

from __future__ import annotations

import mlx.core as mx

from orchard.kernels.launch import PagedDecodeKernels
from orchard.kernels.varlen import PagedVarlenKernels


def compile_metal(name: str, input_names: list, output_names: list, header: str, body: str):
    return mx.fast.metal_kernel(name=name, input_names=input_names, output_names=output_names, source=body, header=header)


#: paged_decode(queries, key_cache, value_cache, block_tables, context_lens, scale) -> output
paged_decode = PagedDecodeKernels("metal", compile_metal)

#: paged_varlen(queries, key_cache, value_cache, plan, scale) -> output (orchard/kernels/plan.py builds the plan)
paged_varlen = PagedVarlenKernels("metal", compile_metal)
