#!/usr/bin/env bash
# The GPU checks, in one command of at most 8 minutes on an H200 (results under $OUT).
#
# 1. the CUDA tests: the Triton rejection kernel against the PyTorch reference, compiled for the
#    device (not the interpreter), and the rest of the verification tests on CUDA tensors;
# 2. benchmarks/bench_rejection.py --device cuda: reference and Triton latencies, wall clock and the
#    kernels' own time (the goal: under 50 us for B=8, K=8, V=152k; 2026-12-04: 137-318 us wall);
# 3. benchmarks/bench_round.py on a random Qwen3-0.6B-shaped target in bfloat16 with an
#    always-right drafter: the round's phases in decode steps, host-device synchronisations per
#    round and kernel launches per draft slot.
#
# How the wheels travel: the device image has a CUDA build of torch, triton and transformers 5.17,
# and no internet; spark_generate needs transformers >= 5.18. On the development machine (which
# reaches the package registries), first fill .whl/ (gitignored, about 14 MB):
#
#     bash benchmarks/gpu_check.sh --fetch-wheels
#
# then run on the device, carrying that folder (the working tree travels by itself; the shipped
# head's folder, 27 MB, counts against the 64 MiB a call may carry):
#
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# A CPU dry run of the same steps, scaled down (Triton through its interpreter, a tiny target):
#
#     DRY_RUN=1 OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# huggingface-hub as in the image (transformers 5.24 takes >= 1.31; 2.x would need httpx2, absent);
# the image has hypothesis and sortedcontainers.
WHEELS=(transformers==5.24.0 tokenizers==0.23.3 huggingface-hub==1.33.0)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # The device image runs Python 3.12 on x86-64: fetch the wheels for it, whatever runs here.
    pip download --no-deps --dest .whl --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "${WHEELS[@]}"
    du -sh .whl
    exit 0
fi

OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu_check.log"; }

if [[ -z "${DRY_RUN:-}" ]]; then
    log "installing spark_generate and the carried wheels (no index)"
    # `python -m pip`: the image's python (a virtualenv holding torch) is not the one `pip` serves.
    python -m pip install --quiet --no-index --no-deps --find-links .whl "${WHEELS[@]}"
    python -m pip install --quiet --no-deps --no-build-isolation -e .
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/gpu_check.log"
    export TRITON_INTERPRET=0 DEVICE=cuda DTYPE=bfloat16 TARGET=qwen3-0.6b NEW_TOKENS=64
    REJECTION_ARGS=()
else
    log "dry run on the CPU"
    export TRITON_INTERPRET=1 DEVICE=cpu DTYPE=float32 TARGET=tiny NEW_TOKENS=16
    REJECTION_ARGS=(--batch-sizes 1 8 --block-sizes 8 --vocab-sizes 32000 --repeats 2)
fi
export HF_HUB_OFFLINE=1
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" | tee -a "$OUT/gpu_check.log"

log "1/3 tests"
TESTS=(tests/test_triton_kernel.py tests/test_rejection_sample.py)
python -c "import scipy" 2>/dev/null && TESTS+=(tests/test_sampling.py) || log "no scipy in the image: tests/test_sampling.py skipped"
timeout 240 python -m pytest "${TESTS[@]}" -q -x -m "not slow" -p no:cacheprovider 2>&1 | tail -n 25 \
    | tee "$OUT/tests.log" || log "tests failed or timed out"

log "2/3 bench_rejection"
timeout 120 python benchmarks/bench_rejection.py --device "$DEVICE" --output "$OUT/rejection_$DEVICE.csv" \
    "${REJECTION_ARGS[@]}" 2>&1 | tail -n 5 | tee -a "$OUT/gpu_check.log" || log "bench_rejection failed or timed out"

log "3/3 bench_round"
timeout 180 python benchmarks/bench_round.py --target "$TARGET" --oracle --device "$DEVICE" --dtype "$DTYPE" \
    --new-tokens "$NEW_TOKENS" --output "$OUT/round_${TARGET}-oracle_$DEVICE.csv" 2>&1 | tail -n 8 \
    | tee -a "$OUT/gpu_check.log" || log "bench_round failed or timed out"
log "done: $(ls "$OUT")"
