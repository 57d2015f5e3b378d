"""Sampled DSpark output has exactly the target's distribution: chi-square against enumeration.

A tiny target with a 6-token vocabulary (its LM head scaled up so that its distributions are far
from uniform) generates 4 tokens after a fixed prompt. The exact joint law of those 4 tokens
follows from the target by enumerating all 6^4 continuations, with the same logits processors
``generate()`` builds, applied with each prefix. Thousands of rows with distinct Philox seeds, in
one batch, are compared with it by a chi-square test, for each processor setting and each
scheduling mode. A deliberately broken variant, whose ``q`` is not the distribution the drafts
were sampled from, must fail the same test.
"""

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare
from test_generation import tiny_head, tiny_target
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from spark_generate import AdaptiveSchedule, ConfidenceThreshold, CostTable, FixedLength, GoodputSchedule, decode
from spark_generate.drafting import HeadDrafter

VOCAB = 6
NUM_NEW = 4
NUM_ROWS = 6000
PROMPT = torch.tensor([[2, 5, 3, 1, 4]])
SETTINGS = {
    "temperature": {"temperature": 0.7},
    "top-k": {"top_k": 3},
    "top-p": {"top_p": 0.8},
    "repetition": {"repetition_penalty": 1.6},
}
SCHEDULES = {
    "fixed": FixedLength(),
    "threshold": ConfidenceThreshold(0.5),
    "goodput": GoodputSchedule(CostTable(num_tokens=(1, 2, 3, 4), verify_seconds=(1.0, 1.2, 1.9, 2.0))),
    # One draft looks barely worth its cost before any evidence (1.5 tokens for 1.49 plain steps);
    # once the head's confidences are seen, the next turns are declined: plain steps.
    "adaptive": AdaptiveSchedule(
        CostTable(
            num_tokens=(NUM_ROWS, 2 * NUM_ROWS, 4 * NUM_ROWS), verify_seconds=(1.0, 1.0, 3.0), draft_seconds=0.49
        )
    ),
}


@pytest.fixture(scope="module")
def target():
    model = tiny_target("llama", num_layers=2, vocab_size=VOCAB, eos_token_id=None)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


def processors(setting: dict) -> LogitsProcessorList:
    """The processors ``generate()`` builds for ``setting``, in its order."""
    built = LogitsProcessorList()
    if "repetition_penalty" in setting:
        built.append(RepetitionPenaltyLogitsProcessor(setting["repetition_penalty"]))
    if "temperature" in setting:
        built.append(TemperatureLogitsWarper(setting["temperature"]))
    if "top_k" in setting:
        built.append(TopKLogitsWarper(setting["top_k"]))
    if "top_p" in setting:
        built.append(TopPLogitsWarper(setting["top_p"]))
    return built


@torch.no_grad()
def exact_joint(target, setting: dict) -> torch.Tensor:
    """``[V] * NUM_NEW`` probabilities of every continuation, by enumeration."""
    joint = torch.ones(1, dtype=torch.float64)
    continuations = PROMPT.clone()
    for _ in range(NUM_NEW):
        logits = target(continuations).logits[:, -1].float()
        probs = torch.softmax(processors(setting)(continuations, logits), dim=-1).double()
        joint = (joint[:, None] * probs).flatten()
        continuations = torch.cat(
            [continuations.repeat_interleave(VOCAB, dim=0), torch.arange(VOCAB).repeat(len(continuations))[:, None]],
            dim=1,
        )
    return joint


def chi_square_p_value(
    target, setting: dict, head, schedule, drafter=None, *, suffix: bool = False, stats: dict | None = None
) -> float:
    """Generates ``NUM_ROWS`` samples (checking that drafts were accepted) and tests them.

    ``suffix`` turns suffix drafting on (off by default here, so the head alone is tested);
    ``stats`` receives the generation's per-drafter counts.
    """
    input_ids = PROMPT.expand(NUM_ROWS, -1)
    out = target.generate(
        input_ids, do_sample=True, max_new_tokens=NUM_NEW, custom_generate=decode, dspark_head=head,
        dspark_seed=1234, dspark_schedule=schedule, dspark_drafter=drafter, dspark_suffix=suffix,
        return_dict_in_generate=True, **{"top_k": None, **setting},
    )  # fmt: skip
    assert out.dspark_stats.num_accepted.sum() > NUM_ROWS // 10, "the test must exercise accepted drafts"
    if isinstance(schedule, AdaptiveSchedule) and not suffix:
        assert out.dspark_stats.num_plain_steps.sum() > 0, "the test must exercise the plain-step fallback"
    if stats is not None:
        stats.update(
            rounds_by_source=out.dspark_stats.rounds_by_source, accepted_by_source=out.dspark_stats.accepted_by_source
        )
    new = out.sequences[:, PROMPT.shape[1] :]
    index = sum(new[:, i] * VOCAB ** (NUM_NEW - 1 - i) for i in range(NUM_NEW))
    observed = torch.bincount(index, minlength=VOCAB**NUM_NEW).double()
    expected = exact_joint(target, setting) * NUM_ROWS
    impossible = expected == 0
    if observed[impossible].sum() > 0:  # a continuation the target can never produce
        return 0.0
    rare = (expected < 5) & ~impossible  # pooled into one cell, as the chi-square approximation needs
    kept = ~rare & ~impossible
    observed = torch.cat([observed[kept], observed[rare].sum()[None]])
    expected = torch.cat([expected[kept], expected[rare].sum()[None]])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
@pytest.mark.parametrize("setting_name", list(SETTINGS))
def test_sampled_output_has_the_targets_distribution(target, setting_name, schedule_name):
    head = tiny_head(target, block_size=3, enable_confidence_head=True)
    p_value = chi_square_p_value(target, SETTINGS[setting_name], head, SCHEDULES[schedule_name])
    assert p_value > 1e-4


@pytest.mark.slow
def test_a_wrong_draft_distribution_is_caught(target):
    """Mutant: verify against q**0.3 (renormalised) instead of the q the drafts were drawn from."""

    class WrongQ(HeadDrafter):
        def draft(self, request):
            block = super().draft(request)
            flattened = block.probs**0.3
            return replace(block, probs=flattened / flattened.sum(-1, keepdim=True))

    head = tiny_head(target, block_size=3)
    assert chi_square_p_value(target, SETTINGS["temperature"], head, FixedLength(), drafter=WrongQ) < 1e-8
