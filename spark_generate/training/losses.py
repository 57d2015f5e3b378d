"""The DSpark training objective (the DSpark paper, arXiv 2607.05147, eqs. 9-12).

For draft token ``k`` (0-based) of every block, with Markov-corrected draft logits ``ℓ_k``,
target logits ``t_k``, confidence logit ``z_k`` and slot mask ``m_k``::

    w_k    = exp(-k / γ)                                     γ = 4
    L_ce   = Σ w_k m_k CE(ℓ_k, x*_k)                  / Σ w_k m_k
    L_l1   = Σ w_k m_k ‖softmax(ℓ_k) − softmax(t_k)‖₁ / Σ w_k m_k
    L_conf = Σ w_k m_k BCE(z_k, c*_k)                 / Σ w_k m_k,   c*_k = 1 − TV_k (detached)
    L      = 0.1 L_ce + 0.9 L_l1 + 1.0 L_conf

and, off by default, a distillation term ``L_kl = Σ w_k m_k KL(softmax(t_k) ‖ softmax(ℓ_k)) / Σ w_k m_k``
(the forward KL of EAGLE-style drafters) with weight ``α_kl``.

Divergences chosen (published implementations read each of them in two ways):

* distribution term: the full **L1** norm (``= 2·TV``), as DeepSpec and the paper, not
  speculators' ``tv`` (``= TV``, half the relative weight);
* CE label: the **data token** ``x*`` (the target's own regenerated response token on on-policy
  data), as DeepSpec, not the target's argmax;
* with a reduced draft vocabulary, the target distribution is the target's softmax renormalized
  over the draft vocabulary (speculators' choice; DeepSpec has no reduced vocabulary), and labels
  outside the draft vocabulary are left out of the CE term only.

Everything is computed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DIVERGENCE_CHOICES", "LossTerms", "LossWeights", "dspark_loss", "position_weights"]

DIVERGENCE_CHOICES = {
    "distribution_term": "l1 (= 2 * TV), as DeepSpec",
    "ce_label": "data token, as DeepSpec",
    "reduced_vocab_target": "target softmax renormalized over the draft vocabulary, as speculators",
}


@dataclass(frozen=True)
class LossWeights:
    """The coefficients of the objective; the defaults are the paper's.

    Attributes:
        ce: ``α_ce``.
        l1: ``α_l1``.
        confidence: ``α_conf``.
        decay: ``γ`` of the position weights ``exp(-k / γ)``.
        kl: ``α_kl``, the forward KL from the target's distribution (0: the paper's objective).
    """

    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0
    kl: float = 0.0


@dataclass(frozen=True)
class LossTerms:
    """The loss and its parts (the parts detached).

    Attributes:
        total: Scalar to backpropagate.
        ce: Weighted cross-entropy.
        l1: Weighted L1 distance between the draft and target distributions.
        confidence: Weighted BCE of the confidence logits (0 without a confidence head).
        acceptance: ``[*, S]`` detached ``1 − TV_k``, the analytic acceptance of every slot.
        kl: Weighted forward KL (0 when its weight is 0: then it is not computed).
    """

    total: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    confidence: torch.Tensor
    acceptance: torch.Tensor
    kl: torch.Tensor


def position_weights(num_draft_tokens: int, decay: float, device: torch.device | None = None) -> torch.Tensor:
    """``[S]`` float32 ``exp(-k / decay)`` for ``k = 0..S-1``."""
    return torch.exp(-torch.arange(num_draft_tokens, dtype=torch.float32, device=device) / decay)


def dspark_loss(
    draft_logits: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    target_logits: torch.Tensor,
    label_ids: torch.Tensor,
    slot_mask: torch.Tensor,
    weights: LossWeights = LossWeights(),
) -> LossTerms:
    """Computes the DSpark loss over teacher-forced blocks.

    Args:
        draft_logits: ``[*, S, V_d]`` Markov-corrected draft logits.
        confidence_logits: ``[*, S]`` or None without a confidence head.
        target_logits: ``[*, S, V_d]`` target logits at the supervising positions, restricted to
            the draft vocabulary.
        label_ids: ``[*, S]`` data tokens as *draft* ids, -1 where not in the draft vocabulary.
        slot_mask: ``[*, S]`` bool, contiguous prefixes.
        weights: The coefficients.

    Returns:
        The loss terms; with no supervised slot at all every term is 0 (and differentiable).
    """
    if draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft_logits {tuple(draft_logits.shape)} and target_logits {tuple(target_logits.shape)} "
            "must have the same shape: restrict the target logits to the draft vocabulary first."
        )
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    p = F.softmax(target_logits.float(), dim=-1)
    l1 = (log_q.exp() - p).abs().sum(-1)  # [*, S]
    acceptance = (1 - 0.5 * l1).detach().clamp(0, 1)
    slot_weights = position_weights(draft_logits.shape[-2], weights.decay, draft_logits.device) * slot_mask
    denominator = slot_weights.sum().clamp(min=1e-12)

    in_vocab = label_ids >= 0
    ce = -log_q.gather(-1, label_ids.clamp(min=0)[..., None]).squeeze(-1)
    ce_weights = slot_weights * in_vocab
    ce_term = (ce_weights * ce).sum() / ce_weights.sum().clamp(min=1e-12)
    l1_term = (slot_weights * l1).sum() / denominator
    total = weights.ce * ce_term + weights.l1 * l1_term
    kl_term = total.new_zeros(())
    if weights.kl:
        log_p = F.log_softmax(target_logits.float(), dim=-1)
        kl = (p * (log_p - log_q)).sum(-1)  # [*, S]
        kl_term = (slot_weights * kl).sum() / denominator
        total = total + weights.kl * kl_term
    confidence_term = total.new_zeros(())
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), acceptance, reduction="none")
        confidence_term = (slot_weights * bce).sum() / denominator
        total = total + weights.confidence * confidence_term
    return LossTerms(total, ce_term.detach(), l1_term.detach(), confidence_term.detach(), acceptance, kl_term.detach())
