"""Anchors, block targets and many blocks per sequence, on random masks and a tiny random target.

Properties (Hypothesis): anchors are distinct candidates (``loss_mask[p]`` and ``loss_mask[p+1]``),
sorted, never past the end of a row; supervised slots form a contiguous prefix of each block and
only cover loss-masked tokens inside the row. The packed forward (many anchors in one pass,
through the head's block attention mask) equals one forward per anchor.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from spark_generate.heads import DSparkHead
from spark_generate.training import AnchorBatch, block_targets, sample_anchors
from spark_generate.training.anchors import anchor_candidates

MASK_ID = 3


@st.composite
def loss_masks(draw):
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(2, 24))
    rows = []
    for _ in range(batch):
        size = draw(st.integers(2, length))
        row = draw(st.lists(st.booleans(), min_size=size, max_size=size)) + [False] * (length - size)
        rows.append(row)
    return torch.tensor(rows)


@given(loss_mask=loss_masks(), num_anchors=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_anchors_are_distinct_sorted_candidates(loss_mask, num_anchors, seed):
    anchors = sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(seed))
    most = int(anchor_candidates(loss_mask).sum(1).max())
    assert anchors.positions.shape == (loss_mask.shape[0], max(1, min(num_anchors, most)))  # no block of dummies
    for row in range(loss_mask.shape[0]):
        chosen = anchors.positions[row][anchors.valid[row]].tolist()
        candidates = [p for p in range(loss_mask.shape[1] - 1) if loss_mask[row, p] and loss_mask[row, p + 1]]
        assert chosen == sorted(set(chosen))
        assert set(chosen) <= set(candidates)
        assert len(chosen) == min(num_anchors, len(candidates))
        assert not anchors.valid[row][len(chosen) :].any()  # dummies come last


def test_anchor_draw_is_a_function_of_the_generator_seed():
    loss_mask = torch.ones(2, 40, dtype=torch.bool)
    first = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(7))
    second = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(7))
    assert torch.equal(first.positions, second.positions)


@given(loss_mask=loss_masks(), block_size=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_slot_masks_are_contiguous_prefixes_inside_the_document(loss_mask, block_size, seed):
    input_ids = torch.arange(loss_mask.numel()).view(loss_mask.shape) + 10
    anchors = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(seed))
    blocks = block_targets(
        input_ids, loss_mask, anchors, block_size=block_size, num_draft_tokens=block_size, mask_token_id=MASK_ID
    )
    mask = blocks.slot_mask.long()
    assert torch.equal(mask, mask.cumprod(-1))  # contiguous prefix
    for row, block in zip(*torch.nonzero(torch.ones_like(anchors.valid), as_tuple=True), strict=True):
        p = int(anchors.positions[row, block])
        assert blocks.block_input_ids[row, block].tolist() == [int(input_ids[row, p])] + [MASK_ID] * (block_size - 1)
        for k in range(block_size):
            if blocks.slot_mask[row, block, k]:
                assert anchors.valid[row, block]
                assert p + k + 1 < loss_mask.shape[1] and loss_mask[row, p + k + 1]  # inside, loss-masked
                assert blocks.label_ids[row, block, k] == input_ids[row, p + k + 1]
                assert blocks.prev_ids[row, block, k] == input_ids[row, p + k]
                assert blocks.logit_positions[row, block, k] == p + k
        if anchors.valid[row, block]:
            assert blocks.slot_mask[row, block, 0]  # loss_mask[p + 1] holds for every anchor


def test_many_blocks_in_one_pass_equal_one_pass_per_block():
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval().double()
    torch.manual_seed(1)
    head = DSparkHead.from_target(target, num_draft_layers=2, markov_rank=4, block_size=3).eval()
    features = torch.randn(1, 12, head.fc.in_features, dtype=torch.float64)
    anchors = AnchorBatch(torch.tensor([[0, 4, 5, 9]]), torch.ones(1, 4, dtype=torch.bool))
    input_ids = torch.randint(2, 64, (1, 12))
    blocks = block_targets(
        input_ids,
        torch.ones(1, 12),
        anchors,
        block_size=3,
        num_draft_tokens=3,
        mask_token_id=head.config.mask_token_id,
    )
    positions = torch.arange(12)[None]
    packed = head(blocks.block_input_ids, anchors.positions, features, context_position_ids=positions)
    for n in range(4):
        single = head(
            blocks.block_input_ids[:, n : n + 1],
            anchors.positions[:, n : n + 1],
            features,
            context_position_ids=positions,
        )
        torch.testing.assert_close(packed.base_logits[:, n : n + 1], single.base_logits)
        # Context rows at or after the anchor are invisible: changing them changes nothing.
        changed = features.clone()
        changed[:, int(anchors.positions[0, n]) :] = torch.randn_like(changed[:, int(anchors.positions[0, n]) :])
        hidden = head(
            blocks.block_input_ids[:, n : n + 1],
            anchors.positions[:, n : n + 1],
            changed,
            context_position_ids=positions,
        )
        torch.testing.assert_close(hidden.base_logits, single.base_logits)
