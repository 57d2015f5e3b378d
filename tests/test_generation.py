"""Greedy DSpark decoding is token-for-token plain greedy decoding, on tiny random float64 models.

An untrained head exercises the rejection path (almost every draft is rejected); an *oracle*
drafter, which drafts the known plain-greedy continuation (optionally corrupted at a random slot
per row), exercises multi-token acceptance, ragged acceptance across a batch and cache rollback.
Nothing touches the Hub.
"""

from dataclasses import replace

import pytest
import torch
from conftest import tiny_head
from conftest import tiny_target as shared_tiny_target
from transformers.generation.streamers import BaseStreamer

import spark_generate.generation as generation
from spark_generate import FixedLength, decode
from spark_generate.drafting import HeadDrafter

VOCAB = 128
PAD, EOS = 0, 1
ARCHITECTURES = ("llama", "qwen3", "mistral")


def tiny_target(architecture: str = "llama", **fields):
    """A random float64 causal LM (hidden 64, vocabulary 128) with pad 0 and EOS 1."""
    fields = {"vocab_size": VOCAB, "max_position_embeddings": 256, "dtype": torch.float64, **fields}
    return shared_tiny_target(architecture, **fields)


def prompts(batch_size: int, length: int = 7, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts: row ``b`` has ``b`` padding tokens (capped)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(batch_size):
        num_pad = min(row, length - 2)
        input_ids[row, :num_pad] = PAD
        attention_mask[row, :num_pad] = 0
    return input_ids, attention_mask


@pytest.fixture(scope="module", params=ARCHITECTURES)
def target(request):
    return tiny_target(request.param)


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


class OracleDrafter:
    """Drafts the known greedy continuation ``reference`` instead of the head's drafts.

    With ``corrupt_seed``, each row's block is wrong from a random slot on (ragged acceptance).
    ``inspect(block, head, anchor_ids, prefixes)`` sees the head's own block first.
    """

    def __init__(self, head, reference: torch.Tensor, corrupt_seed: int | None = None, inspect=None):
        self.head, self.inner = head, HeadDrafter(head)
        self.reference, self.corrupt_seed, self.inspect = reference, corrupt_seed, inspect
        self.generator = torch.Generator().manual_seed(corrupt_seed or 0)

    def select_rows(self, keep):
        self.inner.select_rows(keep)

    def draft(self, request):
        block = self.inner.draft(request)
        if self.inspect is not None:
            self.inspect(block, self.head, request.anchor_ids, request.prefixes)
        reference, prefixes = self.reference, request.prefixes
        num_drafts = block.token_ids.shape[1]
        padded = torch.cat([reference, reference.new_full((reference.shape[0], num_drafts + 1), PAD)], dim=1)
        drafts = torch.stack([padded[row, length : length + num_drafts] for row, length in zip(
            _rows(prefixes, reference), prefixes.lengths.tolist(), strict=True)])  # fmt: skip
        if self.corrupt_seed is not None:
            first_wrong = torch.randint(0, num_drafts + 1, (len(drafts), 1), generator=self.generator)
            wrong = torch.arange(num_drafts)[None] >= first_wrong
            drafts = torch.where(wrong, (drafts + 1) % VOCAB, drafts)
        return replace(block, token_ids=drafts)


def oracle(reference: torch.Tensor, corrupt_seed: int | None = None, inspect=None) -> dict:
    """``generate()`` keywords that draft with an :class:`OracleDrafter` and verify every slot."""
    return {
        "dspark_drafter": lambda head: OracleDrafter(head, reference, corrupt_seed, inspect),
        "dspark_schedule": FixedLength(),
    }


def _rows(prefixes, reference: torch.Tensor) -> list[int]:
    """Which reference row each running row is (rows leave the batch as they finish)."""
    found = []
    for row_ids, length in zip(prefixes.token_ids, prefixes.lengths.tolist(), strict=True):
        matches = (reference[:, :length] == row_ids[:length]).all(dim=1).nonzero()[:, 0]
        found.append(int(matches[0]))
    return found


def greedy_pair(target, head, input_ids, attention_mask=None, **kwargs):
    plain = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, **kwargs)
    spec = target.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, custom_generate=decode, dspark_head=head, **kwargs
    )
    return plain, spec


# ---------------------------------------------------------------------------- greedy exactness


@pytest.mark.parametrize("batch_size", [1, 3])
def test_untrained_head_matches_plain_greedy(target, batch_size):
    input_ids, attention_mask = prompts(batch_size)
    plain, spec = greedy_pair(target, tiny_head(target), input_ids, attention_mask, max_new_tokens=24)
    assert torch.equal(plain, spec)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_oracle_drafts_are_accepted_in_full(target, batch_size):
    input_ids, attention_mask = prompts(batch_size)
    head = tiny_head(target, block_size=5)
    plain = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=31)
    drafting = oracle(plain)
    spec = target.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=31, custom_generate=decode,
        dspark_head=head, return_dict_in_generate=True, **drafting,
    )  # fmt: skip
    assert torch.equal(plain, spec.sequences)
    stats = spec.dspark_stats
    assert torch.all(stats.num_accepted == stats.num_drafted)  # every verified draft accepted
    assert torch.all(stats.tau == 6.0)  # 30 tokens after the first = 5 steps of 5 drafts + 1 bonus
    assert torch.all(stats.acceptance_by_position == 1.0) and "tau 6.00" in stats.summary()


@pytest.mark.parametrize("corrupt_seed", [0, 1, 2])
def test_ragged_acceptance_with_left_padding(target, corrupt_seed):
    input_ids, attention_mask = prompts(5)
    head = tiny_head(target, block_size=4)
    plain = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=25)
    drafting = oracle(plain, corrupt_seed)
    spec = target.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=25, custom_generate=decode,
        dspark_head=head, return_dict_in_generate=True, **drafting,
    )  # fmt: skip
    assert torch.equal(plain, spec.sequences)
    accepted = spec.dspark_stats.num_accepted
    assert accepted.sum() > 0 and len(set(spec.dspark_stats.num_rounds.tolist())) > 1  # ragged


@pytest.mark.parametrize("max_new_tokens", [1, 2, 6, 9])
def test_max_new_tokens_mid_block(llama, max_new_tokens):
    input_ids, attention_mask = prompts(2)
    plain = llama.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens)
    drafting = oracle(plain)
    spec = llama.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens,
        custom_generate=decode, dspark_head=tiny_head(llama, block_size=4), **drafting,
    )  # fmt: skip
    assert torch.equal(plain, spec)


@pytest.mark.parametrize("eos_slots", [[5], [5, 11]])
def test_eos_inside_an_accepted_block(llama, eos_slots):
    """EOS ids taken from the plain output, so the oracle's accepted blocks contain them."""
    input_ids, attention_mask = prompts(3)
    prompt_length = input_ids.shape[1]
    free = llama.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20)
    eos_ids = [int(free[row % 3, prompt_length + slot]) for row, slot in enumerate(eos_slots)]
    kwargs = {"attention_mask": attention_mask, "do_sample": False, "max_new_tokens": 20, "eos_token_id": eos_ids}
    plain = llama.generate(input_ids, **kwargs)
    assert plain.shape[1] < free.shape[1] or (plain == PAD).any()  # the EOS really stopped something
    drafting = oracle(plain)
    head = tiny_head(llama, block_size=6)
    spec = llama.generate(
        input_ids, custom_generate=decode, dspark_head=head, return_dict_in_generate=True, output_scores=True,
        **kwargs, **drafting,
    )  # fmt: skip
    assert torch.equal(plain, spec.sequences)
    # One score per generated token; a row that stopped early gets -inf after its last token.
    generated = (spec.sequences[:, prompt_length:] != PAD).sum(dim=1)
    assert len(spec.scores) == plain.shape[1] - prompt_length
    for step, step_scores in enumerate(spec.scores):
        assert torch.equal(torch.isinf(step_scores).all(dim=1), step >= generated)


@pytest.mark.parametrize(
    "processors",
    [
        {"repetition_penalty": 1.3},
        {"no_repeat_ngram_size": 2},
        {"min_new_tokens": 8, "repetition_penalty": 1.2},
        {"suppress_tokens": [5, 6, 7], "begin_suppress_tokens": [9]},
    ],
    ids=["repetition", "no-repeat-ngram", "min-new-tokens", "suppress"],
)
@pytest.mark.parametrize("use_oracle", [False, True], ids=["untrained", "oracle"])
def test_logits_processors_per_position(llama, processors, use_oracle):
    input_ids, attention_mask = prompts(3)
    # An EOS that plain decoding emits early, so min_new_tokens has something to suppress.
    free = llama.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20)
    kwargs = {"attention_mask": attention_mask, "do_sample": False, "max_new_tokens": 20, **processors}
    kwargs["eos_token_id"] = int(free[0, input_ids.shape[1] + 3])
    plain = llama.generate(input_ids, **kwargs)
    drafting = oracle(plain, corrupt_seed=4) if use_oracle else {}
    spec = llama.generate(input_ids, custom_generate=decode, dspark_head=tiny_head(llama), **kwargs, **drafting)
    assert torch.equal(plain, spec)


def test_scores_and_logits_match_plain_generate(llama):
    input_ids, attention_mask = prompts(2)
    kwargs = {
        "attention_mask": attention_mask, "do_sample": False, "max_new_tokens": 12, "repetition_penalty": 1.3,
        "return_dict_in_generate": True, "output_scores": True, "output_logits": True,
    }  # fmt: skip
    plain = llama.generate(input_ids, **kwargs)
    drafting = oracle(plain.sequences, corrupt_seed=1)
    spec = llama.generate(input_ids, custom_generate=decode, dspark_head=tiny_head(llama), **kwargs, **drafting)
    assert torch.equal(plain.sequences, spec.sequences)
    assert len(spec.scores) == len(plain.scores) == len(spec.logits)
    for plain_scores, spec_scores, plain_logits, spec_logits in zip(
        plain.scores, spec.scores, plain.logits, spec.logits, strict=True
    ):
        torch.testing.assert_close(spec_scores, plain_scores, atol=1e-9, rtol=0)
        torch.testing.assert_close(spec_logits, plain_logits, atol=1e-9, rtol=0)
    assert "tau" in spec.dspark_stats.summary()


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).clone())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_then_committed_chunks(llama):
    input_ids, _ = prompts(1)
    plain = llama.generate(input_ids, do_sample=False, max_new_tokens=17)
    drafting = oracle(plain, corrupt_seed=2)
    streamer = RecordingStreamer()
    spec = llama.generate(
        input_ids, do_sample=False, max_new_tokens=17, custom_generate=decode, dspark_head=tiny_head(llama),
        dspark_streamer=streamer, **drafting,
    )  # fmt: skip
    assert torch.equal(plain, spec) and streamer.ended
    assert torch.equal(streamer.chunks[0], input_ids[0])
    assert torch.equal(torch.cat(streamer.chunks), spec[0])
    assert max(len(chunk) for chunk in streamer.chunks[1:]) > 1  # several tokens per put


def test_sliding_window_target_batch_one():
    """Gemma3 layers with a 6-token window: rollback of sliding layers at batch size 1."""
    gemma = tiny_target("gemma3", sliding_window=6)
    input_ids, _ = prompts(1)
    plain = gemma.generate(input_ids, do_sample=False, max_new_tokens=20)
    drafting = oracle(plain, corrupt_seed=1)
    spec = gemma.generate(
        input_ids, do_sample=False, max_new_tokens=20, custom_generate=decode, dspark_head=tiny_head(gemma),
        return_dict_in_generate=True, **drafting,
    )  # fmt: skip
    assert torch.equal(plain, spec.sequences) and spec.dspark_stats.num_accepted.sum() > 4
    with pytest.raises(ValueError, match="sliding window of 6 tokens"):
        gemma.generate(prompts(2)[0], max_new_tokens=4, custom_generate=decode, dspark_head=tiny_head(gemma))


# ------------------------------------------------------------------------------- bad inputs


def test_refuses_beam_search(llama):
    input_ids, _ = prompts(1)
    with pytest.raises(ValueError, match="num_beams=3"):
        llama.generate(input_ids, num_beams=3, max_new_tokens=4, custom_generate=decode, dspark_head=tiny_head(llama))


def test_refuses_streaming_a_batch(llama):
    input_ids, attention_mask = prompts(2)
    with pytest.raises(ValueError, match="streaming needs batch size 1"):
        llama.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=4, custom_generate=decode,
            dspark_head=tiny_head(llama), dspark_streamer=RecordingStreamer(),
        )  # fmt: skip


def test_refuses_empty_prompt_and_mismatched_mask(llama):
    head = tiny_head(llama)
    with pytest.raises(ValueError, match="prompt is empty"):
        generation.speculative_generate(
            llama, head, torch.zeros(1, 0, dtype=torch.long), logits_processor=[], stopping_criteria=[],
            generation_config=llama.generation_config,
        )  # fmt: skip
    input_ids, _ = prompts(2)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        generation.speculative_generate(
            llama, head, input_ids, attention_mask=torch.ones(2, 3, dtype=torch.long), logits_processor=[],
            stopping_criteria=[], generation_config=llama.generation_config,
        )  # fmt: skip


def test_refuses_head_of_another_target(llama):
    other = tiny_target("llama", num_layers=3)
    input_ids, _ = prompts(1)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        llama.generate(input_ids, max_new_tokens=4, custom_generate=decode, dspark_head=tiny_head(other))


def test_nan_logits_raise(llama):
    broken = tiny_target("llama")
    with torch.no_grad():
        broken.lm_head.weight[3] = float("nan")
    input_ids, _ = prompts(1)
    with pytest.raises(ValueError, match="NaN logits"):
        broken.generate(input_ids, max_new_tokens=4, custom_generate=decode, dspark_head=tiny_head(broken))
