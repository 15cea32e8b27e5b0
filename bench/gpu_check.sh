#!/usr/bin/env bash
# The GPU check in one device call: bench/gpu.py (a DMD2 rollout's stages in one process, full-size SD3.5 Medium
# MMDiT at 1024 px, bf16, four variants: sleep, no-sleep, compile, no-checkpointing) and the tests marked gpu.
#
#   bash bench/gpu_check.sh [bench/gpu.py options]        results in $OUT (default out/gpu-check):
#     summary.txt  each step's exit status and seconds, the device    gpu.txt  the table    gpu.log  progress
#     gpu.json     every figure, rewritten after each stage (a cut run keeps what it measured)
#     pytest.txt   the gpu tests
#
# The one call, from this workplace (no network on the device; its python3 holds torch 2.11 CUDA, transformers,
# safetensors, huggingface_hub, numpy, pytest, but no diffusers, Ray, Prefect, MLflow or boto3, none of which the
# check imports). What is carried: the diffusers wheel alone (~4 MiB; `bash bench/gpu_check.sh --fetch-wheels`
# puts it in .whl/, which git ignores), installed with --no-deps into /tmp/site:
#     bash bench/gpu_check.sh --fetch-wheels
#     run(carry=[".whl"], timeout_s=540, command="OUT=$OUT WHEELS=.whl bash bench/gpu_check.sh")
# Time limits: the check 300 s, the gpu tests 150 s (inductor compiles a tiny UNet's blocks): the whole stays
# inside 8 minutes of a 10-minute call, with room for the wheel's install (~5 s) and the start; each part's output
# lands in $OUT as it is made.
#
# WORKDIR (default /tmp/dmd2-gpu) keeps the built pipeline for a rerun. On this CPU machine (no CUDA: bench/gpu.py
# takes the tiny shape), `PY=.venv/bin/python bash bench/gpu_check.sh --variants sleep no-sleep --rollouts 1` takes
# about 17 s: python ready at once, the check ~11 s (the bf16 product, building the tiny pipeline ~1 s, per variant
# the plan ~2 s, one warm-up and one timed rollout), the gpu tests ~6 s (all skipped without CUDA: collecting them
# proves they import without the servers' packages). tests/bench/test_gpu_bench.py runs exactly that.
#
# Every Python step runs through tests/bench/absent_packages.py, which makes Ray, Prefect, MLflow, boto3, moto,
# botocore and s3fs absent: on the device they are, and here the same run proves nothing needs them.
set -u -o pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch-wheels" ]; then
    set -e
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude  # carried, never committed
    rm -rf .whl && mkdir -p .whl
    pip=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
    "$pip" -m pip download --quiet --no-deps --only-binary=:all: -d .whl "$(grep -i '^diffusers==' requirements.lock)"
    du -sh .whl/*
    exit 0
fi

OUT=${OUT:-out/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
started=$(date +%s)
note() { echo "$1 after $(( $(date +%s) - started )) s" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

if [ -n "${WHEELS:-}" ]; then
    PY=${PY:-python3}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl \
        || { note "installing $WHEELS failed"; exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PY=${PY:-python3}
WITHOUT_SERVERS="$PY tests/bench/absent_packages.py"
note "python ready: $PY"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available()
else 'no CUDA: the tiny shape on CPU')" 2>&1 | tee -a "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/summary.txt" 2>/dev/null

timeout 300 $WITHOUT_SERVERS bench/gpu.py --workdir "${WORKDIR:-/tmp/dmd2-gpu}" --json "$OUT/gpu.json" "$@" \
    2> "$OUT/gpu.log" | tee "$OUT/gpu.txt"
note "bench/gpu.py: exit $?"

DMD2_TESTS_LANE=off timeout 150 $WITHOUT_SERVERS -m pytest -m gpu -q -p no:cacheprovider tests/bench/test_gpu_bench.py \
    tests/dmd2/test_on_device.py tests/dmd2/test_step_syncs.py tests/dmd2/test_compile.py 2>&1 \
    | tee "$OUT/pytest.txt"
note "gpu tests: exit $?"
