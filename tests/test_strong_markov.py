"""End-to-end tests with a *strong* Markov head, whose bias between draft slots really matters.

An untrained head's Markov bias is about 1e-3 logits, so a loop that ignores it (verifying against
the distribution *before* the bias, or conditioning every slot on the anchor) behaves like the
correct one, and every test built on untrained heads passes. Here ``markov_w1`` and ``markov_w2``
are re-drawn with standard deviation 1, which makes the bias several logits: the draft
distribution of a slot then depends strongly on the predecessor it was given.

Both tests go through the public generation path only (``target.generate(custom_generate=decode)``
and ``DSparkForCausalLM.generate``); what they need to see of the drafts they read with forward
hooks on the head (its backbone pass) and on the target (its verification forward).
"""

import pytest
import torch
from conftest import tiny_target as shared_tiny_target
from scipy.stats import chisquare
from transformers import LlamaForCausalLM

from spark_generate import DSparkForCausalLM, FixedLength, decode
from spark_generate.heads import DSparkHead

PAD = 0


def tiny_target(vocab_size: int, lm_head_scale: float, seed: int = 0) -> LlamaForCausalLM:
    """A random float64 two-layer Llama, its LM head scaled so its distributions are far from uniform."""
    return shared_tiny_target(
        num_layers=2, vocab_size=vocab_size, hidden_size=32, intermediate_size=48, eos_token_id=None, seed=seed,
        dtype=torch.float64, lm_head_scale=lm_head_scale,
    )  # fmt: skip


def strong_markov_head(target, seed: int = 1, **overrides) -> DSparkHead:
    """An untrained head whose Markov weights are re-drawn at std 1: a bias of several logits."""
    torch.manual_seed(seed)
    fields = {"num_draft_layers": 1, "markov_rank": 4, "block_size": 3, "target_layer_ids": [0], **overrides}
    head = DSparkHead.from_target(target, **fields).eval()
    with torch.no_grad():
        for parameter in head.markov_head.parameters():
            parameter.normal_(0.0, 1.0)
    return head


# ------------------------------------------------------------------ (a) q includes the Markov bias

VOCAB = 6
NUM_ROWS = 3000
NUM_NEW = 4  # generated; the joint law of the first JOINT of them is tested
JOINT = 3
PROMPT = torch.tensor([[2, 5, 3, 1, 4]])
TEMPERATURE = 1.3


@torch.no_grad()
def exact_joint(target) -> torch.Tensor:
    """``[V ** JOINT]`` probabilities of every continuation, from plain target forwards."""
    joint = torch.ones(1, dtype=torch.float64)
    continuations = PROMPT.clone()
    for _ in range(JOINT):
        logits = target(continuations).logits[:, -1].float() / TEMPERATURE
        joint = (joint[:, None] * torch.softmax(logits, dim=-1).double()).flatten()
        continuations = torch.cat(
            [continuations.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(continuations))[:, None]], 1
        )
    return joint


def chi_square(target, head) -> tuple[float, float, float]:
    """Chi-square statistic and p-value of ``NUM_ROWS`` sampled rows, and their acceptance rate."""
    out = target.generate(
        PROMPT.expand(NUM_ROWS, -1), do_sample=True, temperature=TEMPERATURE, top_k=None, top_p=None,
        max_new_tokens=NUM_NEW, custom_generate=decode, dspark_head=head, dspark_seed=torch.arange(NUM_ROWS),
        dspark_schedule=FixedLength(), return_dict_in_generate=True,
    )  # fmt: skip
    stats = out.dspark_stats
    acceptance = float(stats.num_accepted.sum() / stats.num_drafted.sum())
    new = out.sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + JOINT]
    cells = sum(new[:, i] * VOCAB ** (JOINT - 1 - i) for i in range(JOINT))
    observed = torch.bincount(cells, minlength=VOCAB**JOINT).double()
    expected = exact_joint(target) * NUM_ROWS
    rare = expected < 5  # pooled into one cell, as the chi-square approximation needs
    observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    result = chisquare(observed.numpy(), (expected * (NUM_ROWS / expected.sum())).numpy())  # float rounding
    return float(result.statistic), float(result.pvalue), acceptance


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_target(VOCAB, lm_head_scale=4.0)


def test_the_markov_bias_is_strong(sampling_target):
    """The premise of this file: the bias moves the draft distribution far (TV over 0.3 on average)."""
    head = strong_markov_head(sampling_target)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, head.config.transformer_layer_config.hidden_size, generator=generator).double()
    base = head.base_logits(hidden)
    biased = head.draft_step(base, hidden, torch.randint(0, VOCAB, (64,), generator=generator)).draft_logits
    tv = 0.5 * (base.softmax(-1) - biased.softmax(-1)).abs().sum(-1)
    assert tv.mean() > 0.3


def test_sampled_output_with_a_strong_markov_head_has_the_targets_joint(sampling_target):
    """The first 3 of 4 sampled tokens, over 3000 rows (per-row seeds 0..2999), against the exact joint.

    Mutant checked in spark_generate/drafting.py (``draft_block`` at commit 220c703, then
    ``HeadDrafter.draft`` at bdafe9a, same figures): the ``q`` kept for verification was the
    softmax of the *processed base logits* (before the Markov bias), while the token was still
    sampled from base + bias::

        probs.append(torch.softmax(<processors>(backbone.base_logits[:, 0, slot].float()), dim=-1))

    Correct code: chi2 = 238 on 209 degrees of freedom, p = 0.08 (acceptance 0.52; other seed
    offsets gave p = 0.81, 0.60, 0.66, 0.60, 0.46). Mutant: chi2 = 6297, p = 0 (taking ``q``
    from the raw base logits instead: chi2 = 6646). The test asks p > 1e-4, i.e. chi2 < 294, so
    the mutant fails by a factor of 21. The seeds are fixed: every figure is deterministic up to
    floating-point reduction order.
    """
    statistic, p_value, acceptance = chi_square(sampling_target, strong_markov_head(sampling_target))
    print(f"chi2={statistic:.1f}, p={p_value:.3g}, acceptance={acceptance:.2f}")
    assert acceptance > 0.2, "the test must exercise accepted drafts"
    assert p_value > 1e-4, f"chi2={statistic:.1f}"


# -------------------------------------------------------- (b) each slot follows the previous draft


def capture_first_block(target, head, input_ids, attention_mask, markov_head_type):
    """Greedy generation; returns the first backbone output and the first verification's input ids."""
    backbone, verified = [], []
    head_hook = head.register_forward_hook(lambda module, args, output: backbone.append(output))
    target_hook = target.register_forward_hook(
        lambda module, args, kwargs, output: verified.append(kwargs.get("input_ids", args[0] if args else None)),
        with_kwargs=True,
    )
    try:
        out = DSparkForCausalLM(target).generate(
            input_ids,
            attention_mask=attention_mask,
            assistant=head,
            do_sample=False,
            max_new_tokens=8,
            schedule=FixedLength(),
        )
    finally:
        head_hook.remove()
        target_hook.remove()
    plain = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8)
    assert torch.equal(out, plain), f"{markov_head_type}: DSpark greedy output differs from plain greedy"
    # Forward 0 is the prefill; forward 1 verifies [anchor, all S drafts] (the budget allows them all).
    return backbone[0], verified[1]


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated", "rnn"])
@torch.no_grad()
def test_greedy_drafts_follow_the_previous_draft_not_the_anchor(markov_head_type):
    """Each greedy draft is the argmax of the teacher-forced logits given the drafts before it.

    The oracle is the head's parallel ``teacher_forced`` path, fed ``[anchor, d_0, ..., d_{S-2}]``
    as predecessors: independent of the serial loop that drafted. A draft counts as the argmax
    when its logit is within 1e-9 of the maximum (float64; batched and sliced matmuls may round
    differently).

    Mutant checked in spark_generate/drafting.py (``draft_block`` at commit 220c703, then
    ``HeadDrafter.draft`` at bdafe9a, same figures): every slot's Markov step conditioned on the
    anchor, ``head.draft_step(..., anchor_ids, markov_state)`` instead of ``prev_ids``.
    Correct code: all 8 rows x 4 slots match, for every head type. Mutant: 22 (vanilla), 18
    (gated) and 8 (rnn) of the 32 drafts are not the oracle's argmax, all in slots 1-3 (slot 0's
    predecessor is the anchor either way).
    """
    target = tiny_target(64, lm_head_scale=1.0)
    head = strong_markov_head(target, markov_head_type=markov_head_type, block_size=4)
    num_drafts = head.config.num_draft_tokens
    input_ids = torch.randint(2, 64, (8, 5), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    input_ids[1::2, :2], attention_mask[1::2, :2] = PAD, 0  # left padding on odd rows
    backbone, verified = capture_first_block(target, head, input_ids, attention_mask, markov_head_type)
    assert verified.shape == (8, num_drafts + 1)
    anchor, drafts = verified[:, 0], verified[:, 1:]
    predecessors = torch.cat([anchor[:, None], drafts[:, :-1]], dim=1)
    oracle = head.teacher_forced(backbone.base_logits[:, 0], backbone.draft_hidden[:, 0], predecessors).draft_logits
    drafted_logit = oracle.gather(-1, head.target_to_draft_ids(drafts)[..., None])[..., 0]
    off = drafted_logit < oracle.max(dim=-1).values - 1e-9
    assert not off.any(), (
        f"{markov_head_type}: {int(off.sum())} of {off.numel()} drafts are not the oracle's argmax "
        f"(per slot: {off.sum(0).tolist()})"
    )
    # Without the bias, or with the anchor as every predecessor, the argmax chain would differ.
    anchored = head.teacher_forced(
        backbone.base_logits[:, 0], backbone.draft_hidden[:, 0], anchor[:, None].expand(-1, num_drafts)
    ).draft_logits
    assert (anchored.argmax(-1) != oracle.argmax(-1))[:, 1:].sum() >= 8, "the strong bias must change later slots"
