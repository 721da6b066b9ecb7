"""Full float32 matmuls for these tests: on CUDA GPUs (and Apple M5) MLX runs float32 GEMMs,
and so the reference's prefill SDPA, in TF32 unless told otherwise, which is ~1e-3 off
the float64 oracle instead of ~1e-6. The compiled kernels do not use matmul units."""

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")
