"""The target-side adapter: cache keyword, rollback, and hidden-state capture by hooks."""

import pytest
import torch
from test_generation import prompts, tiny_target
from transformers import DynamicCache

from spark_generate.cache import FeatureTap, target_forward
from spark_generate.hf import cache_kwarg_name, crop_cache, take_cache


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


def test_cache_keyword_matches_the_installed_transformers(llama):
    name = cache_kwarg_name(llama)
    assert name in ("cache", "past_key_values")
    with pytest.raises(ValueError, match="neither"):
        cache_kwarg_name(torch.nn.Linear(2, 2))


def test_hooks_capture_the_raw_layer_outputs(llama):
    input_ids, attention_mask = prompts(2)
    with torch.no_grad(), FeatureTap(llama, [0, 2], torch.device("cpu")) as tap:
        hidden_states = llama(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        features = tap.take()
    torch.testing.assert_close(features, torch.cat([hidden_states[1], hidden_states[3]], dim=-1))
    with pytest.raises(RuntimeError, match="no target forward"):
        tap.take()
    with pytest.raises(ValueError, match="cannot tap layers"):
        FeatureTap(llama, [7], torch.device("cpu"))


def test_rollback_then_decode_equals_a_fresh_forward(llama):
    """Appending 3 tokens, cropping 2 of them, then feeding others gives the no-rollback logits."""
    input_ids, _ = prompts(1, length=6)
    cache, name = take_cache(llama, {}), cache_kwarg_name(llama)
    ones = torch.ones(1, 12, dtype=torch.long)

    def forward(token_ids, start):
        positions = torch.arange(start, start + token_ids.shape[1])[None]
        return target_forward(
            llama, token_ids, cache=cache, cache_kwarg=name, attention_mask=ones[:, : positions[0, -1] + 1],
            position_ids=positions, num_logits=token_ids.shape[1],
        )  # fmt: skip

    with torch.no_grad():
        forward(input_ids, 0)
        forward(torch.tensor([[5, 6, 7]]), 6)
        crop_cache(cache, 7)
        assert cache.get_seq_length() == 7
        logits = forward(torch.tensor([[9, 10]]), 7)
        fresh = llama(torch.cat([input_ids, torch.tensor([[5, 9, 10]])], dim=1)).logits[:, -2:]
    torch.testing.assert_close(logits, fresh)
    with pytest.raises(ValueError, match="shorter"):
        crop_cache(cache, 20)


def test_take_cache_refuses_a_filled_cache(llama):
    cache = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(torch.tensor([[3, 4]]), **{cache_kwarg_name(llama): cache})
    with pytest.raises(ValueError, match="already holds 2 tokens"):
        take_cache(llama, {"cache": cache})
