#!/bin/bash
# On the H200, once ~/rparts holds ray.part.0 and ray.part.1, ~/rdeps the wheels and ~/rbin bwrap (what
# scripts/gpu/prepare_ray.sh made here, copied there by the device calls): unpacks Ray and the wheels into
# ~/rsite (once) and exports the environment whale-ray needs there (after ../shared/gpu/vllm_assemble.sh for
# vLLM). Usage, in the checkout's root: source scripts/gpu/assemble.sh SHA256
S=~/rsite
got=$(cat ~/rparts/ray.part.? | sha256sum | cut -d' ' -f1)
if [ "$got" != "$1" ]; then echo "ray parts sha256 $got != $1"; ls -l ~/rparts; return 1 2>/dev/null || exit 1; fi
if [ ! -d $S/ray ]; then
  rm -rf $S; mkdir -p $S
  cat ~/rparts/ray.part.? | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall(sys.argv[1],filter='fully_trusted')" $S
  python3 -m pip install -q --no-index --no-deps --no-compile --target $S ~/rdeps/*.whl
fi
# where the sandbox's unprivileged uid can run it (not under /root, which it cannot enter: seen there). On the
# H200 it ran with all 11 sandbox layers on 2026-12-01 (whale doctor), and whole runs used it (isolation auto).
install -m 755 ~/rbin/bwrap /usr/local/bin/bwrap
# the checkout on the path (the `whale` entry point is `python3 -m whale_ray.cli`); NVLink multicast stays off
export PYTHONPATH=$S:$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_USAGE_STATS_ENABLED=0
python3 -c "import ray, libcst, jsonschema, pydantic, chess; print('ray', ray.__version__, 'pydantic', pydantic.__version__)"
