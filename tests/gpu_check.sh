#!/usr/bin/env bash
# The checks that need a CUDA GPU (the NCCL path of issue 4), for a machine that has one: the tests
# that skip without CUDA, codecarbon's tests (with a GPU, it reads NVML too), and a two-group CPU job as a
# check of the machine's torch and torchft.
#
# Run from anywhere: `bash tests/gpu_check.sh`. Python packages the machine lacks may come as wheels in
# .whl/ at the repository's root; they are installed into /tmp/site, not into the machine's Python.
# Results (pytest's log, a JUnit file, the groups' logs) go to $OUT, else /tmp/gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
python="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
fi
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false PYTHONUNBUFFERED=1
nvidia-smi -L || true
"$python" - <<'PY' || exit 1
import torch, torchft  # noqa: F401 - both must import
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", nccl)
PY
"$python" -m pytest -q -rs -p no:cacheprovider --durations=5 --junitxml "$out/junit.xml" \
    tests/unit/test_device.py tests/unit/test_ddp.py tests/unit/test_carbon.py tests/unit/test_carbon_probe.py \
    "tests/unit/test_training.py::test_two_groups_train_in_lockstep_and_agree" 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}
# The groups' and lighthouses' logs (for a failure inside a group) and the groups' energy records.
find /tmp/pytest-of-* \( -name '*.log' -o -name energy.json \) -print0 2>/dev/null | tar czf "$out/group-logs.tgz" --null -T - 2>/dev/null
exit "$status"
