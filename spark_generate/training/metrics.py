"""Teacher-forced metrics of a head, accumulated over any number of batches.

All are computed from the same teacher-forced blocks as the loss:

* ``acceptance[k]``: mean analytic acceptance ``1 − TV_k`` of slot ``k`` over supervised slots;
* ``tau``: probabilistic accepted length ``1 + Σ_k Π_{i≤k} (1 − TV_i)`` per block (the product
  stops at the end of the block's contiguous mask), averaged over blocks with a supervised slot;
* ``greedy_accuracy[k]``: how often the draft's argmax equals the target's argmax at slot ``k``;
* ``greedy_tau``: greedy accepted length ``1 + Σ_k Π_{i≤k} [argmax q_i = argmax p_i]`` per block
  (same mask), averaged over the same blocks;
* ``confidence_error``: mean ``|σ(z_k) − (1 − TV_k)|`` over supervised slots.

**Two acceptance definitions, two taus.** ``1 − TV_k = Σ_v min(p_k(v), q_k(v))`` is the probability
that *sampling* accepts slot ``k`` (draft token drawn from ``q``, chain rejection sampling against
``p``), with ``p`` and ``q`` the raw softmaxes, i.e. sampling at temperature 1 with no top-k or
top-p: ``tau`` belongs with online tau measured that way (``spark-generate eval`` without
``--greedy``). Greedy verification accepts slot ``k`` only when the draft's argmax is the target's:
``greedy_tau`` belongs with greedy decoding (``eval --greedy``). The two can be far apart: on a
target whose next-token distributions are nearly flat (a randomly initialized model) any nearly flat
draft has ``TV ≈ 0`` and ``tau`` near its maximum ``S + 1``, while the argmaxes agree by chance only
(about ``1/V``) and ``greedy_tau ≈ 1`` (5.8 against 1.05 for an untrained 7-slot head on a 96-token
random target). With a reduced draft vocabulary the target logits given here are restricted to it
(the trainer's, renormalized as the loss wants them), so both overstate what decoding accepts when
the target puts mass outside the draft vocabulary.

**Per block is not per round.** Both taus are means over blocks at uniformly drawn anchors. Online
tau is tokens per target forward along the path decoding takes, which crosses an easy stretch (long
accepted blocks) in few rounds and a hard one in many: the per-block mean weights easy stretches
more than decoding does, and overestimates online tau as soon as acceptance varies along a document
(1.85 per block against 1.34 online for a small head on a tiny target). :func:`decoding_walk` turns
the per-anchor acceptances of *every* answer position into the rounds decoding would take, which is
what :func:`~spark_generate.training.evaluation.evaluate_teacher_forced_decoding` reports.

Both are measured along the documents' own tokens (the Markov head and the target read the data's
predecessors). Greedy acceptance is exactly what greedy decoding accepts at the same anchor when the
documents are the target's own greedy continuations (``spark-generate regenerate --greedy``): an
accepted draft then *is* the next data token, so decoding visits the documents' contexts. On other
documents (sampled answers, text the target did not write) both are estimates at contexts decoding
may never reach.

:class:`TeacherForcedMetrics` and :class:`DecodingWalk` hold sums and counts, so batches add up with
``+`` and the means are exact over a whole evaluation set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DecodingWalk", "TeacherForcedMetrics", "decoding_walk", "teacher_forced_metrics"]


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
        greedy_tau_sum: Sum over blocks of the greedy accepted length.
    """

    acceptance_sum: torch.Tensor
    greedy_sum: torch.Tensor
    slot_count: torch.Tensor
    tau_sum: float
    block_count: float
    confidence_error_sum: float
    greedy_tau_sum: float = 0.0

    def __add__(self, other: TeacherForcedMetrics) -> TeacherForcedMetrics:
        return TeacherForcedMetrics(
            self.acceptance_sum + other.acceptance_sum,
            self.greedy_sum + other.greedy_sum,
            self.slot_count + other.slot_count,
            self.tau_sum + other.tau_sum,
            self.block_count + other.block_count,
            self.confidence_error_sum + other.confidence_error_sum,
            self.greedy_tau_sum + other.greedy_tau_sum,
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
        """Mean probabilistic accepted length, bonus token included: sampling at temperature 1, no top-k/top-p."""
        return self.tau_sum / max(self.block_count, 1.0)

    @property
    def greedy_tau(self) -> float:
        """Mean greedy accepted length (leading slots whose argmaxes agree), bonus token included."""
        return self.greedy_tau_sum / max(self.block_count, 1.0)

    @property
    def confidence_error(self) -> float:
        """Mean absolute error of the confidences against the analytic acceptance."""
        return self.confidence_error_sum / max(float(self.slot_count.sum()), 1.0)

    def as_dict(self) -> dict[str, float | list[float]]:
        """Plain numbers, for logs and JSON."""
        return {
            "tau": self.tau,
            "greedy_tau": self.greedy_tau,
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
    greedy_tau = 1 + agree.double().cumprod(dim=-1).sum(-1)
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
        float((greedy_tau * blocks).sum()),
    )


@dataclass(frozen=True)
class DecodingWalk:
    """Expected counts of speculative decoding along answers, from per-anchor acceptances.

    Attributes:
        num_rounds: Expected target forwards (rounds), the first token (from the prefill) excluded.
        verified_by_position: ``[S]`` expected blocks that send draft slot ``k`` to the target.
        accepted_by_position: ``[S]`` expected blocks whose slot ``k`` is accepted (all earlier ones too).
        num_tokens: Tokens emitted by those rounds (every answer token but the first).
    """

    num_rounds: float
    verified_by_position: torch.Tensor
    accepted_by_position: torch.Tensor
    num_tokens: int

    def __add__(self, other: DecodingWalk) -> DecodingWalk:
        return DecodingWalk(
            self.num_rounds + other.num_rounds,
            self.verified_by_position + other.verified_by_position,
            self.accepted_by_position + other.accepted_by_position,
            self.num_tokens + other.num_tokens,
        )

    @property
    def tau(self) -> float:
        """Tokens per round, bonus token included: online tau's definition (accepted + rounds) / rounds."""
        return (float(self.accepted_by_position.sum()) + self.num_rounds) / max(self.num_rounds, 1e-12)

    @property
    def acceptance_by_position(self) -> list[float]:
        """Acceptance rate of each draft position among the blocks that verify it, as online statistics count it."""
        return (self.accepted_by_position / self.verified_by_position.clamp(min=1e-12)).tolist()


def decoding_walk(acceptance: torch.Tensor) -> DecodingWalk:
    """Expected rounds of speculative decoding (every draft verified) along one answer of ``n`` tokens.

    Decoding anchors its first block on answer token 0 (the prefill's token); a block anchored on
    token ``a`` accepts ``A`` drafts and emits ``A + 1`` tokens, so the next anchor is ``a + A + 1``.
    Near the end it verifies at most ``n - 2 - a`` drafts (as the generation loop does, so that the
    bonus token is the last one), and the walk ends on token ``n - 1``. The walk's law follows from
    ``P(A ≥ k) = Π_{i<k} acceptance[a, i]``; with 0/1 acceptances (greedy) it is the walk itself.

    Args:
        acceptance: ``[n - 1, S]`` acceptance of slot ``k`` of the block anchored on answer token
            ``a``, given that slots ``< k`` were accepted (0 or 1 for greedy verification, ``1 − TV``
            for sampling); entries past the end of the answer are not read.

    Returns:
        The expected rounds and per-position counts (float64 on the CPU).
    """
    num_anchors, num_slots = acceptance.shape
    rows = acceptance.detach().double().cpu().tolist()
    visits = [0.0] * (num_anchors + 1)
    visits[0] = 1.0 if num_anchors else 0.0
    verified, accepted = [0.0] * num_slots, [0.0] * num_slots
    for anchor, row in enumerate(rows):
        visit = visits[anchor]
        if visit == 0.0:
            continue
        width = min(num_slots, num_anchors - 1 - anchor)  # drafts this block may verify
        survive = 1.0  # P(A >= k)
        for k in range(width):
            verified[k] += visit
            survive, stop = survive * row[k], survive * (1.0 - row[k])  # P(A >= k + 1), P(A = k)
            visits[anchor + k + 1] += visit * stop
            accepted[k] += visit * survive
        visits[anchor + width + 1] += visit * survive
    return DecodingWalk(
        sum(visits[:num_anchors]),
        torch.tensor(verified, dtype=torch.float64),
        torch.tensor(accepted, dtype=torch.float64),
        num_anchors,
    )
