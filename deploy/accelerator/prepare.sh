#!/usr/bin/env bash
# Here, before measuring on the accelerator machine (which reaches no package index): MLX's CUDA
# wheel in two halves (.gpu1, .gpu2, made by the shared wheels script) and the dependencies the
# engine benchmark and `orchard serve --no-ray` import (.gpu3; the accelerator has no Ray).
# Each folder is one transfer of < 64 MiB.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
bash "${WHEELS_SCRIPT:-../shared/device/mlx-cuda-wheels.sh}" >/dev/null
# The engine imports llguidance (grammar masks), which the accelerator's image lacks: it rides
# with the second half, which stage2 installs.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d .gpu2 "llguidance==1.9.1"
grep -qx "/.gpu3/" .git/info/exclude 2>/dev/null || echo "/.gpu3/" >> .git/info/exclude
rm -rf .gpu3 && mkdir -p .gpu3
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu3 "transformers==5.24.0" "tokenizers==0.23.3" xxhash rich \
  "fastapi>=0.115,<1" "uvicorn>=0.30,<1" "httptools>=0.6,<1" "uvloop>=0.19,<1" "httpx>=0.27,<1" "prometheus_client>=0.20,<1"
# numpy and msgpack are on the accelerator machine already; keep the transfer small.
rm -f .gpu3/numpy-*.whl .gpu3/msgpack-*.whl
du -sh .gpu1 .gpu2 .gpu3
