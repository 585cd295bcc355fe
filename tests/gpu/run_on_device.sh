#!/usr/bin/env bash
# One prepared run of the GPU checks and benchmarks on a CUDA machine (e.g. a lent H200,
# Python 3.12 with its own torch). wrapt>=2 travels as a wheel in .whl/ (ignored by git):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl 'wrapt==2.5.2'
# then run this script with .whl carried. Everything it prints also goes to $OUT/gpu-run.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
{
  python3 -c "import sys, torch, wrapt; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'wrapt', wrapt.__version__)"
  python3 -m pytest tests/gpu -m gpu -v -p no:cacheprovider -p no:fp32scope -W ignore::UserWarning
  python3 benchmarks/bench_gpu.py
  python3 benchmarks/bench_scope.py --number 5000 --repeats 9
  python3 benchmarks/bench_training.py --repeats 9
  python3 -m fp32scope demo --device cuda
} 2>&1 | tee "$out/gpu-run.log"
