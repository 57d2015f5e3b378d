"""DSparkHead: Markov formulas, serial == teacher-forced, the attention mask, the draft cache, slots.

Every model here is a tiny random Transformers model built from a config (hidden 64, 2-4 layers);
nothing touches the Hub.
"""

import pytest
import torch
import transformers
from conftest import tiny_head as shared_tiny_head
from conftest import tiny_target
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
)

from spark_generate.config import DSparkConfig, DSparkConfigError
from spark_generate.heads import DSparkHead, MarkovHead, block_attention_mask

VOCAB = 96
# float32 reorderings (SDPA with and without masked keys, batched vs per-block) differ by ~1e-6.
ATOL = 1e-5
ARCHITECTURES = ("llama", "qwen3", "mistral", "gemma3")


def tiny_head(target, seed: int = 1, **overrides) -> DSparkHead:
    """The shared tiny head with 2 draft layers."""
    return shared_tiny_head(target, seed, **{"num_draft_layers": 2, **overrides})


def target_features(head: DSparkHead, target, length: int, seed: int = 2) -> torch.Tensor:
    torch.manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, length))
    with torch.no_grad():
        return head.select_target_features(target(input_ids, output_hidden_states=True).hidden_states)


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


# ------------------------------------------------------------------------------------- Markov


def hand_markov(head_type, module, prev_ids, hidden):
    """The spec's formulas, one slot at a time, with weights sliced by hand."""
    w1, w2 = module.markov_w1.weight, module.markov_w2.weight
    r = w1.shape[1]
    state = torch.zeros(prev_ids.shape[0], r)
    biases = []
    for k in range(prev_ids.shape[1]):
        e = w1[prev_ids[:, k]]
        h = hidden[:, k]
        if head_type == "vanilla":
            bias = e @ w2.T
        elif head_type == "gated":
            w, b = module.gate_proj.weight, module.gate_proj.bias
            gate = torch.sigmoid(h @ w[:, : h.shape[1]].T + e @ w[:, h.shape[1] :].T + b)
            bias = (gate * e) @ w2.T
        else:
            w, b = module.joint_proj.weight, module.joint_proj.bias
            z = torch.cat([state, e, h], dim=1)
            a_g, a_c, a_o = (
                z @ w[:r].T + b[:r],
                z @ w[r : 2 * r].T + b[r : 2 * r],
                z @ w[2 * r :].T + b[2 * r :],
            )
            bias = torch.tanh(a_o) @ w2.T  # from s_{k-1}, before the update
            state = torch.sigmoid(a_g) * state + (1 - torch.sigmoid(a_g)) * torch.tanh(a_c)
        biases.append(bias)
    return torch.stack(biases, dim=1)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_markov_variants_match_the_formulas(head_type):
    torch.manual_seed(0)
    module = MarkovHead(target_vocab_size=11, draft_vocab_size=7, markov_rank=3, hidden_size=5, head_type=head_type)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter)
    prev_ids = torch.randint(0, 11, (2, 4))
    hidden = torch.randn(2, 4, 5)
    expected = hand_markov(head_type, module, prev_ids, hidden)
    torch.testing.assert_close(module.teacher_forced(prev_ids, hidden).bias, expected)
    assert module.teacher_forced(prev_ids, hidden).prev_embeddings.shape == (2, 4, 3)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("draft_vocab_size", [None, 40])
@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["anchor-first", "dflash-slots"])
def test_serial_steps_equal_teacher_forced_logits(llama, head_type, draft_vocab_size, sample_from_anchor):
    head = tiny_head(
        llama, markov_head_type=head_type, draft_vocab_size=draft_vocab_size, sample_from_anchor=sample_from_anchor
    )
    for parameter in head.markov_head.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    features = target_features(head, llama, 6)
    block_tokens = torch.randint(0, VOCAB, (2, 1, 4))
    num_draft = head.config.num_draft_tokens
    with torch.no_grad():
        out = head(block_tokens, torch.full((2, 1), 6), target_hidden_states=features)
        forced = head.teacher_forced(
            out.base_logits, out.draft_hidden, block_tokens[..., :num_draft], out.markov_state
        )
        state, serial_logits, serial_confidence = out.first_markov_state(0), [], []
        for j in range(num_draft):
            step = head.draft_step(out.base_logits[:, 0, j], out.draft_hidden[:, 0, j], block_tokens[:, 0, j], state)
            state = step.markov_state
            serial_logits.append(step.draft_logits)
            serial_confidence.append(step.confidence_logits)
    assert forced.draft_logits.shape == (2, 1, num_draft, draft_vocab_size or VOCAB)
    # The same ops on differently shaped tensors ([B, 1, S, ·] against [B, ·] per step): the matmul
    # kernels, and with several threads their split of the sums, differ, so only ATOL agreement holds.
    torch.testing.assert_close(forced.draft_logits[:, 0], torch.stack(serial_logits, 1), rtol=0, atol=ATOL)
    torch.testing.assert_close(forced.confidence_logits[:, 0], torch.stack(serial_confidence, 1), rtol=0, atol=ATOL)
    assert not torch.allclose(forced.draft_logits, out.base_logits), "the Markov bias must change the logits"


def test_rnn_recurrence_steps_over_the_anchor_slot_with_dflash_slots(llama):
    """As in speculators: predecessors ``[x_p, x_p, x_{p+1}, ...]`` over all K slots; slot 0 drafts nothing."""
    anchor_first = tiny_head(llama, markov_head_type="rnn")
    dflash_slots = tiny_head(llama, markov_head_type="rnn", sample_from_anchor=False)
    for parameter in anchor_first.markov_head.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    dflash_slots.load_state_dict(anchor_first.state_dict())
    features = target_features(anchor_first, llama, 6)
    block_tokens = torch.randint(0, VOCAB, (2, 1, 4))
    with torch.no_grad():
        all_slots = anchor_first(block_tokens, torch.full((2, 1), 6), target_hidden_states=features)
        out = dflash_slots(block_tokens, torch.full((2, 1), 6), target_hidden_states=features)
        forced = dflash_slots.teacher_forced(
            out.base_logits, out.draft_hidden, block_tokens[..., :3], out.markov_state
        )
    assert out.markov_state.shape == (2, 1, 8)
    predecessors = torch.cat([block_tokens[:, 0, :1], block_tokens[:, 0, :3]], dim=1)
    bias = hand_markov("rnn", dflash_slots.markov_head, predecessors, all_slots.draft_hidden[:, 0])
    torch.testing.assert_close(forced.draft_logits[:, 0] - out.base_logits[:, 0], bias[:, 1:], rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match=r"markov_state=None is invalid.*first_markov_state"):
        dflash_slots.draft_step(out.base_logits[:, 0, 0], out.draft_hidden[:, 0, 0], block_tokens[:, 0, 0])
    with pytest.raises(ValueError, match=r"markov_state=None is invalid.*out.markov_state to teacher_forced"):
        dflash_slots.teacher_forced(out.base_logits, out.draft_hidden, block_tokens[..., :3])
    with pytest.raises(ValueError, match="advance\\(\\) runs the rnn recurrence, but this Markov head is 'vanilla'"):
        tiny_head(llama).markov_head.advance(block_tokens[:, 0, 0], out.draft_hidden[:, 0, 0])


def test_markov_rank_zero_is_pure_dflash(llama):
    dspark = tiny_head(llama, markov_rank=8)
    dflash = tiny_head(llama, markov_rank=0, confidence_head_with_markov=False)
    assert dflash.markov_head is None
    assert not any(name.startswith("markov_head") for name in dflash.state_dict())
    backbone = {k: v for k, v in dspark.state_dict().items() if not k.startswith(("markov", "confidence"))}
    dflash.load_state_dict({**dflash.state_dict(), **backbone})
    features = target_features(dspark, llama, 5)
    block = dspark.block_input_ids(torch.tensor([4, 9]))
    with torch.no_grad():
        out = dflash(block, torch.full((2, 1), 5), target_hidden_states=features)
        dspark_out = dspark(block, torch.full((2, 1), 5), target_hidden_states=features)
        forced = dflash.teacher_forced(out.base_logits, out.draft_hidden, block[..., :4])
        step = dflash.draft_step(out.base_logits[:, 0, 1], out.draft_hidden[:, 0, 1], torch.tensor([3, 8]))
    torch.testing.assert_close(out.base_logits, dspark_out.base_logits, rtol=0, atol=0)
    assert torch.equal(forced.draft_logits, out.base_logits)
    assert torch.equal(step.draft_logits, out.base_logits[:, 0, 1])
    assert step.markov_state is None and forced.confidence_logits.shape == (2, 1, 4)


# --------------------------------------------------------------------------- attention mask


def test_block_attention_mask_matches_the_docstring_example():
    mask = block_attention_mask(torch.arange(4)[None], torch.tensor([[2, 4]]), block_size=2)
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 1, 1],
            [1, 1, 1, 1, 0, 0, 1, 1],
        ]
    ).bool()
    assert torch.equal(mask[0], expected)


def test_a_block_sees_only_context_before_its_anchor(llama):
    head = tiny_head(llama)
    features = target_features(head, llama, 10)
    block = head.block_input_ids(torch.tensor([4, 9]))
    anchor = torch.full((2, 1), 6)
    with torch.no_grad():
        reference = head(block, anchor, target_hidden_states=features).base_logits
        future = features.clone()
        future[:, 6:] = torch.randn_like(future[:, 6:])
        assert torch.equal(head(block, anchor, target_hidden_states=future).base_logits, reference)
        past = features.clone()
        past[:, 5] += 1.0
        assert not torch.allclose(head(block, anchor, target_hidden_states=past).base_logits, reference)


def test_blocks_never_see_each_other(llama):
    head = tiny_head(llama)
    features = target_features(head, llama, 10)
    torch.manual_seed(3)
    blocks = torch.randint(0, VOCAB, (2, 3, 4))
    anchors = torch.tensor([[2, 5, 8], [1, 4, 9]])
    with torch.no_grad():
        together = head(blocks, anchors, target_hidden_states=features)
        for n in range(3):
            alone = head(blocks[:, n : n + 1], anchors[:, n : n + 1], target_hidden_states=features)
            torch.testing.assert_close(together.base_logits[:, n], alone.base_logits[:, 0], rtol=0, atol=ATOL)
        changed = blocks.clone()
        changed[:, 1] = (changed[:, 1] + 1) % VOCAB
        other = head(changed, anchors, target_hidden_states=features)
    torch.testing.assert_close(other.base_logits[:, [0, 2]], together.base_logits[:, [0, 2]], rtol=0, atol=ATOL)
    assert not torch.allclose(other.base_logits[:, 1], together.base_logits[:, 1])


# ------------------------------------------------------------------------------ draft cache


def test_draft_cache_keeps_context_rows_across_rounds(llama):
    head = tiny_head(llama)
    features = target_features(head, llama, 9)
    cache = head.new_draft_cache()
    with torch.no_grad():
        head(
            head.block_input_ids(torch.tensor([4, 5])),
            torch.full((2, 1), 6),
            features[:, :6],
            draft_cache=cache,
        )
        assert cache.num_context_rows == 6, "block rows never enter the cache: it ends at the anchor"
        block = head.block_input_ids(torch.tensor([7, 8]))
        cached = head(block, torch.full((2, 1), 9), features[:, 6:9], draft_cache=cache)
        full = head(block, torch.full((2, 1), 9), target_hidden_states=features)
    assert cache.num_context_rows == 9
    assert torch.equal(cache.positions[0], torch.arange(9))
    torch.testing.assert_close(cached.base_logits, full.base_logits, rtol=0, atol=ATOL)
    cache.crop(4)
    assert cache.num_context_rows == 4 and cache.keys[0].shape[2] == 4 and cache.values[1].shape[2] == 4
    with pytest.raises(ValueError, match="cannot crop the draft cache to 5 rows: it holds 4"):
        cache.crop(5)


# ------------------------------------------------------------------------------------ slots


def test_slot_convention_both_ways(llama):
    anchor_first = tiny_head(llama, block_size=4, sample_from_anchor=True)
    dflash_slots = tiny_head(llama, block_size=4, sample_from_anchor=False)
    dflash_slots.load_state_dict(anchor_first.state_dict())
    assert (anchor_first.config.num_draft_tokens, dflash_slots.config.num_draft_tokens) == (4, 3)
    features = target_features(anchor_first, llama, 5)
    block = anchor_first.block_input_ids(torch.tensor([4, 9]))
    with torch.no_grad():
        all_slots = anchor_first(block, torch.full((2, 1), 5), target_hidden_states=features)
        skip_anchor = dflash_slots(block, torch.full((2, 1), 5), target_hidden_states=features)
    assert all_slots.base_logits.shape[2] == 4 and skip_anchor.base_logits.shape[2] == 3
    assert skip_anchor.markov_state is None, "only an rnn head carries a state over the anchor slot"
    # Draft token j comes from slot j (anchor-first) or slot j + 1 (DFlash); the anchor slot is unused.
    # The hidden states are one computation on identical tensors, sliced afterwards: bitwise equal.
    assert torch.equal(skip_anchor.draft_hidden, all_slots.draft_hidden[:, :, 1:])
    # The LM head then multiplies 3 slots against 4: with several threads the matmul splits its sums
    # differently for the two shapes, so the logits agree to float32 rounding only.
    torch.testing.assert_close(skip_anchor.base_logits, all_slots.base_logits[:, :, 1:], rtol=0, atol=ATOL)
    # Its predecessor is block token j either way: the anchor for the first draft token.
    step = dflash_slots.draft_step(skip_anchor.base_logits[:, 0, 0], skip_anchor.draft_hidden[:, 0, 0], block[:, 0, 0])
    forced = dflash_slots.teacher_forced(skip_anchor.base_logits, skip_anchor.draft_hidden, block[..., :3])
    torch.testing.assert_close(step.draft_logits, forced.draft_logits[:, 0, 0], rtol=0, atol=ATOL)


# ------------------------------------------------------------------------ target and vocab


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_heads_for_several_architectures_build_and_run(architecture):
    target = tiny_target(architecture)
    head = tiny_head(target)
    assert head.config.target_layer_ids == [0, 1, 2]
    assert head.config.verifier_architectures == [type(target).__name__]
    features = target_features(head, target, 6)
    with torch.no_grad():
        out = head(head.block_input_ids(torch.tensor([3, 7])), torch.full((2, 1), 6), target_hidden_states=features)
    assert out.base_logits.shape == (2, 1, 4, VOCAB) and torch.isfinite(out.base_logits).all()


def test_embedding_and_lm_head_are_referenced_not_copied(llama):
    head = tiny_head(llama)
    assert head._target.embed_tokens is llama.get_input_embeddings()
    assert head._target.lm_head is llama.get_output_embeddings()
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in head.state_dict())
    head_ids = {id(p) for p in head.parameters()}
    assert not head_ids & {id(p) for p in llama.parameters()}
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(head.base_logits(hidden), llama.lm_head(hidden))


def test_reduced_draft_vocabulary(llama):
    ids = torch.tensor([40, 2, 7, 90, 13])
    head = tiny_head(llama, draft_vocab_ids=ids)
    sorted_ids = ids.sort().values
    assert head.config.draft_vocab_size == 5 and head.has_reduced_vocab
    assert head.t2d.sum() == 5 and torch.equal(head.t2d.nonzero().squeeze(1), sorted_ids)
    assert torch.equal(head.draft_to_target_ids(torch.arange(5)), sorted_ids)
    assert torch.equal(head.target_to_draft_ids(torch.tensor([7, 8, 90])), torch.tensor([1, -1, 4]))
    assert not head.lm_head.weight.requires_grad
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(head.base_logits(hidden), llama.lm_head(hidden)[:, sorted_ids])
    with pytest.raises(ValueError, match="expected 5 distinct target ids"):
        head.set_draft_vocab(torch.tensor([1, 1, 2, 3, 4]))


def test_gradients_reach_the_trainable_parts_only(llama):
    head = tiny_head(llama, markov_head_type="gated").train()
    features = target_features(head, llama, 5)
    block = torch.randint(0, VOCAB, (2, 2, 4))
    out = head(block, torch.tensor([[2, 5], [3, 5]]), target_hidden_states=features)
    forced = head.teacher_forced(out.base_logits, out.draft_hidden, block)
    (forced.draft_logits.logsumexp(-1).sum() + forced.confidence_logits.sum()).backward()
    for name, parameter in head.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_head_for_another_target_is_refused(llama):
    head = tiny_head(llama)
    with pytest.raises(DSparkConfigError, match=r"num_hidden_layers=4.*num_hidden_layers=2"):
        head.attach(tiny_target("llama", num_layers=2))
    other_vocab = LlamaForCausalLM(
        LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    )
    with pytest.raises(DSparkConfigError, match=r"vocab_size=96.*vocab_size=100"):
        head.attach(other_vocab)


def test_unattached_head_and_final_layer_taps_are_refused(llama):
    head = DSparkHead(tiny_head(llama).config)
    with pytest.raises(RuntimeError, match=r"call head.attach\(target_model\)"):
        head(torch.zeros(1, 1, 4, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    hidden_states = tuple(torch.zeros(1, 2, 64) for _ in range(4))  # a 3-layer target
    with pytest.raises(DSparkConfigError, match="below layer 2"):
        head.select_target_features(hidden_states)
    with pytest.raises(ValueError, match="4 slots per block, expected 7"):
        DSparkHead.from_target(llama, num_draft_layers=1)(
            torch.zeros(1, 1, 4, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
        )


def test_gemma_blocks_use_raw_embedding_rows_and_uncapped_logits():
    """As speculators and vLLM: no sqrt(H) embedding scale and no final-logit soft-cap in the draft."""
    target = tiny_target("gemma3")
    target.config.final_logit_softcapping = 2.0
    head = tiny_head(target)
    hidden = torch.randn(3, 64) * 10
    assert torch.equal(head.base_logits(hidden), target.lm_head(hidden))
    features = target_features(head, target, 6)
    block = head.block_input_ids(torch.tensor([3, 7]))
    with torch.no_grad():
        scaled = head(block, torch.full((2, 1), 6), target_hidden_states=features)
        assert target.get_input_embeddings().embed_scale == 8.0, "Gemma scales its embeddings by sqrt(64)"
        target.model.embed_tokens = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight)
        raw = head.attach(target)(block, torch.full((2, 1), 6), target_hidden_states=features)
    assert torch.equal(scaled.base_logits, raw.base_logits)


def test_a_final_logit_softcapping_key_is_ignored_with_a_warning(llama):
    config = tiny_head(llama).config.to_dict()
    assert "final_logit_softcapping" not in config
    with pytest.warns(UserWarning, match="final_logit_softcapping=30.0.*the key is ignored"):
        reread = DSparkConfig(**{**config, "final_logit_softcapping": 30.0})
    assert reread.to_dict() == config


@pytest.mark.skipif(
    tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 23),
    reason="a list output_hidden_states keeps the embeddings slot from transformers 5.23",
)
def test_selective_hidden_state_capture_gives_the_same_features(llama):
    head = tiny_head(llama)
    input_ids = torch.randint(0, VOCAB, (1, 5))
    taps = [layer + 1 for layer in head.config.target_layer_ids]
    with torch.no_grad():
        selected = llama(input_ids, output_hidden_states=taps).hidden_states
        everything = llama(input_ids, output_hidden_states=True).hidden_states
    assert selected[0] is None, "untapped slots are None with selective capture"
    assert torch.equal(head.select_target_features(selected), head.select_target_features(everything))
    assert torch.equal(head.select_target_features(everything)[..., :64], everything[1])


def test_head_follows_a_bfloat16_target():
    target = tiny_target("qwen3").to(torch.bfloat16)
    head = tiny_head(target)
    assert head.fc.weight.dtype == torch.bfloat16
    features = target_features(head, target, 5)
    with torch.no_grad():
        out = head(head.block_input_ids(torch.tensor([3, 4])), torch.full((2, 1), 5), target_hidden_states=features)
        step = head.draft_step(out.base_logits[:, 0, 0], out.draft_hidden[:, 0, 0], torch.tensor([3, 4]))
    assert out.base_logits.dtype == torch.bfloat16 and torch.isfinite(out.base_logits).all()
    assert step.confidence_logits.dtype == torch.float32


def test_for_drafting_casts_a_copy_and_leaves_the_head_alone(llama):
    """A head drafts in the target's dtype through a copy; the user's head keeps its dtype, weights and RNG."""
    head = tiny_head(llama, enable_confidence_head=True)
    assert head.for_drafting(llama) is head  # already in the target's dtype
    head.to(torch.bfloat16).confidence_head.float()
    head.sts_temperatures = torch.tensor([1.0, 2.0, 3.0, 4.0])
    weights = {name: tensor.clone() for name, tensor in head.state_dict().items()}
    rng_state = torch.get_rng_state()
    drafting = head.for_drafting(llama)
    assert torch.equal(torch.get_rng_state(), rng_state)  # building the copy draws nothing from torch's generator
    assert drafting is not head and drafting.fc.weight.dtype == torch.float32
    assert drafting.confidence_head.proj.weight.dtype == torch.float32 and not drafting.training
    assert drafting.sts_temperatures.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert drafting._target.lm_head is llama.get_output_embeddings()
    assert head.fc.weight.dtype == torch.bfloat16
    assert all(torch.equal(tensor, weights[name]) for name, tensor in head.state_dict().items())
    for name, tensor in drafting.state_dict().items():
        assert torch.equal(tensor, weights[name].to(tensor.dtype)), name
    assert head.for_drafting(llama) is drafting  # kept while the head's weights stay the same
    head.sts_temperatures = None
    assert head.for_drafting(llama) is not drafting and head.for_drafting(llama).sts_temperatures is None


@pytest.mark.parametrize("write", ["data_add", "in_place", "replace", "buffer"])
def test_for_drafting_builds_a_new_copy_when_the_weights_changed_any_way(llama, write):
    head = tiny_head(llama).to(torch.bfloat16)
    drafting = head.for_drafting(llama)
    if write == "data_add":  # bumps neither the version nor the data pointer
        head.fc.weight.data[0, 0] += 1
    elif write == "in_place":
        with torch.no_grad():
            head.fc.weight.mul_(2)
    elif write == "replace":
        head.fc.weight = torch.nn.Parameter(head.fc.weight.detach().clone().flip(0))
    else:
        head.markov_head.markov_w1.weight.data[3] = 0.5
    fresh = head.for_drafting(llama)
    assert fresh is not drafting
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, head.state_dict()[name].to(tensor.dtype)), name


def test_for_drafting_folds_the_feature_scale_into_the_copy(llama):
    head = tiny_head(llama)
    head.scale_target_features(torch.linspace(0.5, 2.0, head.fc.in_features))
    features = target_features(head, llama, 5)
    expected = head.fuse_target_features(features)
    drafting = head.to(torch.float64).for_drafting(llama)
    assert drafting.target_feature_scale is None  # a plain head, as save_pretrained writes it
    torch.testing.assert_close(drafting.fuse_target_features(features), expected, atol=ATOL, rtol=0)
