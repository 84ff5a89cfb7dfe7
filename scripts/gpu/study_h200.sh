#!/bin/bash
# Issue 31 item 6 on the H200: `whale study` of the five conditions x 3 seeds on SmolLM2-135M-Instruct in the
# arithmetic world (scripts/gpu/study_smollm2.yaml), after the parts are in ~/vparts, ~/rparts and ~/gparts
# (scripts/gpu/README.md says which call carries what). The study outlasts one call: each call runs it until
# STUDY_S seconds have passed, ends it with its process group (a study resumes from its root: Tune reruns no
# finished pair and the running ones resume from their run directories), and sends back the root without
# weights. Call it again, the machine still warm, until it prints "study finished".
# DOMAIN names another world for the same settings (DOMAIN=domains.search_qa.reading ROOT=~/study-reading).
# Usage, in the checkout's root there: bash scripts/gpu/study_h200.sh VLLM_SHA256 RAY_SHA256 GGUF_SHA256
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu/smollm2.sh "$1" "$2" "$3" || exit 1
ROOT=${ROOT:-~/study}
# what an earlier call's study left (ended by its timeout): its Ray cluster and whatever holds the GPU
pkill -9 -f 'ray/core/src/ray/(raylet|gcs)' 2>/dev/null
for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p"; done
sleep 2; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# bubblewrap (carried) if it works on this kernel, else rlimits only, for every pair alike
if python3 -c "from whale_ray.sandbox.isolation import bwrap_launcher; bwrap_launcher()"; then iso=auto; else iso=unsafe_none; fi
python3 - "$iso" "${DOMAIN:-}" <<'PY'
import sys, yaml
tree = yaml.safe_load(open("scripts/gpu/study_smollm2.yaml"))
tree["sandbox"]["isolation"] = sys.argv[1]
tree["domain"] = sys.argv[2] or tree["domain"]
yaml.safe_dump(tree, open("/tmp/study.yaml", "w"), sort_keys=False)
PY
echo "sandbox isolation: $iso"
t0=$(date +%s)
setsid python3 -m whale_ray.cli study --config /tmp/study.yaml --model $MODEL --root $ROOT --seeds ${SEEDS:-3} \
  --max-concurrent ${CONCURRENT:-5} >> "$OUT/study.log" 2>&1 &
pid=$!
# A finished pair's checkpoints go: 1.6 GB a version (float32 weights and AdamW state), two kept a pair, would
# fill the machine's disk over 12 training pairs, and no weights come back from it anyway (64 MiB a call).
# The comparison reads the pairs' records, never their checkpoints.
while kill -0 $pid 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt ${STUDY_S:-500} ]; do
  for d in $ROOT/*/; do grep -qs '"finished": true' "$d/state.json" && rm -rf "$d/checkpoints"; done
  sleep 5
done
if kill -0 $pid 2>/dev/null; then
  kill -9 -- -$pid; echo "study stopped after ${STUDY_S:-500} s; call again to resume it"
else
  wait $pid; echo "study finished, rc $?"
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
# the pairs' run directories and the comparison, without weights or rollout files (the tables and plots hold
# what the comparison reads); state.json and records.json of each pair say where it stands
tar czf "$OUT/study.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.parquet' \
  --exclude='tune' -C "$(dirname $ROOT)" "$(basename $ROOT)" 2>/dev/null
ls -la "$OUT"
