"""The DSpark decoding loop, top to bottom: prefill, then speculative steps until every row stops.

:func:`decode` is a ``custom_generate`` callable: ``generate()`` has already merged the generation
config, built the logits processors (warpers included when sampling) and the stopping criteria,
and prepared the attention mask; this module runs the decoding itself.

1. **Prefill** the target on the prompt with forward hooks on the tapped layers
   (:class:`~spark_generate.cache.FeatureTap`), and choose the first new token from its last logits.
   That token is the first *anchor*: committed, but not yet seen by the target.
2. **Speculative step** (:func:`speculative_step`), repeated:

   a. let the suffix drafter (if any) propose a continuation of each row from what was already
      written, and ask the schedule where each row drafts this round: from the suffix index, from
      the head (one pass for every row, :class:`~spark_generate.drafting.Drafter`), or not at all
      (a plain decoding step for that row); then let it choose how many drafts each row verifies
      (:mod:`spark_generate.schedule`);
   b. run the target once over ``[anchor, drafts]``, process its logits position by position and
      accept a prefix plus one recovered or bonus token (:func:`~spark_generate.verify.verify_block`);
   c. commit the emitted tokens one at a time through the stopping criteria (an EOS, a stop string
      or the length limit inside an accepted block ends the row right there);
   d. roll back: crop the target cache after the most tokens any row kept, mark the other rows'
      extra entries as holes in the attention mask, keep the tapped features of the kept tokens
      for the next draft, and drop finished rows from every per-row state
      (:meth:`RunningRows.select`).

Rows accept different numbers of tokens (ragged acceptance): every row keeps its own absolute
positions, and the shared cache holds holes that the mask hides. Randomness is counter-based
Philox keyed by a per-row seed and the absolute position of each token, so a row's tokens depend
only on its seed, its own tokens and the schedule's plan.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from transformers import Cache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from spark_generate.cache import FeatureTap, check_holes_allowed, target_forward
from spark_generate.drafting import DraftBlock, DraftContext, Drafter, DraftRequest, HeadDrafter, PendingContext
from spark_generate.heads import DSparkHead
from spark_generate.hf import cache_kwarg_name, crop_cache, pop_prepared_inputs, take_cache, vocabulary_free_processors
from spark_generate.packing import packed_linears, resolve_pack_linears
from spark_generate.profiling import cost_table_for
from spark_generate.rows import UNSEEN_POSITION, RowPrefixes, Sampling, apply_processors, rows_by_length
from spark_generate.sampling import inverse_cdf_sample
from spark_generate.schedule import AdaptiveSchedule, Schedule, ScheduleRun, start_schedule
from spark_generate.suffix import CorpusIndex, SuffixDrafter
from spark_generate.telemetry import DraftSource, DSparkGenerateOutput, SpeculativeStats, record_step, stack_per_step
from spark_generate.verify import check_finite, verify_block

__all__ = [
    "SUFFIX_BY_DEFAULT",
    "check_generation_config",
    "decode",
    "resolve_schedule",
    "speculative_generate",
    "speculative_step",
    "suffix_drafter",
    "suffix_enabled",
]

# While the schedule steps aside, the draft context of the tokens committed since the last draft
# is kept up to this many rows per row; older ones are never shown to the head (a probing round
# then costs one backbone pass over at most this many rows, whatever the gap).
MAX_CATCH_UP_ROWS = 32

# Suffix drafting beside the head (and alone without one) unless a call turns it off.
SUFFIX_BY_DEFAULT = True

# Finished rows leave the batch together once they are at least a quarter of it (see drop_finished_rows).
DROP_FRACTION = 4


@dataclass(frozen=True)
class DecodeSettings:
    """What stays fixed during one generation."""

    target: PreTrainedModel
    num_draft_tokens: int  # slots of a round's block: the widest drafter's
    head_slots: int  # the head's draft slots, 0 without a head
    vocab_size: int  # the target's (rows of its LM head)
    logits_processor: LogitsProcessorList
    warpers: LogitsProcessorList  # the processors that also apply to draft logits
    stopping_criteria: StoppingCriteriaList
    max_length: int
    cache_kwarg: str
    tap: FeatureTap | None  # None without a head
    streamer: object | None


@dataclass
class RunningRows:
    """Per-row state of the rows still running, all indexed alike; :meth:`select` keeps a subset.

    Every field is per-row: a tensor whose first dimension is the row, a value with
    ``select_rows(keep)``, or a cache (target or draft) that drops rows in place.
    """

    rows: torch.Tensor  # [R] index of each running row in the batch
    sampling: Sampling  # seeds [R]
    anchor_positions: torch.Tensor  # [R]
    cache_mask: torch.Tensor  # [R, C]
    context: PendingContext | None  # [R, C_new, ·] in chunks; None without a head
    cache: Cache
    drafter: Drafter | None  # the head's
    suffix: Drafter | None

    def select(self, keep: torch.Tensor) -> None:
        """Keeps the rows ``keep`` (``[R']`` indices into the running rows) in every field."""
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                setattr(self, field.name, value[keep])
            elif isinstance(value, Cache):
                value.batch_select_indices(keep)
            elif isinstance(value, (Sampling, PendingContext)):
                setattr(self, field.name, value.select_rows(keep))
            else:
                value.select_rows(keep)


@dataclass
class DecodeState:
    """The loop's state: fixed settings, the running rows, and the whole batch's tokens and reports.

    ``token_ids``, ``lengths`` and ``unfinished`` cover the whole batch; ``running.rows`` maps the
    running rows to it.
    """

    settings: DecodeSettings
    running: RunningRows
    schedule: ScheduleRun
    token_ids: torch.Tensor  # [B, max_length + S + 1]
    lengths: torch.Tensor  # [B]
    unfinished: torch.Tensor  # [B] bool
    stats: SpeculativeStats
    scores: list[list[torch.Tensor]] | None = None  # per row, per token: processed logits [V]
    raw_logits: list[list[torch.Tensor]] | None = None

    @property
    def prefixes(self) -> RowPrefixes:
        """The committed tokens of the running rows."""
        rows = self.running.rows
        return RowPrefixes(self.token_ids[rows], self.lengths[rows], rows)

    @property
    def anchor_ids(self) -> torch.Tensor:
        """``[R]`` the last committed token of each running row."""
        rows = self.running.rows
        return self.token_ids[rows, self.lengths[rows] - 1]


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    dspark_head: DSparkHead | None = None,
    dspark_streamer: object | None = None,
    dspark_seed: int | torch.Tensor | None = None,
    dspark_schedule: Schedule | AdaptiveSchedule | None = None,
    dspark_drafter: Callable[[DSparkHead], Drafter] | None = None,
    dspark_pack_linears: bool | None = None,
    dspark_suffix: bool | CorpusIndex | None = None,
    **model_kwargs: object,
) -> torch.Tensor | DSparkGenerateOutput:
    """DSpark decoding as a ``custom_generate`` callable for any Transformers causal LM.

    Example::

        out = target.generate(**inputs, custom_generate=spark_generate.decode, dspark_head=head,
                              max_new_tokens=64, do_sample=True, temperature=0.7)

    ``generate()`` prepares everything and calls this with its own arguments; the ``dspark_*``
    keywords are ours (``generate()`` does not hand a callable its ``streamer``, so pass
    ``dspark_streamer=`` instead). With ``stop_strings``, ``generate()`` needs a ``tokenizer=``
    that it does not forward to callables: use :class:`~spark_generate.DSparkForCausalLM`, or pass
    ``stopping_criteria=[StopStringCriteria(tokenizer, stop_strings)]``.

    Args:
        model: The target (passed by ``generate()``).
        input_ids: ``[B, P]`` prompts, left-padded (passed by ``generate()``).
        logits_processor: Passed by ``generate()``.
        stopping_criteria: Passed by ``generate()``.
        generation_config: Passed by ``generate()``.
        dspark_head: The draft head for this target; it drafts in the target's dtype (a head in
            another dtype drafts through a copy, see :meth:`~spark_generate.heads.DSparkHead.for_drafting`).
        dspark_streamer: A Transformers streamer (batch size 1); gets the prompt, then each
            committed chunk.
        dspark_seed: Philox seed: an ``int`` (per-row seeds derived from it) or int64 ``[B]``
            (a row's output then depends only on its seed and the schedule's plan); None draws
            seeds from torch's global generator, so ``torch.manual_seed`` makes runs reproducible.
        dspark_schedule: How many drafts to verify per step, and whether to draft at all; default
            :class:`~spark_generate.schedule.AdaptiveSchedule` with the head's ``sts_temperatures``.
        dspark_drafter: Builds the drafter of this generation from the head, instead of
            :class:`~spark_generate.drafting.HeadDrafter` (the head still names the tapped layers
            and the block size); for tests and other drafters.
        dspark_pack_linears: Run the float32 CPU linear layers of the target and head through
            oneDNN with pre-packed weights (:mod:`spark_generate.packing`) from the row counts at
            which that measured faster on this machine; None: on a CPU for a float32 target,
            unless ``SPARK_GENERATE_PACK_LINEARS=0``.
        dspark_suffix: Suffix drafting (:mod:`spark_generate.suffix`) beside the head, chosen
            per row and round by the schedule: None or True on (:data:`SUFFIX_BY_DEFAULT`), a
            :class:`~spark_generate.suffix.CorpusIndex` on with that corpus of earlier texts,
            False off. Without a head it is the only drafter.
        **model_kwargs: ``attention_mask`` and the cache ``generate()`` prepared.

    Returns:
        ``[B, P + N]`` sequences, or a :class:`DSparkGenerateOutput` with
        ``return_dict_in_generate=True``.
    """
    suffix = suffix_drafter(dspark_suffix)
    if dspark_head is None and suffix is None:
        raise ValueError(
            "spark_generate.decode needs a drafter: pass dspark_head=DSparkHead.from_pretrained(...) to generate() "
            "(or use DSparkForCausalLM(model).generate(..., assistant=head)), or leave suffix drafting on "
            f"(dspark_suffix was {dspark_suffix!r})."
        )
    attention_mask = model_kwargs.pop("attention_mask", None)
    cache = take_cache(model, model_kwargs)
    pop_prepared_inputs(model_kwargs)
    unsupported = sorted(name for name, value in model_kwargs.items() if value is not None)
    if unsupported:
        raise ValueError(
            f"DSpark decoding does not support the model inputs {unsupported}; "
            "expected only input_ids and attention_mask."
        )
    return speculative_generate(
        model, dspark_head, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        generation_config=generation_config, attention_mask=attention_mask, schedule=dspark_schedule,
        seed=dspark_seed, streamer=dspark_streamer, cache=cache, drafter=dspark_drafter,
        pack_linears=dspark_pack_linears, suffix=suffix,
    )  # fmt: skip


def speculative_generate(
    target: PreTrainedModel,
    head: DSparkHead,
    input_ids: torch.Tensor,
    *,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    attention_mask: torch.Tensor | None = None,
    schedule: Schedule | AdaptiveSchedule | None = None,
    seed: int | torch.Tensor | None = None,
    streamer: object | None = None,
    cache: Cache | None = None,
    drafter: Callable[[DSparkHead], Drafter] | None = None,
    pack_linears: bool | None = None,
    suffix: SuffixDrafter | None = None,
) -> torch.Tensor | DSparkGenerateOutput:
    """Prefills, then runs speculative steps until every row has stopped (arguments as in :func:`decode`).

    ``head`` may be None when ``suffix`` (this generation's suffix drafter) is given.
    """
    check_generation_config(generation_config)
    if head is None and suffix is None:
        raise ValueError(
            "DSpark decoding needs a drafter: a draft head (dspark_head= / assistant=), suffix drafting "
            "(dspark_suffix= / suffix=), or both."
        )
    if head is not None:
        head = head.for_drafting(target)  # attached; a copy in the target's dtype when the head's differs
    schedule = resolve_schedule(schedule, head)
    if head is not None and not isinstance(schedule, AdaptiveSchedule):
        suffix = None  # only the adaptive schedule chooses between drafters; the others draft with the head
    batch_size, prompt_length = input_ids.shape
    if prompt_length == 0:
        raise ValueError(
            f"the prompt is empty (input_ids has shape {list(input_ids.shape)}); DSpark decoding needs at least "
            "one prompt token: start the prompt with the tokenizer's BOS token."
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {list(attention_mask.shape)} but input_ids has {list(input_ids.shape)}; "
            "expected equal shapes (pass the mask the tokenizer returned with these input_ids)."
        )
    if streamer is not None and batch_size != 1:
        raise ValueError(f"streaming needs batch size 1; got {batch_size} prompts. Stream one prompt at a time.")
    num_drafts = max(0 if head is None else head.config.num_draft_tokens, 0 if suffix is None else suffix.max_tokens)
    max_new_tokens = generation_config.max_length - prompt_length
    check_holes_allowed(target, batch_size, generation_config.max_length + max_new_tokens * num_drafts)
    pad_token_id = _pad_token_id(generation_config)
    token_ids = input_ids.new_full((batch_size, generation_config.max_length + num_drafts + 1), pad_token_id or 0)
    token_ids[:, :prompt_length] = input_ids
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    greedy = not generation_config.do_sample
    pack = resolve_pack_linears(target, pack_linears)
    cost_table = None
    if isinstance(schedule, AdaptiveSchedule) and schedule.cost_table is None:
        cost_table = cost_table_for(target, head, batch_size, greedy=greedy, pack_linears=pack, num_drafts=num_drafts)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    try:
        cache = take_cache(target, {}) if cache is None else cache
        cache_kwarg = cache_kwarg_name(target)
        tap = None if head is None else FeatureTap(target, head.config.target_layer_ids, head.fc.weight.device)
        modules = (target,) if head is None else (target, head)
        with packed_linears(*modules, enabled=pack), tap or contextlib.nullcontext():
            logits, context = prefill(target, tap, input_ids, attention_mask, cache, cache_kwarg)
            settings = DecodeSettings(
                target=target, num_draft_tokens=num_drafts, logits_processor=logits_processor,
                head_slots=0 if head is None else head.config.num_draft_tokens,
                vocab_size=target.get_output_embeddings().weight.shape[0],
                warpers=LogitsProcessorList() if greedy else vocabulary_free_processors(logits_processor),
                stopping_criteria=stopping_criteria, max_length=generation_config.max_length,
                cache_kwarg=cache_kwarg, tap=tap, streamer=streamer,
            )  # fmt: skip
            running = RunningRows(
                rows=torch.arange(batch_size, device=input_ids.device),
                sampling=Sampling(greedy, _row_seeds(seed, batch_size, input_ids.device)),
                anchor_positions=attention_mask.long().sum(dim=1), cache_mask=attention_mask,
                context=None if context is None else PendingContext((context,)),
                cache=cache, drafter=None if head is None else (drafter or HeadDrafter)(head), suffix=suffix,
            )  # fmt: skip
            state = DecodeState(
                settings=settings, running=running, schedule=start_schedule(schedule, cost_table, num_drafts),
                token_ids=token_ids, lengths=torch.full((batch_size,), prompt_length, device=input_ids.device),
                unfinished=torch.ones(batch_size, dtype=torch.bool, device=input_ids.device),
                stats=SpeculativeStats.zeros(batch_size, num_drafts),
                scores=[[] for _ in range(batch_size)] if want_scores else None,
                raw_logits=[[] for _ in range(batch_size)] if want_logits else None,
            )  # fmt: skip
            commit_first_token(state, logits)
            while len(state.running.rows):
                speculative_step(state)
    finally:
        if streamer is not None:
            streamer.end()
    return _outputs(state, generation_config, pad_token_id)


def suffix_enabled(suffix: bool | CorpusIndex | None) -> bool:
    """Whether ``suffix`` (None: :data:`SUFFIX_BY_DEFAULT`, a bool, or a corpus) turns suffix drafting on.

    Raises:
        ValueError: ``suffix`` is none of these.
    """
    if suffix is None:
        return SUFFIX_BY_DEFAULT
    if isinstance(suffix, (bool, CorpusIndex)):
        return suffix is not False
    raise ValueError(
        f"suffix={suffix!r}; expected None (the default), True, False, or a spark_generate.suffix.CorpusIndex of "
        "earlier texts."
    )


def suffix_drafter(suffix: bool | CorpusIndex | None) -> SuffixDrafter | None:
    """This generation's suffix drafter (with the corpus ``suffix`` may be), or None when suffix drafting is off.

    Its drafts may outgrow the head's block: they reach
    :data:`~spark_generate.suffix.MAX_DRAFT_TOKENS` where a match is long enough.
    """
    if not suffix_enabled(suffix):
        return None
    return SuffixDrafter(corpus=suffix if isinstance(suffix, CorpusIndex) else None)


def resolve_schedule(
    schedule: Schedule | AdaptiveSchedule | None, head: DSparkHead | None
) -> Schedule | AdaptiveSchedule:
    """The schedule to use: the given one, or by default :class:`AdaptiveSchedule` with the head's STS temperatures.

    Raises:
        ValueError: ``schedule`` is not a schedule object (a string, say).
    """
    if schedule is None:
        return AdaptiveSchedule(temperatures=None if head is None else head.sts_temperatures)
    if isinstance(schedule, AdaptiveSchedule) or (callable(schedule) and not isinstance(schedule, (str, type))):
        return schedule
    raise ValueError(
        f"schedule={schedule!r} is not a schedule; expected a schedule object from spark_generate.schedule: "
        "AdaptiveSchedule() (the default), FixedLength(), ConfidenceThreshold(0.5) or GoodputSchedule(cost_table)."
    )


def prefill(
    target: PreTrainedModel,
    tap: FeatureTap | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Cache,
    cache_kwarg: str,
) -> tuple[torch.Tensor, DraftContext | None]:
    """Runs the target on the prompts: ``[B, V]`` float32 next-token logits and the first draft context (or None)."""
    real_positions = attention_mask.long().cumsum(dim=1) - 1
    logits = target_forward(
        target, input_ids, cache=cache, cache_kwarg=cache_kwarg, attention_mask=attention_mask,
        position_ids=real_positions.masked_fill(attention_mask == 0, 1), num_logits=1,
    )[:, -1].float()  # fmt: skip
    check_finite(logits)
    if tap is None:
        return logits, None
    return logits, DraftContext(tap.take(), real_positions.masked_fill(attention_mask == 0, UNSEEN_POSITION))


def commit_first_token(state: DecodeState, logits: torch.Tensor) -> None:
    """Chooses and commits the token after each prompt from the prefill's ``[B, V]`` logits."""
    running = state.running
    scores = apply_processors(state.settings.logits_processor, state.prefixes, state.token_ids[:, :0], logits)
    if running.sampling.greedy:
        first_ids = scores.argmax(dim=-1)
    else:
        probs = torch.softmax(scores, dim=-1)
        first_ids = inverse_cdf_sample(
            probs, seed=running.sampling.seeds, positions=running.anchor_positions, validate=False
        )
    commit(state, first_ids[:, None], torch.ones_like(first_ids), scores[:, None], logits[:, None])
    drop_finished_rows(state)


def speculative_step(state: DecodeState) -> None:
    """Drafts (or not), verifies and commits one block for every running row (see the module docstring)."""
    settings, running = state.settings, state.running
    num_rows, start = len(running.rows), time.perf_counter()
    anchor_ids, prefixes = state.anchor_ids, state.prefixes
    live = state.unfinished[running.rows]  # finished rows may ride along until they are dropped
    block, sources = draft_round(state, anchor_ids, prefixes)
    drafting = bool((sources != DraftSource.PLAIN).any())
    num_verified = torch.zeros(num_rows, dtype=torch.int64, device=anchor_ids.device)
    if drafting:
        num_verified = state.schedule.lengths(block.confidence_logits, num_rows, settings.num_draft_tokens, sources)
        budget = settings.max_length - state.lengths[running.rows] - 1  # a row never emits past max_length
        budget = torch.where(live, budget.clamp(min=0), 0)  # a finished row only steps along, one token a round
        num_verified = torch.minimum(num_verified.to(budget.device), budget)
    width = int(num_verified.max()) + 1
    verify_start = time.perf_counter()

    block_ids = torch.cat([anchor_ids[:, None], block.token_ids[:, : width - 1]], dim=1)
    block_positions = running.anchor_positions[:, None] + torch.arange(width, device=block_ids.device)
    attention_mask = torch.cat([running.cache_mask, running.cache_mask.new_ones(num_rows, width)], dim=1)
    target_logits = target_forward(
        settings.target, block_ids, cache=running.cache, cache_kwarg=settings.cache_kwarg,
        attention_mask=attention_mask, position_ids=block_positions, num_logits=width,
    )  # fmt: skip
    verdict = verify_block(
        target_logits, block, num_verified, running.anchor_positions, settings.logits_processor, prefixes,
        running.sampling,
    )  # fmt: skip
    if drafting:
        state.schedule.record(num_verified, verdict.num_emitted, live, sources)
    record_step(
        state.stats, running.rows, num_verified, verdict.num_accepted, sources, live, start, verify_start
    )  # fmt: skip

    commit(state, verdict.token_ids, verdict.num_emitted, verdict.target_scores, target_logits)
    kept = int(verdict.num_emitted.max())  # the anchor and accepted drafts of the longest row
    crop_cache(running.cache, running.cache_mask.shape[1] + kept)
    kept_mask = torch.arange(kept, device=block_ids.device)[None] < verdict.num_emitted[:, None]
    running.cache_mask = torch.cat([running.cache_mask, kept_mask.to(running.cache_mask.dtype)], dim=1)
    if settings.tap is not None:
        new_context = DraftContext(
            settings.tap.take()[:, :kept], torch.where(kept_mask, block_positions[:, :kept], UNSEEN_POSITION)
        )
        running.context = running.context.append(new_context, MAX_CATCH_UP_ROWS)
    running.anchor_positions = running.anchor_positions + verdict.num_emitted
    drop_finished_rows(state)


def draft_round(
    state: DecodeState, anchor_ids: torch.Tensor, prefixes: RowPrefixes
) -> tuple[DraftBlock, torch.Tensor]:
    """This round's drafts of every running row and ``[R]`` where each came from (:class:`DraftSource`).

    The suffix drafter proposes first (a function of the committed tokens only); the schedule then
    chooses each row's source from those proposals and the past, before the head draws anything;
    the head runs (once, for every row) only if some row drafts with it.
    """
    settings, running = state.settings, state.running
    request = DraftRequest(anchor_ids, running.anchor_positions, None, prefixes, running.sampling, settings.warpers)
    blocks: dict[int, DraftBlock] = {}
    if running.suffix is not None:
        blocks[DraftSource.SUFFIX] = running.suffix.draft(request)
    suffix_block = blocks.get(DraftSource.SUFFIX)
    sources = state.schedule.sources(
        None if suffix_block is None else suffix_block.confidence_logits, len(anchor_ids), settings.head_slots,
        context_length=running.cache_mask.shape[1],
    )  # fmt: skip
    if bool((sources == DraftSource.HEAD).any()):
        blocks[DraftSource.HEAD] = running.drafter.draft(replace(request, context=running.context.take()))
        running.context = PendingContext()  # now in the drafter's cache
    if bool((sources == DraftSource.PLAIN).all()):
        return DraftBlock.nothing(anchor_ids), sources
    block = DraftBlock.by_row(blocks, sources.to(anchor_ids.device), settings.num_draft_tokens, settings.vocab_size)
    return block, sources


def commit(
    state: DecodeState,
    token_ids: torch.Tensor,
    num_emitted: torch.Tensor,
    scores: torch.Tensor,
    raw_logits: torch.Tensor,
) -> None:
    """Appends emitted tokens one at a time, stopping each row at its first stopping criterion.

    Args:
        state: The loop state; ``token_ids``, ``lengths`` and ``unfinished`` are updated.
        token_ids: ``[R, W]`` emitted tokens of the running rows (-1 after ``num_emitted``).
        num_emitted: ``[R]`` how many.
        scores: ``[R, W, V]`` processed logits each token was chosen from.
        raw_logits: ``[R, W, V]`` the target's raw logits for them (recorded in float32).
    """
    settings, running_rows = state.settings, state.running.rows
    start_lengths = state.lengths[running_rows].clone()
    for slot in range(int(num_emitted.max())):
        live = (slot < num_emitted) & state.unfinished[running_rows]
        if not live.any():
            break
        rows = running_rows[live]
        state.token_ids[rows, state.lengths[rows]] = token_ids[live, slot]
        state.lengths[rows] += 1
        stop = state.lengths[rows] >= settings.max_length
        slot_scores = scores[:, slot] if bool(live.all()) else scores[live, slot]  # a view when every row emits
        for length, group in rows_by_length(state.lengths[rows]):
            group_scores = slot_scores if len(group) == len(rows) else slot_scores[group]
            stop[group] |= settings.stopping_criteria(state.token_ids[rows[group], :length], group_scores).to(
                stop.device
            )
        state.unfinished[rows] &= ~stop
        for recorded, values in ((state.scores, scores), (state.raw_logits, raw_logits)):
            if recorded is not None:
                for row, row_values in zip(rows.tolist(), values[live, slot].float(), strict=True):
                    recorded[row].append(row_values)
    if settings.streamer is not None:  # batch size 1: the only row is row 0
        chunk = state.token_ids[0, int(start_lengths[0]) : int(state.lengths[0])]
        if len(chunk):
            settings.streamer.put(chunk.cpu())


def drop_finished_rows(state: DecodeState) -> None:
    """Removes finished rows from every per-row state (see :meth:`RunningRows.select`).

    Selecting rows copies the target's whole KV cache, whatever the number of rows dropped, while a
    finished row left in the batch only costs its share of the next forwards (its tokens are never
    committed). Finished rows are therefore dropped together, once they are at least
    ``1 / DROP_FRACTION`` of the running rows, or when no row is left running.
    """
    running = state.unfinished[state.running.rows]
    num_finished = len(running) - int(running.sum())
    if num_finished == 0 or 0 < num_finished * DROP_FRACTION < len(running):
        return
    keep = running.nonzero()[:, 0]
    if not len(keep):  # everything stopped: nothing left to select in the caches
        state.running.rows = keep
        return
    state.running.select(keep)


def check_generation_config(generation_config: GenerationConfig) -> None:
    """Refuses decoding modes DSpark does not implement (beam search, contrastive search, ...).

    Raises:
        ValueError: The configuration asks for another mode than greedy decoding or sampling.
    """
    mode = generation_config.get_generation_mode()
    if mode.value not in ("greedy_search", "sample"):
        raise ValueError(
            f"DSpark decoding supports greedy decoding and sampling; got generation mode {mode.value!r} "
            f"(num_beams={generation_config.num_beams}, penalty_alpha={generation_config.penalty_alpha}). "
            "Set num_beams=1 or generate without the DSpark head."
        )
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise ValueError(f"{flag}=True is not supported by DSpark decoding; set it to False.")


def _pad_token_id(generation_config: GenerationConfig) -> int | None:
    """``pad_token_id``, else the first EOS id (what ``generate()`` pads finished rows with)."""
    if generation_config.pad_token_id is not None:
        return int(generation_config.pad_token_id)
    eos = generation_config.eos_token_id
    return int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None


def _row_seeds(seed: int | torch.Tensor | None, batch_size: int, device: torch.device) -> torch.Tensor:
    if isinstance(seed, torch.Tensor):
        if seed.shape != (batch_size,) or seed.dtype.is_floating_point:
            raise ValueError(
                f"seed has shape {list(seed.shape)} and dtype {seed.dtype}; expected integers of shape [{batch_size}]."
            )
        return seed.to(device=device, dtype=torch.int64)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**62, (batch_size,), generator=generator).to(device)


def _outputs(
    state: DecodeState, generation_config: GenerationConfig, pad_token_id: int | None
) -> torch.Tensor | DSparkGenerateOutput:
    total = int(state.lengths.max())
    if pad_token_id is None and bool((state.lengths < total).any()):
        raise ValueError(
            "rows stopped at different lengths but there is no pad_token_id (nor eos_token_id) to pad them with; "
            "set generation_config.pad_token_id."
        )
    sequences = state.token_ids[:, :total]
    if not generation_config.return_dict_in_generate:
        return sequences
    return DSparkGenerateOutput(
        sequences=sequences,
        scores=None if state.scores is None else stack_per_step(state.scores),
        logits=None if state.raw_logits is None else stack_per_step(state.raw_logits),
        dspark_stats=state.stats,
    )
