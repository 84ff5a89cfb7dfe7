#!/bin/bash
# Issue 11, items 3-4, in one device call, after the parts are in ~/vparts and ~/rparts (README.md beside this):
# which sandbox level a run would get there (carried bubblewrap), benchmarks/gpu_weight_sync.py (the CUDA IPC
# ladder, then weight sync of the 1.7 B model against the object store and a raw copy, vLLM sleep-mode memory,
# the PolicyServer through Ray), and the GPU tests named by GPU_TESTS (pytest -k): after the benchmark, or before
# it with TESTS_FIRST=1. The benchmark writes ~/ipc_ok when the IPC path through the PolicyServer worked.
# Usage, in the checkout's root there: bash scripts/gpu/weight_sync_h200.sh VLLM_SHA256 RAY_SHA256
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$SECONDS
source .gpu/vllm_assemble.sh "$1" || exit 1
source scripts/gpu/assemble.sh "$2" || exit 1
echo "[assembled in $((SECONDS - t0)) s]"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
timeout 15 python3 -m whale_ray.cli doctor > "$OUT/doctor.txt" 2>&1
if python3 -c "from whale_ray.sandbox.isolation import bwrap_launcher; bwrap_launcher()" > "$OUT/bwrap.txt" 2>&1
then echo "sandbox: carried bwrap works here (isolation auto)"; else echo "sandbox: bwrap fails here: $(tail -2 "$OUT/bwrap.txt")"; fi

gpu_tests() {
  [ -n "${GPU_TESTS:-}" ] || return 0
  local t=$SECONDS
  # pytest-timeout (on the image) dumps every thread's stack if a test hangs; the whole log comes back
  WHALE_GPU_POLICY=.gpu/policy timeout -k 10 ${TEST_TIMEOUT:-110} python3 -m pytest -q -s -p no:cacheprovider \
    --timeout ${TEST_STEP_TIMEOUT:-90} --timeout-method thread tests/policy/test_vllm_gpu.py -k "$GPU_TESTS" > "$OUT/tests.log" 2>&1
  echo "tests rc $? in $((SECONDS - t)) s"
  grep -E "passed|failed|error|sleep level|IPC load|Error|assert|Timeout" "$OUT/tests.log" | grep -v -E "WARNING|INFO" | tail -20
}

# what this call started and left on the GPU (a benchmark stopped by its timeout), ended by pid
leftovers() {
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "left on the GPU: pid $p ($(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-80)); killing it"; kill -9 "$p"
  done
}

[ -n "${TESTS_FIRST:-}" ] && gpu_tests
rm -f ~/ipc_ok
timeout -k 20 ${BENCH_TIMEOUT:-200} python3 benchmarks/gpu_weight_sync.py --tokenizer .gpu/policy --dir /tmp/qwen3-1.7b \
  --ok-file ~/ipc_ok ${BENCH_ARGS:-} 2>&1 | grep -v -E "^\(.*pid=|WARNING|INFO|logging\.cc|^    @|^PC: " | tee "$OUT/sync.txt"
rc=$?
# the actors' logs (faulthandler dumps every thread's stack there every 20 s)
tar czf "$OUT/raylogs.tgz" /tmp/ray/session_latest/logs/worker-*.err /tmp/ray/session_latest/logs/worker-*.out 2>/dev/null
sleep 2; leftovers
[ -z "${TESTS_FIRST:-}" ] && gpu_tests
echo "[total $((SECONDS - t0)) s]"
exit $rc
