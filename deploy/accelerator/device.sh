#!/usr/bin/env bash
# On the accelerator machine, from the repository root, three calls in a row (it stays set up
# only briefly between calls):
#   bash deploy/accelerator/device.sh stage1          # with .gpu1 carried
#   bash deploy/accelerator/device.sh stage2          # with .gpu2 carried: MLX for CUDA installed
#   bash deploy/accelerator/device.sh deps CMD...     # with .gpu3 carried: dependencies, then CMD
#   bash deploy/accelerator/device.sh run CMD...      # later calls while the machine is warm
set -euo pipefail
site=/root/site
parts=/root/parts
case "${1:-}" in
  stage1)
    mkdir -p "$parts" && cp .gpu1/* "$parts/" ;;
  stage2)
    cp .gpu2/* "$parts/"
    (cd "$parts" && cat part_aa part_ab > "$(cat NAME)" &&
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" mlx-*.whl mlx_lm-*.whl llguidance-*.whl "$(cat NAME)") ;;
  deps)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu3/*.whl
    shift; export PYTHONPATH="$site:$PWD"; python3 -c 'import mlx.core as mx; print("device:", mx.default_device())'
    [ $# -gt 0 ] && exec "$@" ;;
  run)
    shift; export PYTHONPATH="$site:$PWD"; exec "$@" ;;
  *)
    echo "usage: $0 stage1|stage2|deps [CMD...]|run CMD..." >&2; exit 2 ;;
esac
