"""The DSpark loss and the teacher-forced metrics against values computed by hand on 2-token vocabularies.

Two slots, two tokens: slot 0 drafts ``q = (1/2, 1/2)`` against ``p = (3/4, 1/4)``, slot 1 drafts
``q = (3/4, 1/4)`` against ``p = (1/2, 1/2)``. Both have ``‖q − p‖₁ = 1/2``, so ``1 − TV = 3/4``.
"""

import math

import pytest
import torch

from spark_generate.training import LossWeights, dspark_loss, position_weights, teacher_forced_metrics

LN3 = math.log(3.0)
W1 = math.exp(-1 / 4)


def two_slot_block(confidence: float = 0.0):
    draft = torch.tensor([[[0.0, 0.0], [LN3, 0.0]]])  # [1, S=2, V=2]
    target = torch.tensor([[[LN3, 0.0], [0.0, 0.0]]])
    labels = torch.tensor([[0, 1]])
    confidence_logits = torch.full((1, 2), confidence)
    return draft, confidence_logits, target, labels


def test_position_weights_decay_by_a_quarter_per_slot():
    torch.testing.assert_close(position_weights(3, 4.0), torch.tensor([1.0, W1, math.exp(-0.5)]))


def test_loss_terms_match_hand_computation_with_both_slots_supervised():
    draft, confidence, target, labels = two_slot_block()
    terms = dspark_loss(draft, confidence, target, labels, torch.tensor([[True, True]]))
    ce = (math.log(2) + W1 * math.log(4)) / (1 + W1)
    assert terms.ce.item() == pytest.approx(ce, rel=1e-6)
    assert terms.l1.item() == pytest.approx(0.5, rel=1e-6)  # L1, not TV (= 0.25)
    assert terms.confidence.item() == pytest.approx(math.log(2), rel=1e-6)  # BCE(σ(0) = 1/2, ·) = ln 2
    assert terms.total.item() == pytest.approx(0.1 * ce + 0.9 * 0.5 + math.log(2), rel=1e-6)
    torch.testing.assert_close(terms.acceptance, torch.tensor([[0.75, 0.75]]))


def test_the_distillation_term_is_the_forward_kl_by_hand():
    draft, confidence, target, labels = two_slot_block()
    weights = LossWeights(ce=0.0, l1=0.0, confidence=0.0, kl=1.0)
    terms = dspark_loss(draft, confidence, target, labels, torch.tensor([[True, True]]), weights)
    # KL(p ‖ q): slot 0 p = (3/4, 1/4), q = (1/2, 1/2); slot 1 p = (1/2, 1/2), q = (3/4, 1/4).
    slot0 = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    slot1 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    kl = (slot0 + W1 * slot1) / (1 + W1)
    assert terms.kl.item() == pytest.approx(kl, rel=1e-6)
    assert terms.total.item() == pytest.approx(kl, rel=1e-6)
    assert dspark_loss(draft, confidence, target, labels, torch.tensor([[True, True]])).kl.item() == 0.0  # off


def test_masked_slots_leave_the_loss():
    draft, confidence, target, labels = two_slot_block()
    terms = dspark_loss(draft, confidence, target, labels, torch.tensor([[True, False]]))
    assert terms.ce.item() == pytest.approx(math.log(2), rel=1e-6)
    assert terms.total.item() == pytest.approx(0.1 * math.log(2) + 0.9 * 0.5 + math.log(2), rel=1e-6)


def test_confidence_target_is_the_detached_analytic_acceptance():
    draft, _, target, labels = two_slot_block()
    confidence = torch.full((1, 2), LN3, requires_grad=True)  # σ(ln 3) = 3/4 = 1 − TV: BCE = entropy
    terms = dspark_loss(draft, confidence, target, labels, torch.tensor([[True, True]]))
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert terms.confidence.item() == pytest.approx(entropy, rel=1e-6)
    assert not terms.acceptance.requires_grad
    terms.total.backward()
    torch.testing.assert_close(confidence.grad, torch.zeros(1, 2), atol=1e-7, rtol=0)  # at the optimum


def test_weights_scale_each_term():
    draft, confidence, target, labels = two_slot_block()
    weights = LossWeights(ce=1.0, l1=0.0, confidence=0.0)
    terms = dspark_loss(draft, confidence, target, labels, torch.tensor([[True, True]]), weights)
    assert terms.total.item() == pytest.approx(terms.ce.item(), rel=1e-6)


def test_labels_outside_a_reduced_vocabulary_leave_only_the_ce_term():
    draft, confidence, target, _ = two_slot_block()
    terms = dspark_loss(draft, confidence, target, torch.tensor([[0, -1]]), torch.tensor([[True, True]]))
    assert terms.ce.item() == pytest.approx(math.log(2), rel=1e-6)
    assert terms.l1.item() == pytest.approx(0.5, rel=1e-6)


def test_shape_mismatch_says_what_to_do():
    draft, confidence, target, labels = two_slot_block()
    with pytest.raises(ValueError, match="restrict the target logits"):
        dspark_loss(draft, confidence, target[..., :1], labels, torch.tensor([[True, True]]))


def test_teacher_forced_metrics_by_hand():
    draft, confidence, target, labels = two_slot_block(confidence=LN3)
    terms = dspark_loss(draft, confidence, target, labels, torch.tensor([[True, True]]))
    metrics = teacher_forced_metrics(terms.acceptance, draft, target, confidence, torch.tensor([[True, True]]))
    torch.testing.assert_close(metrics.acceptance, torch.tensor([0.75, 0.75], dtype=torch.float64))
    assert metrics.tau == pytest.approx(1 + 0.75 + 0.75**2)
    # Slot 0: draft argmax is a tie (index 0) and the target's is 0; slot 1: both 0.
    torch.testing.assert_close(metrics.greedy_accuracy, torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert metrics.confidence_error == pytest.approx(0.0, abs=1e-6)
    doubled = metrics + metrics
    assert doubled.tau == pytest.approx(metrics.tau)
    assert doubled.slot_count.tolist() == [2.0, 2.0]


def test_tau_stops_at_the_end_of_the_prefix_mask():
    acceptance = torch.tensor([[0.5, 0.5, 0.5]])
    logits = torch.zeros(1, 3, 2)
    metrics = teacher_forced_metrics(acceptance, logits, logits, None, torch.tensor([[True, False, False]]))
    assert metrics.tau == pytest.approx(1.5)
    assert metrics.confidence_error == 0.0
