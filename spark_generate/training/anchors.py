"""Where training blocks start, what each slot must predict, and which slots count.

Training packs many blocks into one sequence: an *anchor* ``p`` is a position whose token is the
block's first input (the bonus token at inference); the block then drafts ``S`` tokens, and draft
token ``k`` (0-based, in either slot convention) must predict ``x_{p+k+1}``, is supervised by the
target's logits at position ``p + k`` and has the ground-truth predecessor ``x_{p+k}``::

    sequence   x_0 ... x_p  x_{p+1}  x_{p+2} ... x_{p+S}
    block            [x_p,  MASK,    MASK,  ...]          (K slots)
    labels                  x_{p+1}  x_{p+2} ... x_{p+S}  (S draft tokens)

Anchors are drawn uniformly, without replacement, among positions ``p`` with ``loss_mask[p]`` and
``loss_mask[p + 1]`` both set (the anchor and its first label lie in the answer); a batch holds no
more anchors per row than its richest row has candidates, and a row with fewer is padded with
masked dummy anchors at position 0. One row holds one
document (the data pipeline never packs documents), so a block can never cross a document; it can
not cross the end of the sequence either: a slot is supervised only while its label lies inside
the row's length and in the loss mask, and only as a *contiguous prefix* of the block (the mask is
a cumulative product along the slots), because a draft is only ever verified after all earlier
drafts were accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AnchorBatch", "BlockTargets", "block_targets", "sample_anchors"]


@dataclass(frozen=True)
class AnchorBatch:
    """Anchors of a batch, sorted by position within each row.

    Attributes:
        positions: ``[B, N]`` int64 anchor positions (0 for dummy anchors).
        valid: ``[B, N]`` bool, False for the dummy anchors that pad short rows.
    """

    positions: torch.Tensor
    valid: torch.Tensor


@dataclass(frozen=True)
class BlockTargets:
    """What the blocks of a batch take as input and must predict.

    Attributes:
        block_input_ids: ``[B, N, K]`` ``[x_p, MASK, ..., MASK]``.
        label_ids: ``[B, N, S]`` ``x_{p+k+1}`` (0 where out of range).
        prev_ids: ``[B, N, S]`` ground-truth Markov predecessors ``x_{p+k}``.
        logit_positions: ``[B, N, S]`` ``p + k``: where the target's logits supervise slot ``k``
            (clamped into the row for masked slots).
        slot_mask: ``[B, N, S]`` bool, a contiguous prefix along ``S`` for every block.
    """

    block_input_ids: torch.Tensor
    label_ids: torch.Tensor
    prev_ids: torch.Tensor
    logit_positions: torch.Tensor
    slot_mask: torch.Tensor


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool -> ``[B, T]`` bool: positions ``p`` with ``loss_mask[p]`` and ``loss_mask[p + 1]``."""
    loss_mask = loss_mask.bool()
    candidates = torch.zeros_like(loss_mask)
    candidates[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    return candidates


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> AnchorBatch:
    """Draws up to ``num_anchors`` distinct anchors per row, uniformly among the candidates.

    Args:
        loss_mask: ``[B, T]`` bool or 0/1, False on padding, prompts and anything not to learn.
        num_anchors: Anchors per row at most; the batch gets ``N = min(num_anchors, c)``, ``c`` the
            most candidates of any row, and rows with fewer than ``N`` get masked dummies.
        generator: A CPU generator; the draw depends only on its state and ``loss_mask``.

    Returns:
        The anchors, sorted by position in each row.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors}: expected at least 1 anchor per sequence.")
    candidates = anchor_candidates(loss_mask).cpu()
    # Random keys for candidates, +inf elsewhere: the N smallest keys are a uniform sample.
    keys = torch.rand(candidates.shape, generator=generator, dtype=torch.float64)
    keys = keys.masked_fill(~candidates, float("inf"))
    # No more anchors than the richest row can fill: blocks of dummies would only cost compute.
    width = max(1, min(num_anchors, int(candidates.sum(1).max())))
    chosen_keys, chosen = keys.topk(width, dim=1, largest=False)
    valid = chosen_keys.isfinite()
    positions = chosen.masked_fill(~valid, 0)
    # Sort valid anchors by position, dummies last.
    order = positions.masked_fill(~valid, candidates.shape[1]).argsort(dim=1, stable=True)
    device = loss_mask.device
    return AnchorBatch(positions.gather(1, order).to(device), valid.gather(1, order).to(device))


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: AnchorBatch,
    *,
    block_size: int,
    num_draft_tokens: int,
    mask_token_id: int,
) -> BlockTargets:
    """Builds block inputs, labels, predecessors and contiguous-prefix slot masks.

    Args:
        input_ids: ``[B, T]`` token ids.
        loss_mask: ``[B, T]``, False on padding (which marks the end of each row).
        anchors: From :func:`sample_anchors`.
        block_size: ``K``.
        num_draft_tokens: ``S`` (``K``, or ``K - 1`` in the DFlash slot convention).
        mask_token_id: The id filling slots ``1..K-1`` of every block.
    """
    length = input_ids.shape[1]
    offsets = torch.arange(num_draft_tokens, device=input_ids.device)
    label_positions = anchors.positions[..., None] + offsets + 1  # [B, N, S]
    inside = label_positions < length
    clamped = label_positions.clamp(max=length - 1)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None, None]
    supervised = inside & loss_mask.bool()[rows, clamped] & anchors.valid[..., None]
    slot_mask = supervised.long().cumprod(dim=-1).bool()
    label_ids = input_ids[rows, clamped].masked_fill(~inside, 0)
    prev_positions = label_positions - 1
    prev_ids = input_ids[rows, prev_positions.clamp(max=length - 1)]
    block_input_ids = torch.full(
        (*anchors.positions.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    block_input_ids[..., 0] = input_ids.gather(1, anchors.positions)
    return BlockTargets(block_input_ids, label_ids, prev_ids, prev_positions.clamp(max=length - 1), slot_mask)
