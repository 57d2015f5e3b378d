"""Measuring what a round costs on this machine: the cost tables the schedules plan with.

:func:`profile_costs` times, on random tokens, one verification (the target forward, then the
greedy or sampled acceptance) over ``R × w`` tokens for every block width ``w`` (and, for
``R > 1``, over ``w`` tokens of a single row, so that the table also covers the small batches left
when rows finish), and one drafting round, in the sampling mode of the generation, after a prompt
of ``CONTEXT_LENGTH`` tokens and again after ``LONG_CONTEXT_LENGTH``: the table keeps how each
cost grows with the context, which the schedule reads at each round's (a wide round over long
prompts costs more plain steps than over short ones). :func:`cost_table_for`
is what the default schedule uses: the table of this target, dtype, device, thread count, head and
batch size, profiled once and cached as JSON under ``$SPARK_GENERATE_CACHE/costs`` (default
``~/.cache/spark_generate``), so that later generations plan identically (a seeded sampled
generation depends on the plan, so it is reproducible run to run on the same machine). A table
measured while other processes kept the processors busy (:class:`~spark_generate.config.LoadWatch`)
would plan every later generation with their noise: it serves the process that measured it and
is not saved. With ``SPARK_GENERATE_PROFILE=0`` nothing is measured and the built-in
:meth:`~spark_generate.schedule.CostTable.estimate` is used. Threads whose first generations need
the same table at once measure it once: the others wait for it (measuring side by side would
time each other).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from spark_generate.cache import FeatureTap, target_forward
from spark_generate.config import LoadWatch, cache_folder, processor_name, write_json_atomically
from spark_generate.drafting import DraftBlock, DraftContext, DraftRequest, HeadDrafter
from spark_generate.heads import DSparkHead
from spark_generate.hf import cache_kwarg_name, crop_cache, take_cache
from spark_generate.packing import packed_linears, packed_row_counts, resolve_pack_linears
from spark_generate.rows import RowPrefixes, Sampling
from spark_generate.schedule import CostTable
from spark_generate.verify import verify_block

__all__ = ["cache_folder", "cost_table_for", "profile_costs"]

# Held while a cost table is looked up or measured, so that racing first calls measure it once.
_PROFILING_LOCK = threading.Lock()
# Tables measured while other processes loaded the machine, by the path they were not saved to.
_UNSAVED_TABLES: dict[Path, CostTable] = {}
CONTEXT_LENGTH = 64  # prompt tokens per row of the measurement
LONG_CONTEXT_LENGTH = 512  # ... and of the second one, for the costs' growth with the context


@torch.no_grad()
def profile_costs(
    model: PreTrainedModel,
    head: DSparkHead | None,
    *,
    num_drafts: int | None = None,
    batch_size: int = 1,
    greedy: bool = True,
    context_length: int = CONTEXT_LENGTH,
    long_context_length: int | None = LONG_CONTEXT_LENGTH,
    repeats: int = 4,
    path: str | Path | None = None,
    pack_linears: bool | None = None,
) -> CostTable:
    """Measures verification and drafting costs on this machine, optionally saving them as JSON.

    Runs a prefill of random tokens, then times (best of ``repeats``) one draft round of the head
    over ``batch_size`` rows and verifications (the target forward, then accepting greedily or by
    rejection sampling, as the generation will) over ``rows × (1 + n)`` tokens for ``n = 0 ..
    num_drafts``, with ``rows = batch_size`` and, if larger than 1, ``rows = 1``, rolling the cache
    back each time. Verification costs are made non-decreasing in the token count (timing noise
    removed).

    Args:
        model: The target.
        head: Its draft head (attached to it here), or None (suffix drafting only: no draft round).
        num_drafts: The most drafts a round verifies; default the head's block.
        batch_size: Rows per round.
        greedy: Draft greedily (else sample each slot, which costs more per slot).
        context_length: Prompt length of the measurement.
        long_context_length: A longer prompt to measure again, for the costs' growth with the
            context (:class:`~spark_generate.schedule.CostTable`); None: measure one length only.
        repeats: Timings per point; the fastest is kept.
        path: Where to write the table (JSON), or None.
        pack_linears: Measure with the linears packed as the generation will run them
            (:func:`~spark_generate.packing.resolve_pack_linears`; None: the generation's default).

    Returns:
        The cost table.
    """
    if head is not None:
        head.attach(model)
    num_drafts = _num_drafts(head, num_drafts)
    if long_context_length is not None and long_context_length <= context_length:
        raise ValueError(
            f"long_context_length={long_context_length} must exceed context_length={context_length} (or be None)."
        )
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if long_context_length is not None and positions is not None:  # a short-context model: as long as it allows
        long_context_length = min(long_context_length, positions - num_drafts - 1)
        long_context_length = long_context_length if long_context_length > context_length else None
    lengths = [context_length] if long_context_length is None else [context_length, long_context_length]
    seconds: list[dict[int, float]] = [{} for _ in lengths]
    draft_seconds = [0.0 for _ in lengths]
    modules = (model,) if head is None else (model, head)
    with packed_linears(*modules, enabled=resolve_pack_linears(model, pack_linears)):
        for rows in sorted({1, batch_size}):
            for index, length in enumerate(lengths):
                verify_seconds, draft_seconds[index] = _profile_batch(
                    model, head, num_drafts, rows, greedy, length, repeats
                )
                seconds[index].update({rows * (1 + n): verify_seconds[n] for n in range(num_drafts + 1)})
    points = sorted(seconds[0])
    verify_seconds = _non_decreasing([seconds[0][n] for n in points])
    table = CostTable(tuple(points), tuple(verify_seconds), draft_seconds[0], context_length)
    if long_context_length is not None:
        span = long_context_length - context_length
        longer = _non_decreasing([seconds[1][n] for n in points])
        growth = zip(verify_seconds, longer, strict=True)
        slopes = _non_decreasing([max(0.0, (high - low) / span) for low, high in growth])
        draft_slope = max(0.0, (draft_seconds[1] - draft_seconds[0]) / span)
        table = replace(table, verify_seconds_per_context=tuple(slopes), draft_seconds_per_context=draft_slope)
    if path is not None:
        table.save(path)
    return table


def _non_decreasing(values: list[float]) -> list[float]:
    """Each value capped by every later one.

    A forward over more tokens never costs less (nor grows slower with the context), so a timing
    spike at a small count (another process on the machine) is replaced by the cheapest larger count.
    """
    values = list(values)
    for index in range(len(values) - 2, -1, -1):
        values[index] = min(values[index], values[index + 1])
    return values


def _num_drafts(head: DSparkHead | None, num_drafts: int | None) -> int:
    """The widest block to measure: ``num_drafts``, else the head's block.

    Raises:
        ValueError: Neither a head nor ``num_drafts`` is given.
    """
    if num_drafts is not None:
        return num_drafts
    if head is None:
        raise ValueError("profiling without a draft head needs num_drafts=, the most drafts a round verifies.")
    return head.config.num_draft_tokens


def _profile_batch(
    model: PreTrainedModel,
    head: DSparkHead | None,
    num_drafts: int,
    batch_size: int,
    greedy: bool,
    context_length: int,
    repeats: int,
) -> tuple[list[float], float]:
    """Best-of-``repeats`` seconds of verifications over widths ``1 .. num_drafts + 1``, and of one head round.

    A verification is the target forward, then accepting as the generation will (greedily, or by
    rejection sampling, which costs noticeably more per round on a CPU), of a deterministic block
    (what it verifies does not change what it costs); with a head, its features are tapped as
    while generating. Without a head the draft round costs 0.
    """
    device = next(model.parameters()).device
    vocab_size = model.config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab_size, (batch_size, context_length), device=device)
    positions = torch.arange(context_length, device=device).expand(batch_size, -1)
    anchor_positions = positions[:, -1] + 1
    cache, cache_kwarg = take_cache(model, {}), cache_kwarg_name(model)
    sampling = Sampling(greedy=greedy, seeds=torch.zeros(batch_size, dtype=torch.int64, device=device))
    rows = torch.arange(batch_size, device=device)
    prefixes = RowPrefixes(input_ids, torch.full((batch_size,), context_length, device=device), rows)
    repeated_ids = input_ids.repeat(1, (num_drafts + 1) // context_length + 1)  # blocks may outgrow the context
    block = DraftBlock(repeated_ids[:, :num_drafts], None, None, None)
    drafter = None if head is None else HeadDrafter(head)

    def draft(num_new_rows: int) -> DraftBlock:
        context = DraftContext(features[:, -num_new_rows:], positions[:, -num_new_rows:])
        request = DraftRequest(input_ids[:, -1], anchor_positions, context, prefixes, sampling, LogitsProcessorList())
        return drafter.draft(request)

    def verify(width: int) -> None:
        block_positions = positions[:, -1:] + 1 + torch.arange(width, device=device)
        mask = torch.ones(batch_size, context_length + width, dtype=torch.long, device=device)
        target_logits = target_forward(
            model, repeated_ids[:, :width], cache=cache, cache_kwarg=cache_kwarg, attention_mask=mask,
            position_ids=block_positions, num_logits=width,
        )  # fmt: skip
        num_verified = torch.full((batch_size,), width - 1, device=device)
        verify_block(target_logits, block, num_verified, anchor_positions, LogitsProcessorList(), prefixes, sampling)
        if tap is not None:
            tap.take()
        crop_cache(cache, context_length)

    taps = contextlib.nullcontext() if head is None else FeatureTap(model, head.config.target_layer_ids, device)
    with taps as tap:
        target_forward(
            model, input_ids, cache=cache, cache_kwarg=cache_kwarg, attention_mask=torch.ones_like(input_ids),
            position_ids=positions, num_logits=1,
        )  # fmt: skip
        if tap is not None:
            features = tap.take()
            draft(context_length)  # fills the draft cache; a round then adds about one context row
        widths = range(1, num_drafts + 2)
        verify(1)  # warm-up
        # Repeats interleave the widths, so a slow or fast spell of the machine reaches all of them alike.
        timings = [[_timed(functools.partial(verify, width)) for width in widths] for _ in range(repeats)]
        draft_seconds = 0.0 if head is None else min(_timed(functools.partial(draft, 1)) for _ in range(repeats))
    return [min(column) for column in zip(*timings, strict=True)], draft_seconds


def cost_table_for(
    model: PreTrainedModel,
    head: DSparkHead | None,
    batch_size: int,
    greedy: bool = True,
    pack_linears: bool | None = None,
    num_drafts: int | None = None,
) -> CostTable:
    """This machine's cost table for ``model``, ``head``, ``batch_size`` and sampling mode: cached, else profiled once.

    ``num_drafts`` is the most drafts a round verifies (default: the head's block; required
    without a head).

    Keyed and profiled with the linear layers packed or not as the generation will run them
    (``pack_linears`` as in :func:`~spark_generate.packing.resolve_pack_linears`, and the row
    counts that run packed, :func:`~spark_generate.packing.packed_row_counts`). With
    ``SPARK_GENERATE_PROFILE=0`` returns :meth:`CostTable.estimate` without measuring.
    """
    device = next(model.parameters()).device
    num_drafts = _num_drafts(head, num_drafts)
    if os.environ.get("SPARK_GENERATE_PROFILE", "1") == "0":
        return CostTable.estimate(device.type, batch_size * (num_drafts + 1))
    pack = resolve_pack_linears(model, pack_linears)
    key = {**_machine_key(model, head, batch_size, device), "greedy": greedy, "packed_linears": pack}
    if pack:  # the row counts that run packed on this machine
        key["packed_from"] = packed_row_counts(model, *([] if head is None else [head]))
    key["context_lengths"] = [CONTEXT_LENGTH, LONG_CONTEXT_LENGTH]
    if head is None or num_drafts != head.config.num_draft_tokens:  # keys of head-only tables stay as they were
        key["num_drafts"] = num_drafts
    path = (
        cache_folder() / "costs" / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.json"
    )
    with _PROFILING_LOCK:
        if path in _UNSAVED_TABLES:
            return _UNSAVED_TABLES[path]
        if path.is_file():
            try:
                return CostTable.load(path)
            except (OSError, ValueError, KeyError):
                pass  # a damaged cache entry is measured again and replaced
        with LoadWatch() as watch:
            table = profile_costs(
                model, head, num_drafts=num_drafts, batch_size=batch_size, greedy=greedy, pack_linears=pack
            )
        if watch.quiet:
            write_json_atomically(path, {**table.to_dict(), "key": key})
        else:
            _UNSAVED_TABLES[path] = table
            watch.warn_unsaved(f"The cost table of {type(model).__name__} at batch size {batch_size}")
        return table


def _machine_key(
    model: PreTrainedModel, head: DSparkHead | None, batch_size: int, device: torch.device
) -> dict[str, object]:
    """What a cost table depends on: the target, the head, the dtype, the device and the threads."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}: {processor_name()}"
    return {
        "target": type(model).__name__,
        "target_config": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest(),
        "head_config": None
        if head is None
        else hashlib.sha256(head.config.to_json_string(use_diff=False).encode()).hexdigest(),
        "dtype": str(next(model.parameters()).dtype),
        "device": device_name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "batch_size": batch_size,
    }


def _timed(function: Callable[[], object]) -> float:
    """Wall seconds of one call (synchronising CUDA, so queued kernels are counted)."""
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start
