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
# pytest first, then the benchmarks and the demo; the script exits with pytest's status (a
# failing benchmark or demo is reported and makes it exit non-zero too, when pytest passed).
# No warning filters and no -p no:fp32scope: the package's warnings (errors under the
# suite's filterwarnings) and its pytest plugin run here as everywhere else.
log="$out/gpu-run.log"
: >"$log"
step() { "$@" 2>&1 | tee -a "$log"; }
failed=()
step python3 -c "import sys, torch, wrapt; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'wrapt', wrapt.__version__)" || failed+=("versions")
pytest_status=0
step python3 -m pytest tests/gpu -m gpu -v -p no:cacheprovider || pytest_status=$?
step python3 benchmarks/bench_gpu.py || failed+=("bench_gpu.py")
step python3 benchmarks/bench_scope.py --number 5000 --repeats 9 || failed+=("bench_scope.py")
step python3 benchmarks/bench_training.py --repeats 9 || failed+=("bench_training.py")
step python3 -m fp32scope demo --device cuda || failed+=("demo")
{
  echo "run_on_device.sh: pytest exit status ${pytest_status}"
  if ((${#failed[@]})); then echo "run_on_device.sh: FAILED besides pytest: ${failed[*]}"; fi
} | tee -a "$log"
if ((pytest_status != 0)); then exit "$pytest_status"; fi
if ((${#failed[@]})); then exit 1; fi
