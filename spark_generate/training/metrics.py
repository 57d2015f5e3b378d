"""Teacher-forced metrics of a head, accumulated over any number of batches.

All are computed from the same teacher-forced blocks as the loss:

* ``acceptance[k]``: mean analytic acceptance ``1 − TV_k`` of slot ``k`` over supervised slots;
* ``tau``: probabilistic accepted length ``1 + Σ_k Π_{i≤k} (1 − TV_i)`` per block (the product
  stops at the end of the block's contiguous mask), averaged over blocks with a supervised slot;
* ``greedy_accuracy[k]``: how often the draft's argmax equals the target's argmax at slot ``k``;
* ``confidence_error``: mean ``|σ(z_k) − (1 − TV_k)|`` over supervised slots.

:class:`TeacherForcedMetrics` holds sums and counts, so batches add up with ``+`` and the means are
exact over a whole evaluation set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TeacherForcedMetrics", "teacher_forced_metrics"]


@dataclass(frozen=True)
class TeacherForcedMetrics:
    """Sums and counts behind the teacher-forced metrics (all float64 on the CPU).

    Attributes:
        acceptance_sum: ``[S]`` sum of ``1 − TV_k`` over supervised slots.
        greedy_sum: ``[S]`` number of supervised slots whose argmaxes agree.
        slot_count: ``[S]`` number of supervised slots.
        tau_sum: Sum over blocks of the probabilistic accepted length.
        block_count: Blocks with at least one supervised slot.
        confidence_error_sum: Sum of ``|σ(z) − (1 − TV)|`` over supervised slots (0 without a head).
    """

    acceptance_sum: torch.Tensor
    greedy_sum: torch.Tensor
    slot_count: torch.Tensor
    tau_sum: float
    block_count: float
    confidence_error_sum: float

    def __add__(self, other: TeacherForcedMetrics) -> TeacherForcedMetrics:
        return TeacherForcedMetrics(
            self.acceptance_sum + other.acceptance_sum,
            self.greedy_sum + other.greedy_sum,
            self.slot_count + other.slot_count,
            self.tau_sum + other.tau_sum,
            self.block_count + other.block_count,
            self.confidence_error_sum + other.confidence_error_sum,
        )

    @property
    def acceptance(self) -> torch.Tensor:
        """``[S]`` mean analytic acceptance per slot."""
        return self.acceptance_sum / self.slot_count.clamp(min=1)

    @property
    def greedy_accuracy(self) -> torch.Tensor:
        """``[S]`` greedy agreement rate per slot."""
        return self.greedy_sum / self.slot_count.clamp(min=1)

    @property
    def tau(self) -> float:
        """Mean probabilistic accepted length, bonus token included."""
        return self.tau_sum / max(self.block_count, 1.0)

    @property
    def confidence_error(self) -> float:
        """Mean absolute error of the confidences against the analytic acceptance."""
        return self.confidence_error_sum / max(float(self.slot_count.sum()), 1.0)

    def as_dict(self) -> dict[str, float | list[float]]:
        """Plain numbers, for logs and JSON."""
        return {
            "tau": self.tau,
            "acceptance": self.acceptance.tolist(),
            "greedy_accuracy": self.greedy_accuracy.tolist(),
            "confidence_error": self.confidence_error,
        }


def teacher_forced_metrics(
    acceptance: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    slot_mask: torch.Tensor,
) -> TeacherForcedMetrics:
    """Metrics of one batch of teacher-forced blocks.

    Args:
        acceptance: ``[*, S]`` ``1 − TV_k`` (e.g. :attr:`LossTerms.acceptance`).
        draft_logits: ``[*, S, V_d]``.
        target_logits: ``[*, S, V_d]``.
        confidence_logits: ``[*, S]`` or None.
        slot_mask: ``[*, S]`` bool contiguous prefixes.
    """
    num_slots = acceptance.shape[-1]
    mask = slot_mask.reshape(-1, num_slots).double()
    accept = acceptance.detach().reshape(-1, num_slots).double() * mask
    agree = (draft_logits.detach().argmax(-1) == target_logits.detach().argmax(-1)).reshape(-1, num_slots) * mask
    tau = 1 + accept.cumprod(dim=-1).sum(-1)
    blocks = mask[:, 0]
    error = 0.0
    if confidence_logits is not None:
        confidence = torch.sigmoid(confidence_logits.detach().reshape(-1, num_slots).double())
        error = float(((confidence - acceptance.detach().reshape(-1, num_slots).double()).abs() * mask).sum())
    return TeacherForcedMetrics(
        accept.sum(0).cpu(),
        agree.sum(0).cpu(),
        mask.sum(0).cpu(),
        float((tau * blocks).sum()),
        float(blocks.sum()),
        error,
    )
