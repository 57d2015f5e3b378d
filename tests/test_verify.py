"""The greedy verification shortcut equals the rejection sampler's greedy rule on one-hot targets."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from spark_generate.kernels import rejection_sample
from spark_generate.verify import _greedy_verdict


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
