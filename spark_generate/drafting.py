"""Drafting one block: a parallel backbone pass, then the serial Markov head, slot by slot.

For every row of the batch, :func:`draft_block` runs the head's backbone once over the block
``[anchor, MASK, ...]`` (feeding it the target features of the tokens committed since the last
round), then walks the ``S`` draft slots left to right. Slot ``j`` gets its logits from
:meth:`~spark_generate.heads.DSparkHead.draft_step` given the token drafted at ``j - 1``, is
scattered into the target vocabulary, and goes through **the same logits processors as the
target**, with the row's committed tokens plus the drafts so far as prefix. The processed
distribution, in float32, is what the draft token is sampled from (on the ``DRAFT`` random stream)
and exactly what verification later uses as ``q``: nothing is recomputed. Greedy decoding takes the
argmax of the processed logits instead, and keeps no distribution (``q`` is one-hot). Logits are
processed in float32 on both sides, as plain ``generate()`` does.

Processors see real prefixes, so rows of different lengths are processed in groups of equal
length (:func:`rows_by_length`): length-dependent processors (``min_new_tokens``, no-repeat
n-grams) then behave exactly as in plain ``generate()``. Processors must treat rows
independently; the one standard processor with per-row state (the repetition penalty's
``prompt_ignore_length``, which skips left padding) is sliced to the rows of each call. Custom
processors that index rows (``prefix_allowed_tokens_fn`` reads ``batch_id``) see the rows of a
group renumbered from 0, so they are only exact with batch size 1.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from spark_generate.heads import DraftKVCache, DSparkHead
from spark_generate.kernels import RandomStream
from spark_generate.sampling import sample

__all__ = [
    "UNSEEN_POSITION",
    "DraftBlock",
    "DraftContext",
    "RowPrefixes",
    "Sampling",
    "apply_processors",
    "draft_block",
    "rows_by_length",
]

# Context rows with this position are never attended to (the draft's mask shows a block only the
# context rows before its anchor): left padding of the prompt, and holes left by rejected tokens.
UNSEEN_POSITION = 2**40


@dataclass(frozen=True)
class RowPrefixes:
    """The committed tokens of every row, as the logits processors and stopping criteria see them.

    Attributes:
        token_ids: ``[B, C]`` left-padded prompt, then the generated tokens; columns at and after
            ``lengths[b]`` are unused.
        lengths: ``[B]`` int64 number of used columns per row.
        rows: ``[B]`` int64 index of each row in the batch ``generate()`` was called with (rows
            leave the batch as they finish; per-row processor state is indexed by these).
    """

    token_ids: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedily, or by sampling with per-row Philox seeds.

    Attributes:
        greedy: Take argmaxes (``do_sample=False``).
        seeds: ``[B]`` int64 Philox seeds; a row's draws depend only on its seed and positions.
    """

    greedy: bool
    seeds: torch.Tensor


@dataclass(frozen=True)
class DraftContext:
    """Target features of the tokens committed since the last drafting round.

    Attributes:
        features: ``[B, C_new, m·H]`` tapped target hidden states.
        positions: ``[B, C_new]`` int64 their absolute positions, :data:`UNSEEN_POSITION` for
            padding and holes.
    """

    features: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class DraftBlock:
    """One drafted block per row.

    Attributes:
        token_ids: ``[B, S]`` int64 drafted target-vocabulary ids.
        probs: ``[B, S, V]`` float32 processed distributions the drafts were sampled from, or None
            for greedy drafts.
        confidence_logits: ``[B, S]`` float32 confidence-head logits, or None without that head.
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None
    confidence_logits: torch.Tensor | None


def rows_by_length(lengths: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Groups rows of equal length: ``[(length, row indices)]``, one group when all are equal."""
    values = lengths.tolist()
    if len(set(values)) == 1:
        return [(values[0], torch.arange(len(values), device=lengths.device))]
    return [(length, (lengths == length).nonzero()[:, 0]) for length in sorted(set(values))]


def apply_processors(
    logits_processor: LogitsProcessorList,
    prefixes: RowPrefixes,
    extra_token_ids: torch.Tensor,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Applies the logits processors to one position per row, with each row's exact prefix.

    Args:
        logits_processor: The processors ``generate()`` built (warpers included when sampling).
        prefixes: The committed tokens.
        extra_token_ids: ``[B, j]`` tokens after the committed ones (drafts so far; ``j`` may be 0).
        logits: ``[B, V]`` logits of the token after them.

    Returns:
        ``[B, V]`` processed logits.
    """
    if not logits_processor:
        return logits
    processed = torch.empty_like(logits)
    for length, rows in rows_by_length(prefixes.lengths):
        input_ids = torch.cat([prefixes.token_ids[rows, :length], extra_token_ids[rows]], dim=1)
        processed[rows] = _rows_view(logits_processor, prefixes.rows[rows])(input_ids, logits[rows])
    return processed


def _rows_view(logits_processor: LogitsProcessorList, rows: torch.Tensor) -> LogitsProcessorList:
    """The processors, with per-row state restricted to ``rows`` of the original batch."""
    view = LogitsProcessorList()
    for processor in logits_processor:
        per_row = getattr(processor, "prompt_ignore_length", None)  # a [B] tensor in recent releases only
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and torch.is_tensor(per_row):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = per_row.to(rows.device)[rows]
        view.append(processor)
    return view


def draft_block(
    head: DSparkHead,
    anchor_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    context: DraftContext,
    draft_cache: DraftKVCache,
    logits_processor: LogitsProcessorList,
    prefixes: RowPrefixes,
    sampling: Sampling,
) -> DraftBlock:
    """Drafts ``S = head.config.num_draft_tokens`` tokens after each row's anchor.

    Args:
        head: The draft head, attached to the target.
        anchor_ids: ``[B]`` the last committed token of each row (not yet seen by the target).
        anchor_positions: ``[B]`` int64 its absolute position.
        context: Target features of the tokens committed since the last round; appended to
            ``draft_cache``.
        draft_cache: The head's context cache.
        logits_processor: The target's processors, applied to every slot.
        prefixes: Committed tokens per row (ending with the anchor).
        sampling: Greedy or seeded sampling.

    Returns:
        The drafted tokens, their distributions and confidences.
    """
    backbone = head(
        head.block_input_ids(anchor_ids),
        anchor_positions[:, None],
        target_hidden_states=context.features,
        context_position_ids=context.positions,
        draft_cache=draft_cache,
    )
    draft_vocab_ids = head.draft_to_target_ids(torch.arange(head.config.draft_vocab_size, device=anchor_ids.device))
    batch_size, vocab_size = anchor_ids.shape[0], head.config.target_vocab_size
    prev_ids, markov_state = anchor_ids, None
    token_ids = anchor_ids.new_empty((batch_size, 0))
    probs, confidence_logits = [], []
    for slot in range(head.config.num_draft_tokens):
        step = head.draft_step(
            backbone.base_logits[:, 0, slot], backbone.draft_hidden[:, 0, slot], prev_ids, markov_state
        )
        draft_logits = step.draft_logits.float()
        if head.has_reduced_vocab:
            draft_logits = draft_logits.new_full((batch_size, vocab_size), float("-inf"))
            draft_logits[:, draft_vocab_ids] = step.draft_logits.float()
        draft_logits = apply_processors(logits_processor, prefixes, token_ids, draft_logits)
        if sampling.greedy:
            prev_ids = draft_logits.argmax(dim=-1)
        else:
            slot_probs = torch.softmax(draft_logits, dim=-1)
            positions = anchor_positions + 1 + slot
            prev_ids = sample(
                slot_probs, seed=sampling.seeds, positions=positions, stream=RandomStream.DRAFT, validate=False
            )
            probs.append(slot_probs)
        token_ids = torch.cat([token_ids, prev_ids[:, None]], dim=1)
        markov_state = step.markov_state
        if step.confidence_logits is not None:
            confidence_logits.append(step.confidence_logits)
    return DraftBlock(
        token_ids=token_ids,
        probs=torch.stack(probs, dim=1) if probs else None,
        confidence_logits=torch.stack(confidence_logits, dim=1) if confidence_logits else None,
    )
