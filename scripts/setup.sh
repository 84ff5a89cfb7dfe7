#!/usr/bin/env bash
# Creates .venv with whale-ray and its dependencies, and installs bubblewrap for the sandbox.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    (sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap) >/dev/null
  else
    echo "setup: bubblewrap (bwrap) is missing and cannot be installed without root; the sandbox needs it" >&2
  fi
fi

# Headless Chromium: tests/test_report_html.py opens the report pages in it (skipped where it is absent).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    (sudo apt-get update -qq && sudo apt-get install -y -qq chromium) >/dev/null
  else
    echo "setup: chromium is missing and cannot be installed without root; the report-page tests will skip" >&2
  fi
fi

# strace: tests/test_archive.py injects real disk-full and power-cut faults into rename() with it.
if ! command -v strace >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq strace) >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    (sudo apt-get update -qq && sudo apt-get install -y -qq strace) >/dev/null
  else
    echo "setup: strace is missing and cannot be installed without root; the archive's crash tests will skip" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch; on a GPU machine install the torch you want first and this is skipped.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
