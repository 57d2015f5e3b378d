"""Drafting one block: a parallel backbone pass, then the serial Markov head, slot by slot.

The loop talks to a :class:`Drafter`: given a :class:`DraftRequest` (each row's anchor, the target
features committed since the last round, the sampling mode) it returns a :class:`DraftBlock`, and
it drops finished rows from its own state with :meth:`Drafter.select_rows`. :class:`HeadDrafter`
drafts with a :class:`~spark_generate.heads.DSparkHead`; tests and other drafters plug in the same
way.

:class:`HeadDrafter` runs the head's backbone once over the block ``[anchor, MASK, ...]`` of every
row (feeding it the new target features), then walks the ``S`` draft slots left to right. Slot
``j`` gets its logits from :meth:`~spark_generate.heads.DSparkHead.draft_step` given the token
drafted at ``j - 1``, and stays in the head's **draft vocabulary**: only the target's warpers that
never read token ids (temperature, top-k, top-p, ...) are applied to it, then one softmax and one
inverse-CDF draw (:func:`~spark_generate.kernels.reference.inverse_cdf`, as
:func:`~spark_generate.sampling.inverse_cdf_sample` draws) from a uniform of the ``DRAFT`` stream
at the slot's absolute position, the uniforms of all ``S`` slots coming from one Philox call before
the walk (greedy decoding takes the argmax instead, and keeps no distribution: ``q`` is one-hot).
The distribution each draft was sampled from is kept, exactly, as what verification uses for
``q``; :meth:`DraftBlock.target_probs` lays it over the target vocabulary once per round.

The draft distribution may be any distribution: verification is lossless for every ``q`` as long
as it is the one the draft was sampled from. Processors that read token ids (repetition penalty,
``min_new_tokens``, no-repeat n-grams) are therefore applied on the target side only; a draft they
would forbid is simply rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList

from spark_generate.heads import DSparkHead
from spark_generate.kernels import RandomStream
from spark_generate.kernels.reference import inverse_cdf, philox_uniform64
from spark_generate.rows import RowPrefixes, Sampling

__all__ = ["NO_CONFIDENCE", "DraftBlock", "DraftContext", "DraftRequest", "Drafter", "HeadDrafter", "PendingContext"]

# The confidence logit of a slot no drafter filled (sigmoid ~1e-13): no schedule verifies it.
NO_CONFIDENCE = -30.0


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

    def select_rows(self, keep: torch.Tensor) -> DraftContext:
        """The context of the batch rows ``keep``."""
        return DraftContext(self.features[keep], self.positions[keep])


@dataclass(frozen=True)
class PendingContext:
    """The target features committed since the head last drafted, in the chunks the rounds appended.

    While the schedule steps aside every round appends a chunk, and joining them into one tensor
    each round would copy the whole pending context again (at batch 16, 32 rows of SmolLM2's 2,880
    features: 6 MB a round) for a head that may not draft for many rounds; they are joined once,
    when it drafts (:meth:`take`). The prompt's context alone is shown whole; once rounds have
    appended to it, only its last ``max_rows`` rows are (chunks wholly before them are dropped as
    they fall out).

    Attributes:
        chunks: Contexts ``[B, C_i, m·H]`` in the order they were committed.
        max_rows: The most rows shown to the head; None until a round appends.
    """

    chunks: tuple[DraftContext, ...] = ()
    max_rows: int | None = None

    def append(self, newer: DraftContext, max_rows: int) -> PendingContext:
        """This context followed by ``newer``, of which the head will see the last ``max_rows`` rows."""
        chunks = (*self.chunks, newer)
        while len(chunks) > 1 and sum(chunk.positions.shape[1] for chunk in chunks[1:]) >= max_rows:
            chunks = chunks[1:]
        return PendingContext(chunks, max_rows)

    def take(self) -> DraftContext:
        """The context to show the head, as one: ``[B, C, m·H]`` features and ``[B, C]`` positions."""
        features = torch.cat([chunk.features for chunk in self.chunks], dim=1)
        positions = torch.cat([chunk.positions for chunk in self.chunks], dim=1)
        if self.max_rows is not None:
            features, positions = features[:, -self.max_rows :], positions[:, -self.max_rows :]
        return DraftContext(features, positions)

    def select_rows(self, keep: torch.Tensor) -> PendingContext:
        """The context of the batch rows ``keep``."""
        return PendingContext(tuple(chunk.select_rows(keep) for chunk in self.chunks), self.max_rows)


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter needs to draft one block per running row.

    Attributes:
        anchor_ids: ``[B]`` the last committed token of each row (not yet seen by the target).
        anchor_positions: ``[B]`` int64 its absolute position.
        context: Target features of the tokens committed since the head last drafted; None for
            drafters that read none (the suffix drafter).
        prefixes: The committed tokens of each row (ending with the anchor).
        sampling: Greedy or seeded sampling.
        warpers: The target's warpers that read only the logits (see
            :func:`spark_generate.hf.vocabulary_free_processors`), empty for greedy decoding.
    """

    anchor_ids: torch.Tensor
    anchor_positions: torch.Tensor
    context: DraftContext | None
    prefixes: RowPrefixes
    sampling: Sampling
    warpers: LogitsProcessorList


@dataclass(frozen=True)
class DraftBlock:
    """One drafted block per row.

    Attributes:
        token_ids: ``[B, S]`` int64 drafted target-vocabulary ids.
        probs: ``[B, S, V_q]`` float32 distributions the drafts were sampled from, or None for
            greedy or deterministic drafts (one-hot: see :meth:`target_probs`).
        vocab_ids: ``[V_q]`` int64 target ids of the columns of ``probs``, or None when they are
            the whole target vocabulary in order.
        confidence_logits: ``[B, S]`` float32 confidence-head logits, or None without that head.
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None
    vocab_ids: torch.Tensor | None
    confidence_logits: torch.Tensor | None

    @classmethod
    def nothing(cls, anchor_ids: torch.Tensor) -> DraftBlock:
        """A block of no drafts for the ``[B]`` anchors: verifying it is a plain decoding step."""
        return cls(anchor_ids.new_empty((anchor_ids.shape[0], 0)), None, None, None)

    @classmethod
    def by_row(
        cls, blocks: dict[int, DraftBlock], sources: torch.Tensor, num_slots: int, vocab_size: int
    ) -> DraftBlock:
        """One block whose row ``r`` holds the drafts of ``blocks[sources[r]]``, over ``num_slots`` slots.

        Rows whose source has no block (plain steps) and slots past a block's own width get token 0,
        no distribution, and the confidence logit :data:`NO_CONFIDENCE`, so that no schedule verifies
        them; a confidence head missing from a block leaves NaN in its rows (the adaptive schedule
        plans those from past acceptance). When every drafting row shares one block as wide as
        ``num_slots``, that block is returned unchanged; otherwise sampled distributions are laid
        over the whole ``vocab_size``.

        Args:
            blocks: Blocks of all rows, keyed by :class:`~spark_generate.telemetry.DraftSource`.
            sources: ``[B]`` int64 each row's source.
            num_slots: ``S`` of the result.
            vocab_size: The target's vocabulary size ``V``.
        """
        used = [source for source in blocks if bool((sources == source).any())]
        if len(used) == 1 and blocks[used[0]].token_ids.shape[1] == num_slots:
            return blocks[used[0]]
        num_rows, device = len(sources), sources.device
        token_ids = torch.zeros(num_rows, num_slots, dtype=torch.int64, device=device)
        confidence_logits = torch.full((num_rows, num_slots), NO_CONFIDENCE, device=device)
        sampled = any(blocks[source].probs is not None for source in used)
        probs = torch.zeros(num_rows, num_slots, vocab_size, device=device) if sampled else None
        for source in used:
            block, rows = blocks[source], sources == source
            width = min(num_slots, block.token_ids.shape[1])
            token_ids[rows, :width] = block.token_ids[rows, :width]
            if block.confidence_logits is None:
                confidence_logits[rows, :width] = float("nan")
            else:
                confidence_logits[rows, :width] = block.confidence_logits[rows, :width].float()
            if probs is not None:
                probs[rows, :width] = block.target_probs(width, vocab_size)[rows]
        return cls(token_ids, probs, None, confidence_logits)

    def target_probs(self, num_drafts: int, vocab_size: int) -> torch.Tensor:
        """``[B, num_drafts, V]`` the draft distributions of the first slots over the target vocabulary.

        Without ``probs`` the drafts are deterministic (a function of the committed tokens, as a
        suffix draft is): each was drawn from the one-hot distribution at itself.
        """
        if self.probs is None:
            return F.one_hot(self.token_ids[:, :num_drafts], vocab_size).float()
        probs = self.probs[:, :num_drafts]
        if self.vocab_ids is None:
            return probs
        spread = probs.new_zeros((*probs.shape[:2], vocab_size))
        spread[..., self.vocab_ids] = probs
        return spread


class Drafter(Protocol):
    """Drafts blocks for the running rows of one generation, keeping whatever state it needs.

    The loop builds one per generation from the head (``HeadDrafter(head)`` by default; any
    ``Callable[[DSparkHead], Drafter]`` can be passed as ``dspark_drafter``).
    """

    def draft(self, request: DraftRequest) -> DraftBlock:
        """Drafts one block per row; consumes ``request.context``."""
        ...

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keeps only the rows ``keep`` (``[R']`` indices into the current rows) of its state."""
        ...


class HeadDrafter:
    """Drafts with a DSpark head and its context cache (one per generation).

    Args:
        head: The draft head, attached to the target.
    """

    def __init__(self, head: DSparkHead):
        self.head = head
        self.draft_cache = head.new_draft_cache()
        device = head.fc.weight.device
        draft_ids = torch.arange(head.config.draft_vocab_size, device=device)
        self.vocab_ids = head.draft_to_target_ids(draft_ids) if head.has_reduced_vocab else None

    def select_rows(self, keep: torch.Tensor) -> None:
        """Drops finished rows from the draft cache."""
        self.draft_cache.select_rows(keep)

    def draft(self, request: DraftRequest) -> DraftBlock:
        """Drafts ``S = head.config.num_draft_tokens`` tokens after each row's anchor."""
        head, anchor_ids = self.head, request.anchor_ids
        backbone = head(
            head.block_input_ids(anchor_ids),
            request.anchor_positions[:, None],
            target_hidden_states=request.context.features,
            context_position_ids=request.context.positions,
            draft_cache=self.draft_cache,
        )
        prev_ids, markov_state = anchor_ids, backbone.first_markov_state(0)
        token_ids, probs, confidence_logits = [], [], []
        num_slots = head.config.num_draft_tokens
        if not request.sampling.greedy:  # every slot's DRAFT-stream uniform, in one Philox call
            slot_positions = request.anchor_positions[:, None] + 1 + torch.arange(num_slots, device=anchor_ids.device)
            uniforms = philox_uniform64(request.sampling.seeds[:, None], slot_positions, RandomStream.DRAFT)
        for slot in range(num_slots):
            step = head.draft_step(
                backbone.base_logits[:, 0, slot], backbone.draft_hidden[:, 0, slot], prev_ids, markov_state
            )
            draft_logits = step.draft_logits.float()
            if request.sampling.greedy:
                draft_ids = draft_logits.argmax(dim=-1)
            else:
                if request.warpers:
                    draft_logits = request.warpers(anchor_ids[:, None], draft_logits)
                slot_probs = torch.softmax(draft_logits, dim=-1)
                draft_ids = inverse_cdf(slot_probs, uniforms[:, slot])
                probs.append(slot_probs)
            prev_ids = draft_ids if self.vocab_ids is None else self.vocab_ids[draft_ids]
            token_ids.append(prev_ids)
            markov_state = step.markov_state
            if step.confidence_logits is not None:
                confidence_logits.append(step.confidence_logits)
        return DraftBlock(
            token_ids=torch.stack(token_ids, dim=1),
            probs=torch.stack(probs, dim=1) if probs else None,
            vocab_ids=self.vocab_ids,
            confidence_logits=torch.stack(confidence_logits, dim=1).float() if confidence_logits else None,
        )
