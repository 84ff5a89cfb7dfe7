#!/bin/bash
# Issue 33 on the H200: where a WHALE run's time goes (benchmarks/gpu_whale_run.py's breakdown, busy shares and
# limits) with SmolLM2-135M-Instruct, vLLM, cuda_ipc and sleep level 2, under each --settings value. After the
# parts are in ~/vparts, ~/rparts and ~/gparts (scripts/gpu/README.md, the real-model table's calls 1-5).
# A run takes minutes, so one setting per call: call it with SETTINGS=kept, then SETTINGS=kept,released (the
# machine still warm): --reuse reads back what the earlier call finished, and the last call prints one table.
# LIMITS= (empty) leaves the limits to a later call. The 1.7B-shaped checkpoint of random weights:
# ROOT=~/profile-1p7b BENCH_ARGS=--random-1p7b SETTINGS=phase-checkpoint (its full state is 18 GB a checkpoint).
# Usage, in the checkout's root there: bash scripts/gpu/profile_h200.sh VLLM_SHA256 RAY_SHA256 GGUF_SHA256
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu/smollm2.sh "$1" "$2" "$3" || exit 1
ROOT=${ROOT:-~/profile}  # one root per checkpoint: --reuse reads back its runs by setting name
for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do echo "killing leftover pid $p"; kill -9 "$p"; done
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader; nproc
if python3 -c "from whale_ray.sandbox.isolation import bwrap_launcher; bwrap_launcher()"; then iso=auto; else iso=unsafe_none; fi
echo "sandbox isolation: $iso"
timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/gpu_whale_run.py --device cuda --model $MODEL --root $ROOT \
  --engines vllm --weight-sync cuda_ipc --sleep-level 2 --isolation $iso --run-timeout ${RUN_TIMEOUT:-300} \
  --settings ${SETTINGS:-kept} ${LIMITS---limits} --reuse ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.txt"
rc=$?
cp $ROOT/*.status.txt "$OUT/" 2>/dev/null
tar czf "$OUT/profile.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='rollouts' \
  $ROOT 2>/dev/null
ls -la "$OUT"
exit $rc
