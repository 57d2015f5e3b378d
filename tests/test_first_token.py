"""The first sampled token is a Philox draw keyed by the row's seed and its absolute position.

The documented contract of sampled decoding ("randomness is counter-based Philox keyed by a
per-row seed and the absolute position of each token") covers the token chosen from the prefill's
logits too: with ``max_new_tokens=1`` every row's token must be exactly
``spark_generate.inverse_cdf_sample(softmax(processed logits), seed=row_seed, positions=real_length)``
(the loop's plain-step draw, on the ``PLAIN`` stream), where
``real_length`` is the number of real (unpadded) prompt tokens of the row, i.e. the absolute
position of the new token. Drawing it at another position keeps its distribution but breaks the
contract (and reproducibility across paddings), so only this exact check catches it.

The reference logits come from a plain forward of the target with the positions ``generate()``
gives left-padded rows, processed with the warpers ``generate()`` builds for these settings.
"""

import torch
from conftest import tiny_target as shared_tiny_target
from transformers import LlamaForCausalLM, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from spark_generate import DSparkForCausalLM, FixedLength, inverse_cdf_sample
from spark_generate.heads import DSparkHead

VOCAB, PAD, NUM_ROWS, WIDTH = 64, 0, 48, 9
TEMPERATURE, TOP_K = 1.5, 40


def tiny_target() -> LlamaForCausalLM:
    """A random float64 two-layer Llama whose LM head is scaled by 4 (distributions far from uniform)."""
    return shared_tiny_target(
        num_layers=2, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, eos_token_id=None,
        dtype=torch.float64, lm_head_scale=4.0,
    )  # fmt: skip


def left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """``NUM_ROWS`` prompts of ``WIDTH`` columns; row ``b`` has ``b % 7`` padding tokens."""
    input_ids = torch.randint(2, VOCAB, (NUM_ROWS, WIDTH), generator=torch.Generator().manual_seed(11))
    attention_mask = torch.ones_like(input_ids)
    for row in range(NUM_ROWS):
        input_ids[row, : row % 7] = PAD
        attention_mask[row, : row % 7] = 0
    return input_ids, attention_mask


@torch.no_grad()
def test_the_first_token_is_the_seeded_draw_at_the_rows_absolute_position():
    """Every row's token is ``inverse_cdf_sample(softmax(processed), seed=row_seed, positions=real_length)``.

    Mutant checked (spark_generate/generation.py, ``commit_first_token``, at commits 220c703 and
    bdafe9a, same figures, when the first token was a race draw): the first token drawn without its
    position (position 0). Correct code: all 48 rows equal the reference draw. Mutant: 46 of 48
    rows differ. Drawing at the padded width (9) instead of the real length would change
    all 41 padded rows (checked below, as the premise).
    """
    target = tiny_target()
    torch.manual_seed(1)
    head = DSparkHead.from_target(target, num_draft_layers=1, markov_rank=4, block_size=3).eval()
    input_ids, attention_mask = left_padded_prompts()
    seeds = torch.arange(NUM_ROWS)
    out = DSparkForCausalLM(target).generate(
        input_ids, attention_mask=attention_mask, assistant=head, do_sample=True, temperature=TEMPERATURE,
        top_k=TOP_K, top_p=None, max_new_tokens=1, seed=seeds, schedule=FixedLength(), return_dict_in_generate=True,
        output_scores=True,
    )  # fmt: skip
    first = out.sequences[:, WIDTH]

    real_lengths = attention_mask.sum(dim=1)
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = target(input_ids, attention_mask=attention_mask, position_ids=positions).logits[:, -1].float()
    warpers = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    processed = warpers(input_ids, logits)
    torch.testing.assert_close(out.scores[0], processed)  # the same processed logits, independently computed
    probs = torch.softmax(processed, dim=-1)
    expected = inverse_cdf_sample(probs, seed=seeds, positions=real_lengths)

    mismatched = (first != expected).nonzero()[:, 0].tolist()
    assert not mismatched, f"{len(mismatched)} of {NUM_ROWS} rows differ from the draw at their position: {mismatched}"
    # The premise: the position matters, and the real length is not the padded width.
    padded = real_lengths < WIDTH
    at_width = inverse_cdf_sample(probs, seed=seeds, positions=WIDTH)
    assert (at_width != expected)[padded].sum() >= padded.sum() // 2
    assert (inverse_cdf_sample(probs, seed=seeds, positions=0) != expected).sum() >= NUM_ROWS // 2
