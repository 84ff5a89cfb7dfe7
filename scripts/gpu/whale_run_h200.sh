#!/bin/bash
# Issue 11, item 4, in one device call: the same small WHALE study with `--engine vllm` and with
# `--engine transformers`, the PolicyServer and the Trainer sharing the H200 (benchmarks/gpu_whale_run.py),
# after the parts are in ~/vparts and ~/rparts (scripts/gpu/README.md says which call carries what).
# Usage, in the checkout's root there: bash scripts/gpu/whale_run_h200.sh VLLM_SHA256 RAY_SHA256
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/vllm_assemble.sh "$1" || exit 1
source scripts/gpu/assemble.sh "$2" || exit 1
# anything an earlier call left on the GPU (a benchmark stopped by its timeout) is ended by pid first
for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do echo "killing leftover pid $p"; kill -9 "$p"; done
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
python3 -m whale_ray.cli doctor > "$OUT/doctor.txt" 2>&1
# bubblewrap (carried) if it works on this kernel, else rlimits only: both engines run under the same one
if python3 -c "from whale_ray.sandbox.isolation import bwrap_launcher; bwrap_launcher()"; then iso=auto; else iso=unsafe_none; fi
echo "sandbox isolation: $iso"
ROOT=${ROOT:-/tmp/gpu-runs}
timeout ${BENCH_TIMEOUT:-520} python3 benchmarks/gpu_whale_run.py --device cuda --model .gpu/policy --root $ROOT \
  --isolation $iso --run-timeout ${RUN_TIMEOUT:-250} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
rc=$?
# run directories without weights, and the Ray worker logs that name vLLM (the PolicyServer's)
logs=$(grep -l -i vllm /tmp/ray/session_*/logs/worker-*.err 2>/dev/null | head -4)
tar czf "$OUT/runs.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' $ROOT $logs 2>/dev/null
# then, if asked (GPU_TESTS="-k reload", say), tests/policy/test_vllm_gpu.py on the same machine
if [ -n "${GPU_TESTS:-}" ]; then
  WHALE_GPU_POLICY=.gpu/policy timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q -p no:cacheprovider \
    tests/policy/test_vllm_gpu.py $GPU_TESTS 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
ls -la "$OUT"
exit $rc
