set -x
date -u
timeout 240 python3 -m cluster.bench.gateway --no-ray --ttft-samples 60 2>&1 | tee $OUT/gateway.txt
date -u
timeout 250 python3 -m cluster.bench.kernels --only decode --sweep 2>&1 | tee $OUT/kernels.txt
date -u
