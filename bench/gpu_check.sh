#!/usr/bin/env bash
# The GPU checks in one go: bench/gpu.py at full size (SD3.5 Medium MMDiT, 1024 px, bf16; DDP and FSDP,
# world size 1) and the tests marked gpu. Everything lands in $OUT (default out/gpu-check):
#   gpu.txt  the printed table     gpu.json  its figures (written after each mode: DDP's survive a cut)
#   gpu.log  the run's stderr (Ray, ranks)     pytest.txt  the gpu tests     summary.txt  timings, nvidia-smi
# About 5 to 7 minutes on one H200 once Python is ready; each part has its own time limit, so one that
# hangs leaves the others' results, and the whole stays inside a device call's 10 minutes.
#
# Python, one of:
#   - default: the Makefile's own install (.venv from requirements.lock, CUDA torch; ~3 min the first time;
#     needs PyPI);
#   - WHEELS=DIR: no network (this workplace's device machines): the machine's python3, which holds a CUDA
#     torch, plus the wheels in DIR installed offline into /tmp/site. Fetch them on a machine with PyPI:
#         bash bench/gpu_check.sh --fetch-wheels     # -> .whl/part1 and .whl/part2, each under 60 MiB
#     Ray's wheel alone (79 MB) is over the 64 MiB a device call carries, so it takes two calls back to back
#     (the machine stays warm 30 s between them; /tmp survives, the repo's ignored paths too):
#         run(carry=[".whl/part1"], command="mkdir -p /tmp/wheels && cp .whl/part1/* /tmp/wheels/")
#         run(carry=[".whl/part2"], command="cp .whl/part2/* /tmp/wheels/ && WHEELS=/tmp/wheels bash bench/gpu_check.sh")
#   - PY=python: that interpreter, as it is.
set -u -o pipefail
cd "$(dirname "$0")/.."

# Pinned as requirements.lock pins them: what the device image (KINDS.md's package list) lacks of the bench's
# and the gpu tests' imports, or holds at versions these pins refuse (transformers 5.17 there; s3fs pins
# fsspec exactly); its huggingface_hub (1.33) suits these diffusers and transformers.
WHEEL_PACKAGES="ray diffusers transformers regex importlib_metadata fsspec s3fs aiobotocore aiohttp botocore aioitertools
jmespath jsonschema jsonschema-specifications referencing rpds-py"

if [ "${1:-}" = "--fetch-wheels" ]; then
    set -e
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude  # carried, never committed
    rm -rf .whl && mkdir -p .whl/all .whl/part1 .whl/part2
    pip=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
    for name in $WHEEL_PACKAGES; do
        pin=$(grep -i "^${name}==" requirements.lock)
        "$pip" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl/all "$pin"
    done
    ray=$(ls .whl/all/ray-*.whl)
    split -b 40M "$ray" ".whl/all/$(basename "$ray").piece-" && rm "$ray"
    for file in $(ls -S .whl/all/*); do  # largest first, each into the lighter part
        if [ "$(du -sb .whl/part1 | cut -f1)" -le "$(du -sb .whl/part2 | cut -f1)" ]; then
            mv "$file" .whl/part1/
        else
            mv "$file" .whl/part2/
        fi
    done
    rmdir .whl/all
    du -sh .whl/part1 .whl/part2
    exit 0
fi

OUT=${OUT:-out/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
started=$(date +%s)

if [ -n "${PY:-}" ]; then
    :
elif [ -n "${WHEELS:-}" ]; then
    for first in "$WHEELS"/*.piece-aa; do  # a wheel carried in pieces: put it back together
        [ -e "$first" ] && cat "${first%aa}"* > "${first%.piece-aa}" && rm "${first%aa}"*
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"  # the repository itself is not installed: import it from here
    PY=python3
else
    make .venv/.installed-stamp || exit 1
    PY=.venv/bin/python
fi
echo "python ready after $(( $(date +%s) - started )) s: $PY" | tee "$OUT/summary.txt"
nvidia-smi >> "$OUT/summary.txt" 2>&1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print(torch.__version__, torch.cuda.get_device_name(0))" \
    2>&1 | tee -a "$OUT/summary.txt" || exit 1

timeout 300 "$PY" -m bench.gpu --parallel ddp fsdp --workdir /tmp/dmd2-gpu --json "$OUT/gpu.json" \
    2> "$OUT/gpu.log" | tee "$OUT/gpu.txt"
status=$?
echo "bench: exit $status after $(( $(date +%s) - started )) s" | tee -a "$OUT/summary.txt"
if [ "$status" -eq 124 ]; then  # cut short, it leaves Ray's processes and its ranks' GPU memory behind
    "$PY" -m ray.scripts.scripts stop --force > /dev/null 2>&1
fi

# Only the modules that hold gpu tests: the others import servers' clients (prefect, mlflow) a bare image lacks.
tests="tests/bench tests/dmd2/test_on_device.py"
"$PY" -c "import moto, boto3" 2> /dev/null && tests="$tests tests/infra/trainers/test_group.py"
timeout 180 "$PY" -m pytest -m gpu -q -p no:cacheprovider $tests 2>&1 | tee "$OUT/pytest.txt"
echo "gpu tests: exit $? after $(( $(date +%s) - started )) s" | tee -a "$OUT/summary.txt"
