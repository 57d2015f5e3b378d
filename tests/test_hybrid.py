"""Hybrid rounds: per row and round, the head, the suffix index or a plain step, and the target's law either way.

The schedule chooses each row's drafter before anything of the round is drawn (the suffix draft is
a function of the committed tokens; the head's gain is the past's), so greedy output equals plain
``generate()`` token for token and sampled output has the target's exact law. Greedy is checked on
batches with left padding, stop tokens and rows leaving the batch, with the head, with the suffix
drafter alone (no head at all) and with both, asserting that each drafter really had drafts
accepted. Sampling is checked by the chi-square machinery of ``test_generation_sampling`` (the
exact joint law of 4 new tokens over a 6-token vocabulary, by enumeration) at T = 0.7 and 1 with
top-p, suffix-only and mixed; a suffix drafter that lies about its ``q`` must fail that test.
"""

from dataclasses import fields, replace

import pytest
import torch
from test_generation import PAD, prompts, tiny_head, tiny_target
from test_generation_sampling import NUM_ROWS, VOCAB, chi_square_p_value

import spark_generate.generation as generation
from spark_generate import AdaptiveSchedule, CostTable, DSparkForCausalLM, FixedLength, decode
from spark_generate.schedule import AdaptiveRun
from spark_generate.suffix import SuffixDrafter
from spark_generate.telemetry import DraftSource

HEAD, SUFFIX, PLAIN = int(DraftSource.HEAD), int(DraftSource.SUFFIX), int(DraftSource.PLAIN)
# A verification costs little more for a few tokens than for one, drafting a tenth of a forward.
FLAT_COSTS = CostTable(num_tokens=(1, 64, 1024), verify_seconds=(1.0, 1.05, 1.3), draft_seconds=0.1)


def repetitive_prompts(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts that repeat a phrase, so that the target's greedy output copies it."""
    input_ids, attention_mask = prompts(batch_size, length=24, seed=5)
    phrase = input_ids[:, -6:]
    input_ids[:, -18:] = phrase.repeat(1, 3)
    return input_ids, attention_mask


@pytest.fixture(scope="module")
def looping_target():
    """A target whose greedy continuations repeat themselves (a strong LM head makes short cycles)."""
    return tiny_target("llama", lm_head_scale=6.0)


def greedy(model, input_ids, attention_mask, **kwargs) -> torch.Tensor:
    return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40, **kwargs)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_with_the_suffix_drafter_alone_is_plain_generate(looping_target, batch_size):
    input_ids, attention_mask = repetitive_prompts(batch_size)
    plain = greedy(looping_target, input_ids, attention_mask)
    model = DSparkForCausalLM(looping_target)  # no head at all
    out = greedy(model, input_ids, attention_mask, return_dict_in_generate=True, schedule=AdaptiveSchedule(FLAT_COSTS))
    assert torch.equal(out.sequences, plain)
    stats = out.dspark_stats
    assert stats.accepted_by_source[SUFFIX] > 0 and stats.rounds_by_source[HEAD] == 0
    assert torch.equal(greedy(model, input_ids, attention_mask, suffix=False), plain)  # off: plain generate()


@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_hybrid_rounds_are_plain_generate(looping_target, batch_size):
    input_ids, attention_mask = repetitive_prompts(batch_size)
    input_ids[-1, -3:] = torch.tensor([7, 8, 9])  # one row copies less
    head = tiny_head(looping_target, block_size=4, enable_confidence_head=True)
    plain = greedy(looping_target, input_ids, attention_mask, eos_token_id=[1, 9], pad_token_id=PAD)
    for schedule in (AdaptiveSchedule(FLAT_COSTS), FixedLength()):
        out = greedy(
            looping_target, input_ids, attention_mask, eos_token_id=[1, 9], pad_token_id=PAD,
            custom_generate=decode, dspark_head=head, dspark_schedule=schedule, return_dict_in_generate=True,
        )  # fmt: skip
        assert torch.equal(out.sequences, plain), schedule
    assert out.dspark_stats.rounds_by_source[SUFFIX] == 0  # FixedLength drafts with the head where there is one
    adaptive = greedy(
        looping_target, input_ids, attention_mask, eos_token_id=[1, 9], pad_token_id=PAD, custom_generate=decode,
        dspark_head=head, dspark_schedule=AdaptiveSchedule(FLAT_COSTS), return_dict_in_generate=True,
    ).dspark_stats  # fmt: skip
    assert adaptive.accepted_by_source[SUFFIX] > 0 and adaptive.rounds_by_source[HEAD] > 0


def test_suffix_drafts_beyond_the_heads_block_where_a_match_is_long(looping_target):
    input_ids, attention_mask = repetitive_prompts(1)
    head = tiny_head(looping_target, block_size=2)
    out = greedy(
        DSparkForCausalLM(looping_target, head), input_ids, attention_mask, schedule=AdaptiveSchedule(FLAT_COSTS),
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, greedy(looping_target, input_ids, attention_mask))
    assert out.dspark_stats.verified_by_position[:, 2:].sum() > 0  # slots past the head's 2


@pytest.fixture(scope="module")
def sampling_target():
    model = tiny_target("llama", num_layers=2, vocab_size=VOCAB, eos_token_id=None)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


# Sampling settings of the exactness tests: each with the suffix drafter alone and beside the head.
SAMPLED = {"T=0.7": {"temperature": 0.7}, "T=1 top-p": {"temperature": 1.0, "top_p": 0.8}}
# Costs of the sampled tests: a forward over four times the rows costs a tenth more.
SAMPLED_COSTS = CostTable(num_tokens=(NUM_ROWS, 4 * NUM_ROWS), verify_seconds=(1.0, 1.1))


class AlternatingRun(AdaptiveRun):
    """The adaptive schedule with each row's drafter fixed in advance: head and suffix alternate by row and round.

    The choice reads neither draft, so every round mixes both drafters in one batch, losslessly.
    """

    round_index: int = 0

    def sources(self, suffix_confidence_logits, num_rows: int, head_slots: int, context_length: int = 0):
        self.round_index += 1
        parity = (torch.arange(num_rows) + self.round_index) % 2
        return torch.where(parity == 0, HEAD, SUFFIX)


class Alternating(AdaptiveSchedule):
    def start(self, cost_table, num_draft_tokens):
        run = super().start(cost_table, num_draft_tokens)
        return AlternatingRun(**{field.name: getattr(run, field.name) for field in fields(run)})


@pytest.mark.slow
@pytest.mark.parametrize("with_head", [False, True], ids=["suffix-only", "mixed"])
@pytest.mark.parametrize("setting_name", list(SAMPLED))
def test_sampled_hybrid_output_has_the_targets_distribution(sampling_target, setting_name, with_head):
    head = tiny_head(sampling_target, block_size=3, enable_confidence_head=True) if with_head else None
    schedule = Alternating(SAMPLED_COSTS) if with_head else AdaptiveSchedule(SAMPLED_COSTS)
    stats = {}
    p_value = chi_square_p_value(sampling_target, SAMPLED[setting_name], head, schedule, suffix=True, stats=stats)
    assert p_value > 1e-4
    assert stats["accepted_by_source"][SUFFIX] > NUM_ROWS // 10
    if with_head:
        assert stats["accepted_by_source"][HEAD] > NUM_ROWS // 10


@pytest.mark.slow
def test_a_suffix_drafter_that_misstates_its_q_is_caught(sampling_target, monkeypatch):
    """Mutant: the deterministic drafts claim a uniform ``q`` instead of the one-hot they were drawn from."""

    class UniformQ(SuffixDrafter):
        def draft(self, request):
            block = super().draft(request)
            uniform = torch.full((*block.token_ids.shape, VOCAB), 1.0 / VOCAB)
            return replace(block, probs=uniform, vocab_ids=None)

    monkeypatch.setattr(generation, "SuffixDrafter", UniformQ)
    schedule = AdaptiveSchedule(SAMPLED_COSTS)
    assert chi_square_p_value(sampling_target, SAMPLED["T=0.7"], None, schedule, suffix=True) < 1e-8
