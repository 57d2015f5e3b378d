"""`FeatureTap` taps what `target_layer_ids` name: -1 the embedding output, l >= 0 decoder layer l.

Bug fixed here: the tap indexed ``layers[i]`` with Python indexing, so a head whose
``target_layer_ids`` hold -1 (DeepSpec's id for the embedding output, accepted by ``DSparkConfig``)
silently tapped the *last* decoder layer, in generation and in training.

References come from ``output_hidden_states`` of real forwards of tiny random float64 targets:
``hidden_states[0]`` is the input of decoder layer 0 and ``hidden_states[l + 1]`` the output of
layer ``l`` (the last slot is final-normed). Where the tap and the reference come from the *same*
forward, the tensors are the very same computation, so they are compared exactly; generation and
training run their own forwards (explicit positions, cache, ``logits_to_keep``, the decoder alone),
so there the decoder-layer features are compared with float64 tolerances and only the embedding
slot, a plain lookup, exactly.
"""

import inspect

import pytest
import torch
from conftest import tiny_target as shared_tiny_target
from transformers import DynamicCache

from spark_generate import DSparkForCausalLM, FixedLength
from spark_generate.cache import FeatureTap
from spark_generate.heads import DSparkHead
from spark_generate.training import LossWeights, TokenBatch, sample_anchors, teacher_forced_step

VOCAB, HIDDEN, NUM_LAYERS, PAD = 64, 32, 3, 0
ARCHITECTURES = {"llama": {}, "qwen3": {"head_dim": 8}}  # name -> config fields
CPU = torch.device("cpu")


def tiny_target(architecture: str):
    """A random float64 three-layer model of the architecture (hidden 32)."""
    return shared_tiny_target(
        architecture, num_layers=NUM_LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
        eos_token_id=None, dtype=torch.float64, **ARCHITECTURES[architecture],
    )  # fmt: skip


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def target(request):
    return tiny_target(request.param)


def left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(input_ids)
    for row, num_pad in enumerate([0, 2, 4]):
        input_ids[row, :num_pad] = PAD
        attention_mask[row, :num_pad] = 0
    return input_ids, attention_mask


def split(features: torch.Tensor) -> list[torch.Tensor]:
    return list(features.split(HIDDEN, dim=-1))


@torch.no_grad()
def test_minus_one_taps_the_embedding_output_and_l_the_output_of_layer_l(target):
    input_ids, attention_mask = left_padded_prompts()
    with FeatureTap(target, [-1, 0, 1, NUM_LAYERS - 1], CPU) as tap:
        hidden_states = target(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        embedding, layer0, layer1, last = split(tap.take())
    assert torch.equal(embedding, hidden_states[0])
    assert torch.equal(embedding, target.get_input_embeddings()(input_ids))
    assert torch.equal(layer0, hidden_states[1])
    assert torch.equal(layer1, hidden_states[2])
    # The last slot of hidden_states is final-normed: the raw output of the last layer, normed, is it.
    assert torch.equal(target.get_decoder().norm(last), hidden_states[NUM_LAYERS])
    assert not torch.allclose(embedding, last), "-1 must not be the last decoder layer (Python indexing)"


@torch.no_grad()
def test_minus_one_alone_and_on_an_incremental_forward_with_a_cache(target):
    """A pre-hook reads layer 0's input however the layer is called (prefill, then one cached token)."""
    input_ids = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    cache_kwarg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    cache = {cache_kwarg: DynamicCache(config=target.config)}
    with FeatureTap(target, [-1], CPU) as tap:
        prefill = target(input_ids[:, :4], use_cache=True, output_hidden_states=True, **cache)
        assert torch.equal(tap.take(), prefill.hidden_states[0])
        step = target(input_ids[:, 4:], use_cache=True, output_hidden_states=True, **cache)
        assert torch.equal(tap.take(), step.hidden_states[0])
    # Hooks are gone after the block: a forward outside it captures nothing.
    target(input_ids)
    with pytest.raises(RuntimeError, match="no target forward"):
        tap.take()


@pytest.mark.parametrize("layer_ids", [[-2], [NUM_LAYERS], [-1, NUM_LAYERS + 3], [-5, 0], []])
def test_ids_outside_minus_one_to_num_layers_are_refused(target, layer_ids):
    with pytest.raises(ValueError, match=r"cannot tap layers .*\[-1, 3\).*-1 is the embedding output"):
        FeatureTap(target, layer_ids, CPU)


def test_a_model_without_decoder_layers_is_refused(target):
    class NoLayers(torch.nn.Module):
        def get_decoder(self):
            return torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"no nn\.ModuleList"):
        FeatureTap(NoLayers(), [0], CPU)


def head_with_embedding_tap(target) -> DSparkHead:
    torch.manual_seed(1)
    head = DSparkHead.from_target(target, target_layer_ids=[-1, 1], num_draft_layers=1, markov_rank=4, block_size=3)
    assert head.config.aux_hidden_state_layer_ids == [0, 2]
    return head.eval()


def bound_argument(module, name: str, args: tuple, kwargs: dict):
    """The value of argument ``name`` of ``module.forward`` in a call, positional or keyword."""
    return inspect.signature(module.forward).bind(*args, **kwargs).arguments[name]


@torch.no_grad()
def test_generation_feeds_the_head_the_embedding_output_for_id_minus_one(target):
    """The first drafting pass reads the prompt's tapped features: [hidden_states[0], hidden_states[2]]."""
    head = head_with_embedding_tap(target)
    seen = []
    handle = head.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(bound_argument(module, "target_hidden_states", args, kwargs)),
        with_kwargs=True,
    )
    input_ids, attention_mask = left_padded_prompts()
    try:
        out = DSparkForCausalLM(target).generate(
            input_ids,
            attention_mask=attention_mask,
            assistant=head,
            max_new_tokens=4,
            do_sample=False,
            schedule=FixedLength(),
        )
    finally:
        handle.remove()
    plain = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain)
    assert seen and seen[0].shape == (3, 6, 2 * HIDDEN), "the first drafting pass reads the prompts' features"
    positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
    reference = target(input_ids, attention_mask=attention_mask, position_ids=positions, output_hidden_states=True)
    embedding, layer1 = split(seen[0])
    real = attention_mask.bool()  # padded positions are hidden from the draft; compare the real tokens
    assert torch.equal(embedding[real], reference.hidden_states[0][real])
    torch.testing.assert_close(layer1[real], reference.hidden_states[2][real])
    # The bug fed the last layer's output instead: far from the embeddings.
    assert not torch.allclose(embedding[real], layer1[real])


@torch.no_grad()
def test_training_feeds_the_head_the_embedding_output_for_id_minus_one(target):
    head = head_with_embedding_tap(target)
    input_ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # right padding, as the data pipeline pads
    input_ids[1, 6:] = PAD
    batch = TokenBatch(input_ids, attention_mask, attention_mask.bool())
    anchors = sample_anchors(batch.loss_mask, 2, torch.Generator().manual_seed(0))
    seen = []

    def spy(block_input_ids, anchor_positions, features, prev_ids):
        seen.append(features)
        shape = (*block_input_ids.shape[:2], head.config.num_draft_tokens, head.config.draft_vocab_size)
        return torch.zeros(shape, dtype=torch.float64), None

    teacher_forced_step(spy, target, head, batch, anchors, LossWeights())
    reference = target(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    embedding, layer1 = split(seen[0])
    real = attention_mask.bool()
    assert torch.equal(embedding[real], reference[0][real])
    torch.testing.assert_close(layer1[real], reference[2][real])
