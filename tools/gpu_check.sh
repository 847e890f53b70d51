#!/usr/bin/env bash
# The GPU checks, in one go, on a CUDA machine with python3 holding torch (the device machine: torch 2.11+cu130,
# Python 3.12, no network). Run from the repository root:
#
#     bash tools/gpu_check.sh
#
# 1. installs the wheels carried in .whl/ (megatron-core 0.16.1: the image lacks it) into /tmp/site;
# 2. prints the GPU, driver, torch, CUDA and megatron-core versions;
# 3. runs the tests marked gpu in tests/learner/test_gpu.py, tests/sync/test_cuda_ipc.py,
#    tests/sync/test_sync_dtype.py and tests/sync/test_cuda_ipc_delta.py (log: $OUT/gpu_tests.log);
# 4. if at most GPU_CHECK_BENCH_AFTER_S (300) seconds have passed, tools/bench_sync_ipc_delta.py: delta against
#    full versions through cuda_ipc at three learning rates (JSON lines: $OUT/bench_ipc_delta.jsonl).
#
# Each part runs under `timeout`, so one hang cannot eat the rest: at most about 7.5 minutes in all (typically
# 3-5). Exit status: the tests' (0 when they passed), 2 if the wheels did not install.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
started=$(date +%s)
elapsed() { echo $(( $(date +%s) - started )); }

if compgen -G ".whl/*.whl" >/dev/null; then
    timeout 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: installing .whl/*.whl failed" | tee "$OUT/env.log"; exit 2; }
fi
export PYTHONPATH=/tmp/site:$PWD

{
    echo "== $(date -u +%FT%TZ) $(uname -r) $(python3 --version 2>&1) at $(command -v python3)"
    timeout 30 nvidia-smi
    timeout 90 python3 -c '
import torch, numpy
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "numpy", numpy.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
from megatron.core import package_info
print("megatron-core", package_info.__version__, "from", package_info.__file__)
for name in ("transformer_engine", "apex", "vllm", "ray", "hydra", "pytest_timeout"):
    try:
        __import__(name)
        print(name, "importable")
    except Exception as e:
        print(name, "not importable:", type(e).__name__)
'
    echo "== wheels: $(ls .whl 2>/dev/null | tr '\n' ' ')"
} 2>&1 | tee "$OUT/env.log"

timeout_flag=()
python3 -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout=200)  # a hung test fails, the rest run
timeout 270 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 -rA "${timeout_flag[@]}" \
    tests/learner/test_gpu.py tests/sync/test_cuda_ipc.py tests/sync/test_sync_dtype.py \
    tests/sync/test_cuda_ipc_delta.py 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=$?
echo "== tests exit status $tests_rc after $(elapsed) s" | tee -a "$OUT/gpu_tests.log"

if [ "$(elapsed)" -le "${GPU_CHECK_BENCH_AFTER_S:-300}" ]; then
    timeout 120 python3 tools/bench_sync_ipc_delta.py --steps 3 2>"$OUT/bench_ipc_delta.err" \
        | tee "$OUT/bench_ipc_delta.jsonl"
    bench_rc=$?
    tail -n 12 "$OUT/bench_ipc_delta.err"
    echo "== bench exit status $bench_rc after $(elapsed) s" | tee -a "$OUT/bench_ipc_delta.err"
else
    echo "== bench skipped: $(elapsed) s gone" | tee "$OUT/bench_ipc_delta.err"
fi
echo "== gpu_check done in $(elapsed) s, tests exit status $tests_rc"
exit "$tests_rc"
