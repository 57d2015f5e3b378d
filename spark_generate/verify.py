"""Verifying a drafted block against the target's logits, losslessly.

The target has run once over ``[anchor, d_1, ..., d_W-1]``; its logits at block position ``j``
give the distribution of the token after ``d_j``. :func:`verify_block` processes them position by
position with the growing prefix (committed tokens plus ``d_<=j``, the same prefixes the draft
side used), which is exact because position ``j`` only matters when every draft before it was
accepted. Then :func:`~spark_generate.kernels.rejection_sample` keeps an accepted prefix of the
drafts and adds one recovered or bonus token.

Logits are processed in float32, as plain ``generate()`` does. Greedy decoding accepts a draft
iff it equals the target's argmax and then emits the argmax: the rejection sampler's greedy rule,
computed from ``[B, W]`` argmaxes without materialising one-hot ``[B, W, V]`` distributions.
Sampling passes ``softmax(processed logits)`` and the draft
distributions recorded while drafting (laid over the target vocabulary), with Philox draws keyed
by each row's seed and the absolute position of the token. A block of width 1 (no drafts) is a
plain decoding step: its token is drawn from the target's distribution by
:func:`~spark_generate.sampling.inverse_cdf_sample` on the ``PLAIN`` stream (one uniform per row,
not a race weight per token: on a CPU the race alone cost 5-10% of a batch-16 step), and so is
the token of every row that verifies no draft in a wider block, whatever the other rows drafted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList

from spark_generate.drafting import DraftBlock
from spark_generate.kernels import rejection_sample
from spark_generate.rows import RowPrefixes, Sampling, apply_processors
from spark_generate.sampling import inverse_cdf_sample

__all__ = ["Verdict", "check_finite", "verify_block"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one block per row.

    Attributes:
        token_ids: ``[B, W]`` int64 accepted drafts, then the recovered or bonus token, then -1.
        num_emitted: ``[B]`` int64 tokens emitted (accepted + 1).
        target_scores: ``[B, W, V]`` processed target logits of every block position.
    """

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    target_scores: torch.Tensor

    @property
    def num_accepted(self) -> torch.Tensor:
        """``[B]`` accepted drafts."""
        return self.num_emitted - 1


def check_finite(target_logits: torch.Tensor) -> None:
    """Raises ``ValueError`` if the target's ``[B, ...]`` logits hold a NaN (a silent wrong answer otherwise)."""
    if torch.isnan(target_logits.amax()):  # max reductions propagate NaN; 15x cheaper than isnan().any()
        rows = torch.isnan(target_logits).flatten(1).any(1).nonzero()[:, 0].tolist()
        raise ValueError(
            f"the target produced NaN logits (rows {rows} of the batch); expected finite logits. "
            "Check the model's weights and dtype (float16 overflow is a common cause)."
        )


def _greedy_verdict(
    target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor, num_verified: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept drafts while they equal the target's argmax, then emit the argmax.

    This is :func:`~spark_generate.kernels.rejection_sample` with one-hot target distributions
    (``greedy=True``) without materialising them: the recovered token at the first mismatch and the
    bonus token after a fully accepted prefix are both the target's argmax at that position.

    Args:
        target_token_ids: ``[B, W]`` argmax of the processed target logits at each block position.
        draft_token_ids: ``[B, W - 1]`` drafts.
        num_verified: ``[B]`` drafts verified per row.

    Returns:
        ``[B, W]`` token ids (accepted drafts, the argmax, then -1) and ``[B]`` tokens emitted.
    """
    width = target_token_ids.shape[1]
    slots = torch.arange(width - 1, device=draft_token_ids.device)
    matches = (draft_token_ids == target_token_ids[:, :-1]) & (slots < num_verified[:, None])
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)
    positions = torch.arange(width, device=draft_token_ids.device)
    token_ids = torch.where(positions < num_accepted[:, None], F.pad(draft_token_ids, (0, 1)), -1)
    token_ids.scatter_(1, num_accepted[:, None], target_token_ids.gather(1, num_accepted[:, None]))
    return token_ids, num_accepted + 1


def _sampled_verdict(
    target_scores: torch.Tensor,
    block: DraftBlock,
    num_verified: torch.Tensor,
    anchor_positions: torch.Tensor,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling: rejection sampling where a row verifies drafts, a plain step where it verifies none.

    A row verifying no draft takes the plain step's draw (:func:`~spark_generate.sampling.inverse_cdf_sample`
    on the ``PLAIN`` stream) whatever the block's width, so its token does not depend on whether
    other rows of the batch drafted.

    Args:
        target_scores: ``[B, W, V]`` float32 processed target logits.
        block: The drafted block.
        num_verified: ``[B]`` int64 drafts verified per row.
        anchor_positions: ``[B]`` int64 absolute position of each anchor.
        seeds: ``[B]`` int64 Philox seeds.

    Returns:
        ``[B, W]`` token ids (accepted drafts, the recovered or bonus token, then -1) and ``[B]`` tokens emitted.
    """
    num_rows, width, vocab_size = target_scores.shape
    device = target_scores.device
    token_ids = torch.full((num_rows, width), -1, dtype=torch.int64, device=device)
    num_emitted = torch.ones(num_rows, dtype=torch.int64, device=device)
    num_verified = num_verified.to(device)
    plain = num_verified == 0
    if bool(plain.any()):
        token_ids[plain, 0] = inverse_cdf_sample(
            torch.softmax(target_scores[plain, 0], dim=-1), seed=seeds[plain], positions=anchor_positions[plain] + 1,
            validate=False,
        )  # fmt: skip
    drafted = ~plain
    if bool(drafted.any()):
        target_probs = torch.softmax(target_scores[drafted], dim=-1)
        draft_probs = block.target_probs(width - 1, vocab_size)[drafted]
        token_ids[drafted], num_emitted[drafted] = rejection_sample(
            target_probs, draft_probs, block.token_ids[drafted, : width - 1], num_verified[drafted],
            seed=seeds[drafted], positions=anchor_positions[drafted] + 1, validate=False,
        )  # fmt: skip
    return token_ids, num_emitted


def verify_block(
    target_logits: torch.Tensor,
    block: DraftBlock,
    num_verified: torch.Tensor,
    anchor_positions: torch.Tensor,
    logits_processor: LogitsProcessorList,
    prefixes: RowPrefixes,
    sampling: Sampling,
) -> Verdict:
    """Accepts a prefix of each row's drafts and emits one more token, with the target's law.

    Args:
        target_logits: ``[B, W, V]`` raw target logits over ``[anchor, drafts[:, :W-1]]``.
        block: The drafted block (``S >= W - 1`` slots).
        num_verified: ``[B]`` int64 drafts verified per row (``<= W - 1``), from the schedule.
        anchor_positions: ``[B]`` int64 absolute position of each anchor.
        logits_processor: The target's processors.
        prefixes: Committed tokens per row (ending with the anchor).
        sampling: Greedy or seeded sampling.

    Returns:
        The emitted tokens per row.

    Raises:
        ValueError: The target produced NaN logits.
    """
    check_finite(target_logits)
    width = target_logits.shape[1]
    draft_token_ids = block.token_ids[:, : width - 1]
    target_scores = target_logits.float()
    if logits_processor:
        target_scores = torch.stack(
            [
                apply_processors(logits_processor, prefixes, draft_token_ids[:, :position], target_scores[:, position])
                for position in range(width)
            ],
            dim=1,
        )
    if sampling.greedy and width == 1:  # a plain step: the argmax
        token_ids = target_scores[:, 0].argmax(dim=-1, keepdim=True)
        num_emitted = torch.ones_like(token_ids[:, 0])
    elif sampling.greedy:
        token_ids, num_emitted = _greedy_verdict(target_scores.argmax(dim=-1), draft_token_ids, num_verified)
    else:
        token_ids, num_emitted = _sampled_verdict(target_scores, block, num_verified, anchor_positions, sampling.seeds)
    return Verdict(token_ids, num_emitted, target_scores)
