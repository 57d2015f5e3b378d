"""Verification's shortcuts: the greedy rule on argmaxes, and plain steps for sampled rows verifying nothing."""

import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import LogitsProcessorList

from spark_generate.drafting import DraftBlock
from spark_generate.kernels import rejection_sample
from spark_generate.rows import RowPrefixes, Sampling
from spark_generate.sampling import inverse_cdf_sample
from spark_generate.verify import _greedy_verdict, verify_block


@given(
    batch_size=st.integers(1, 5),
    width=st.integers(1, 6),
    vocab_size=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_greedy_shortcut_equals_rejection_sample_on_one_hot_targets(batch_size, width, vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    target_token_ids = torch.randint(vocab_size, (batch_size, width), generator=generator)
    draft_token_ids = torch.randint(vocab_size, (batch_size, width - 1), generator=generator)
    # Make long accepted runs likely: copy the target's argmax into most draft slots.
    copy = torch.rand(batch_size, width - 1, generator=generator) < 0.7
    draft_token_ids = torch.where(copy, target_token_ids[:, :-1], draft_token_ids)
    num_verified = torch.randint(width, (batch_size,), generator=generator)

    token_ids, num_emitted = _greedy_verdict(target_token_ids, draft_token_ids, num_verified)

    target_probs = torch.nn.functional.one_hot(target_token_ids, vocab_size).float()
    expected_ids, expected_emitted = rejection_sample(
        target_probs, None, draft_token_ids, num_verified, greedy=True,
        uniforms=torch.zeros(batch_size, width - 1), noise=torch.ones(batch_size, vocab_size), backend="torch",
    )  # fmt: skip
    assert torch.equal(token_ids, expected_ids)
    assert torch.equal(num_emitted, expected_emitted)


@given(
    batch_size=st.integers(1, 5),
    width=st.integers(1, 5),
    vocab_size=st.integers(2, 9),
    seed=st.integers(0, 2**16),
)
def test_sampled_rows_verifying_nothing_take_the_plain_step_whatever_the_width(batch_size, width, vocab_size, seed):
    """A row with no draft to verify draws exactly the plain step's token; the others are rejection-sampled alone.

    So a row's tokens do not depend on what the rest of the batch drafted (the width of the block).
    """
    generator = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(batch_size, width, vocab_size, generator=generator) * 2
    draft_probs = torch.randn(batch_size, width - 1, vocab_size, generator=generator).softmax(-1)
    draft_token_ids = torch.randint(vocab_size, (batch_size, width - 1), generator=generator)
    block = DraftBlock(draft_token_ids, draft_probs, None, None)
    num_verified = torch.randint(width, (batch_size,), generator=generator)
    seeds, anchor_positions = torch.arange(batch_size) * 11 + seed, torch.arange(batch_size) + 5
    rows = torch.arange(batch_size)
    prefixes = RowPrefixes(torch.zeros(batch_size, 1, dtype=torch.int64), torch.ones(batch_size), rows)

    verdict = verify_block(
        target_logits, block, num_verified, anchor_positions, LogitsProcessorList(), prefixes,
        Sampling(False, seeds),
    )  # fmt: skip

    target_probs = target_logits.softmax(-1)
    for row in range(batch_size):
        alone = slice(row, row + 1)
        if num_verified[row] == 0:
            positions = anchor_positions[alone] + 1
            expected = inverse_cdf_sample(target_probs[alone, 0], seed=seeds[alone], positions=positions)
            assert verdict.num_emitted[row] == 1 and verdict.token_ids[row, 0] == expected[0]
            assert (verdict.token_ids[row, 1:] == -1).all()
        else:
            expected_ids, expected_emitted = rejection_sample(
                target_probs[alone], draft_probs[alone], block.token_ids[alone], num_verified[alone],
                seed=seeds[alone], positions=anchor_positions[alone] + 1,
            )  # fmt: skip
            assert torch.equal(verdict.token_ids[alone], expected_ids)
            assert torch.equal(verdict.num_emitted[alone], expected_emitted)
