#!/usr/bin/env bash
# One prepared run of the GPU checks and benchmarks on a CUDA machine (e.g. the lent H200).
# Uses the machine's own torch; installs wrapt>=2 from a wheel carried in wheels/ if needed.
# Writes everything it prints to $OUT (or ./gpu-out) as well.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
{
  python -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python -c "import wrapt, sys; sys.exit(0 if int(wrapt.__version__.split('.')[0]) >= 2 else 1)" 2>/dev/null \
    || python -m pip install --no-index --find-links wheels 'wrapt>=2' || echo "no wrapt>=2 available"
  python -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD"
  python -m pytest tests/gpu -m gpu -v -p no:cacheprovider -W ignore::UserWarning
  python benchmarks/bench_scope.py --number 5000 --repeats 9
  python benchmarks/bench_gpu.py
  python -m fp32scope demo --device cuda
} 2>&1 | tee "$out/gpu-run.log"
