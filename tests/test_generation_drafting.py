"""The draft side of the loop: head variants stay exact, and the draft context is the right one.

Exactness does not depend on the drafts, so a bug in what the head is shown (wrong positions,
holes left visible, a draft cache not advanced) would only lower acceptance. One test catches such
bugs directly: inside a ragged, left-padded batch it recomputes every drafted block from scratch (a
fresh target forward over the row's committed tokens and a head forward without cache) and
requires the same drafts. Another checks that a context cut to its catch-up limit keeps the newest
committed rows, the ones next to the anchor.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_generation import VOCAB, OracleDrafter, oracle, prompts, tiny_head, tiny_target

import spark_generate.generation as generation
from spark_generate import FixedLength, decode
from spark_generate.drafting import DraftContext, HeadDrafter, PendingContext
from spark_generate.kernels import RandomStream
from spark_generate.rows import UNSEEN_POSITION
from spark_generate.sampling import inverse_cdf_sample


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


@pytest.mark.parametrize(
    "head_fields",
    [
        {"markov_head_type": "gated"},
        {"markov_head_type": "rnn"},
        {"markov_rank": 0, "enable_confidence_head": False},
        {"sample_from_anchor": False},
        {"draft_vocab_size": 40},
        {"enable_confidence_head": True, "confidence_head_with_markov": True},
    ],
    ids=["gated", "rnn", "no-markov", "dflash-slots", "reduced-vocab", "confidence"],
)
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_head_variants(llama, head_fields, do_sample):
    """Greedy output equals plain greedy; sampled output runs and is reproducible."""
    head = tiny_head(llama, **head_fields)
    input_ids, attention_mask = prompts(3)
    kwargs = {"attention_mask": attention_mask, "do_sample": do_sample, "max_new_tokens": 12}
    spec = llama.generate(input_ids, custom_generate=decode, dspark_head=head, dspark_seed=5, **kwargs)
    if do_sample:
        again = llama.generate(input_ids, custom_generate=decode, dspark_head=head, dspark_seed=5, **kwargs)
        assert torch.equal(spec, again)
    else:
        assert torch.equal(spec, llama.generate(input_ids, **kwargs))


@torch.no_grad()
def drafts_from_scratch(target, head, prefixes, anchor_ids) -> torch.Tensor:
    """Greedy drafts recomputed per row from the row's committed tokens, without any cache."""
    drafts = []
    for row_ids, length, anchor in zip(prefixes.token_ids, prefixes.lengths.tolist(), anchor_ids, strict=True):
        tokens = row_ids[:length]
        tokens = tokens[(tokens != 0).long().cumsum(0) > 0]  # drop the left padding (pad id 0)
        hidden_states = target(tokens[None, :-1], output_hidden_states=True).hidden_states
        out = head(head.block_input_ids(anchor[None]), torch.tensor([[len(tokens) - 1]]),
                   head.select_target_features(hidden_states))  # fmt: skip
        prev, state, row_drafts = anchor[None], out.first_markov_state(0), []
        for slot in range(head.config.num_draft_tokens):
            step = head.draft_step(out.base_logits[:, 0, slot], out.draft_hidden[:, 0, slot], prev, state)
            prev, state = step.draft_logits.argmax(-1), step.markov_state
            row_drafts.append(prev)
        drafts.append(torch.cat(row_drafts))
    return torch.stack(drafts)


@pytest.mark.parametrize("markov_head_type", ["vanilla", "rnn"])
def test_draft_context_is_the_committed_prefix(llama, markov_head_type):
    head = tiny_head(llama, block_size=4, markov_head_type=markov_head_type)
    input_ids, attention_mask = prompts(3)
    plain = llama.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20)
    checked = []

    def check(block, head, anchor_ids, prefixes):
        torch.testing.assert_close(
            block.token_ids, drafts_from_scratch(llama, head, prefixes, anchor_ids), rtol=0, atol=0
        )
        checked.append(len(anchor_ids))

    # Ragged acceptance (corrupted oracle drafts) leaves holes in both caches.
    spec = llama.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20, custom_generate=decode,
        dspark_head=head, **oracle(plain, corrupt_seed=5, inspect=check),
    )  # fmt: skip
    assert torch.equal(spec, plain) and len(checked) >= 5


def test_reduced_vocab_drafts_stay_in_the_draft_vocabulary(llama):
    head = tiny_head(llama, draft_vocab_size=40)
    allowed = head.draft_to_target_ids(torch.arange(40))
    seen = []

    class Recording(HeadDrafter):
        def draft(self, request):
            block = super().draft(request)
            seen.append(block)
            return block

    input_ids, attention_mask = prompts(2)
    llama.generate(input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=8,
                   custom_generate=decode, dspark_head=head, dspark_drafter=Recording,
                   dspark_schedule=FixedLength())  # fmt: skip
    for block in seen:
        assert torch.isin(block.token_ids, allowed).all()
        assert torch.equal(block.vocab_ids, allowed) and block.probs.shape[-1] == 40
        torch.testing.assert_close(block.probs.sum(-1), torch.ones(block.probs.shape[:2]))
        spread = block.target_probs(block.probs.shape[1], VOCAB)
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[allowed] = False
        assert (spread[..., outside] == 0).all() and torch.equal(spread[..., allowed], block.probs)
    assert seen


@pytest.mark.parametrize("draft_vocab_size", [None, 40], ids=["full-vocab", "reduced-vocab"])
def test_sampled_drafts_are_the_seeded_draft_stream_draws(llama, draft_vocab_size):
    """Each slot's draft is ``inverse_cdf_sample(q, seed, position, DRAFT)`` at its own absolute position.

    A slot or row reading another one's uniform (or the PLAIN stream) would draw other tokens.
    """
    head = tiny_head(llama, **({} if draft_vocab_size is None else {"draft_vocab_size": draft_vocab_size}))
    seen = []

    class Recording(HeadDrafter):
        def draft(self, request):
            block = super().draft(request)
            seen.append((request, block))
            return block

    input_ids, attention_mask = prompts(3)
    llama.generate(input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=10, dspark_seed=7,
                   custom_generate=decode, dspark_head=head, dspark_drafter=Recording,
                   dspark_schedule=FixedLength())  # fmt: skip
    assert seen
    for request, block in seen:
        for slot in range(block.probs.shape[1]):
            positions = request.anchor_positions + 1 + slot
            expected = inverse_cdf_sample(block.probs[:, slot], seed=request.sampling.seeds, positions=positions,
                                          stream=RandomStream.DRAFT)  # fmt: skip
            if block.vocab_ids is not None:
                expected = block.vocab_ids[expected]
            assert torch.equal(block.token_ids[:, slot], expected)


def test_a_context_cut_to_the_catch_up_limit_keeps_the_newest_rows(llama, monkeypatch):
    """With the limit at 2 rows, after a block of 5 accepted tokens the head sees the 2 just before the anchor."""
    monkeypatch.setattr(generation, "MAX_CATCH_UP_ROWS", 2)
    head = tiny_head(llama, block_size=4)
    input_ids, attention_mask = prompts(2)
    plain = llama.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16)
    seen = []

    class Recording(OracleDrafter):
        def draft(self, request):
            seen.append((request.context.positions, request.anchor_positions))
            return super().draft(request)

    spec = llama.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16, custom_generate=decode,
        dspark_head=head, dspark_drafter=lambda head: Recording(head, plain), dspark_schedule=FixedLength(),
    )  # fmt: skip
    assert torch.equal(spec, plain) and len(seen) >= 3
    for positions, anchor_positions in seen[1:]:  # the first round reads the whole prompt
        newest = positions.masked_fill(positions == UNSEEN_POSITION, -1).max(dim=1).values
        assert positions.shape[1] == 2 and newest.tolist() == (anchor_positions - 1).tolist()


@given(
    prompt_rows=st.integers(1, 6),
    chunk_rows=st.lists(st.integers(1, 5), max_size=12),
    max_rows=st.integers(1, 8),
    drop_after=st.integers(0, 12),
)
def test_a_pending_context_shows_what_joining_every_round_would(prompt_rows, chunk_rows, max_rows, drop_after):
    """Kept in chunks, the context is the one a join after every round and a cut to ``max_rows`` would give."""
    generator = torch.Generator().manual_seed(prompt_rows * 100 + len(chunk_rows))

    def context(rows: int) -> DraftContext:
        batch = len(features) if step > drop_after else 3
        return DraftContext(torch.randn(batch, rows, 4, generator=generator), torch.randint(0, 99, (batch, rows)))

    step = -1
    prompt = context(prompt_rows)
    pending, features, positions = PendingContext((prompt,)), prompt.features, prompt.positions
    assert torch.equal(pending.take().features, features)  # the prompt alone: whole
    for step, rows in enumerate(chunk_rows):
        newer = context(rows)
        pending = pending.append(newer, max_rows)
        features = torch.cat([features, newer.features], dim=1)[:, -max_rows:]
        positions = torch.cat([positions, newer.positions], dim=1)[:, -max_rows:]
        if step == drop_after:  # rows leave the batch
            keep = torch.tensor([0, 2])
            pending, features, positions = pending.select_rows(keep), features[keep], positions[keep]
        taken = pending.take()
        assert torch.equal(taken.features, features) and torch.equal(taken.positions, positions)
        assert sum(chunk.positions.shape[1] for chunk in pending.chunks[1:]) < max_rows  # older chunks dropped
