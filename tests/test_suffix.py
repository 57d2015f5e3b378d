"""Suffix drafting: the indexes against brute force, greedy output unchanged, sampled output exact.

The row index (a suffix automaton extended token by token) and the corpus index (suffix arrays of
reversed texts, in segments) are compared under Hypothesis with a brute-force reading of the
specification on short sequences over a two- or three-token alphabet, where matches, ties and
repeated continuations are the rule: the same match length, the same proposed tokens with the
same counts and estimates, whether the text was indexed at once or in chunks.

In the loop, :class:`SuffixDrafter` must leave greedy output token-for-token that of plain
``generate()`` (a batch with left padding, a stop token that ends rows at different rounds, three
schedules), on a tiny target whose scaled-up LM head makes its greedy output loop, so that drafts
are accepted; and sampled output must have the target's law exactly, by the chi-square test of
``test_generation_sampling`` at T = 0.7 and T = 1.0 with top-p. Two broken variants of the one-hot
``q`` (uniform over the drafted ids; zero, which accepts a draft without the test) fail that test,
which shows it has the power to catch a wrong ``q``.
"""

import lzma
from dataclasses import replace

import pytest
import torch
from conftest import tiny_head, tiny_target
from hypothesis import given
from hypothesis import strategies as st
from test_generation_sampling import VOCAB as SAMPLING_VOCAB
from test_generation_sampling import chi_square_p_value

from spark_generate import AdaptiveSchedule, ConfidenceThreshold, CostTable, FixedLength, decode
from spark_generate.drafting import NO_CONFIDENCE
from spark_generate.suffix import (
    MAX_CANDIDATES,
    CorpusIndex,
    Proposal,
    SuffixDrafter,
    SuffixIndex,
    SuffixSettings,
)

EOS = 1
MAX_NEW_TOKENS = 40


def brute_force(
    texts: list[list[int]], context: list[int], settings: SuffixSettings, max_tokens: int, row: bool = False
) -> Proposal:
    """The specification, literally: ``texts`` are searched for the context's longest suffix.

    An occurrence counts when a token follows it in its text. The row index is the case
    ``texts = [context]`` (the occurrence at the very end has no follower) and breaks ties between
    continuations by the latest occurrence (``row=True``); the corpus index by the lower token id.
    """

    def followers(pattern: list[int]) -> list[tuple[int, tuple[int, int]]]:
        n = len(pattern)
        return [
            (text[end], (index, end))
            for index, text in enumerate(texts)
            for end in range(n, len(text))
            if text[end - n : end] == pattern
        ]

    limit = min(settings.max_pattern_length, len(context))
    match_length = next((n for n in range(limit, 0, -1) if followers(context[len(context) - n :])), 0)
    pattern = context[len(context) - match_length :]
    token_ids, estimates, counts, totals, running = [], [], [], [], 1.0
    while match_length and len(token_ids) < max_tokens:
        found = followers(pattern)
        if not found:
            break
        count = {token: sum(1 for t, _ in found if t == token) for token, _ in found}
        latest = {token: max(where for t, where in found if t == token) for token, _ in found}
        token = max(count, key=lambda t: (count[t], latest[t]) if row else (count[t], -t))
        estimate = settings.estimate(count[token], len(found), len(pattern))
        if running * estimate < settings.min_probability:
            break
        running *= estimate
        token_ids.append(token)
        estimates.append(estimate)
        counts.append(count[token])
        totals.append(len(found))
        pattern = [*pattern, token]
    return Proposal(tuple(token_ids), tuple(estimates), tuple(counts), tuple(totals), match_length)


@st.composite
def settings(draw) -> SuffixSettings:
    return SuffixSettings(
        max_pattern_length=draw(st.integers(1, 6)),
        min_probability=draw(st.sampled_from([0.0, 0.1, 0.5])),
        pattern_prior=draw(st.sampled_from([0.0, 1.3])),
    )


tokens = st.lists(st.integers(0, 2), max_size=40)


@given(tokens, st.lists(st.integers(1, 6), min_size=1, max_size=20), settings(), st.integers(1, 5))
def test_row_index_equals_brute_force_and_a_rebuild_at_every_step(token_ids, chunks, settings, max_tokens):
    index, position = SuffixIndex(max_tokens, settings), 0
    for chunk in [*chunks, len(token_ids)]:
        index.extend(token_ids[position : position + chunk])
        position = min(position + chunk, len(token_ids))
        text = token_ids[:position]
        expected = brute_force([text], text, settings, max_tokens, row=True)
        assert index.propose() == expected
        assert SuffixIndex(max_tokens, settings, text).propose() == expected
        assert index.match()[1] == expected.match_length


@given(st.lists(st.lists(st.integers(0, 2), max_size=15), max_size=6), st.lists(tokens, min_size=1, max_size=4))
def test_corpus_index_equals_brute_force_at_once_and_in_segments(documents, contexts):
    settings, max_tokens = SuffixSettings(max_pattern_length=4, min_probability=0.0), 5
    at_once = CorpusIndex(documents, settings)
    in_segments = CorpusIndex((), settings)
    for document in documents:
        in_segments.add([document])
    texts = [document for document in documents if document]
    for context in contexts:
        expected = brute_force(texts, context, settings, max_tokens)
        assert at_once.propose(context, max_tokens) == expected
        assert in_segments.propose(context, max_tokens) == expected


def test_corpus_segments_merge_as_they_grow():
    corpus = CorpusIndex([[2, 3, 4] * 50])
    for _ in range(8):
        corpus.add([[5, 6]])
    assert corpus.num_tokens == 150 + 16
    assert 1 < corpus.num_segments < 8
    assert corpus.propose([9, 5], 3).token_ids == (6,)


def test_corpus_counts_are_exact_beyond_the_candidate_sample():
    documents = [[5, 6, 7]] * (3 * MAX_CANDIDATES) + [[5, 8, 7]] * MAX_CANDIDATES
    settings = SuffixSettings(min_probability=0.0)
    proposal = CorpusIndex(documents, settings).propose([4, 5], 2)
    assert proposal == brute_force(documents, [4, 5], settings, 2)
    assert proposal.counts == (3 * MAX_CANDIDATES, 3 * MAX_CANDIDATES)
    assert proposal.totals == (4 * MAX_CANDIDATES, 3 * MAX_CANDIDATES)


def test_corpus_reads_the_answers_of_jsonl_and_xz_files(tmp_path):
    line = '{"input_ids": [9, 9, 5, 6, 7, 9, 5, 6], "loss_mask": [0, 0, 1, 1, 1, 0, 1, 1]}\n'
    (tmp_path / "a.jsonl").write_text(line)
    (tmp_path / "b.jsonl.xz").write_bytes(lzma.compress(line.encode()))
    corpus = CorpusIndex.from_jsonl(tmp_path / "a.jsonl", tmp_path / "b.jsonl.xz")
    assert corpus.num_tokens == 10  # the answer spans [5, 6, 7] and [5, 6], twice
    assert corpus.propose([9, 5], 2).token_ids == (6, 7)
    assert CorpusIndex.from_jsonl(tmp_path / "a.jsonl", answers_only=False).num_tokens == 8


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        CorpusIndex.from_jsonl(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"tokens": [1]}\n')
    with pytest.raises(ValueError, match="is not a tokenized document"):
        CorpusIndex.from_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="negative token id"):
        CorpusIndex([[3, -2]])
    with pytest.raises(ValueError, match="max_pattern_length"):
        SuffixSettings(max_pattern_length=0)
    with pytest.raises(ValueError, match="max_draft_length=8"):
        SuffixDrafter(CorpusIndex([[1, 2]], max_draft_length=4), max_tokens=8)
    with pytest.raises(TypeError, match="expected a CorpusIndex or None"):
        SuffixDrafter(tiny_head(tiny_target("llama", num_layers=2)))


@pytest.fixture(scope="module")
def looping_target():
    """A target whose greedy output falls into loops (its LM head scaled up), so suffix drafts are accepted."""
    return tiny_target("llama", vocab_size=32, lm_head_scale=8.0, eos_token_id=EOS, dtype=torch.float64)


def left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, 32, (4, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(4):
        input_ids[row, : 2 * row] = 0
        attention_mask[row, : 2 * row] = 0
    return input_ids, attention_mask


SCHEDULES = {
    "fixed": FixedLength(),
    "threshold": ConfidenceThreshold(0.5),
    "adaptive": AdaptiveSchedule(CostTable(num_tokens=(4, 20), verify_seconds=(1.0, 1.05))),
}


@pytest.mark.parametrize("with_corpus", [False, True], ids=["row", "row+corpus"])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_greedy_output_is_plain_greedy_and_drafts_are_accepted(looping_target, schedule_name, with_corpus):
    input_ids, attention_mask = left_padded_prompts()
    kwargs = {"attention_mask": attention_mask, "max_new_tokens": MAX_NEW_TOKENS, "do_sample": False}
    # A stop token that the plain output reaches in some rows only, so rows leave the batch at different rounds.
    first = looping_target.generate(input_ids, eos_token_id=None, pad_token_id=0, **kwargs)[:, input_ids.shape[1] :]
    stop = int(first[0, MAX_NEW_TOKENS // 2])
    plain = looping_target.generate(input_ids, eos_token_id=stop, pad_token_id=0, **kwargs)
    corpus = CorpusIndex(first.tolist()) if with_corpus else None
    head = tiny_head(looping_target)
    out = looping_target.generate(
        input_ids, eos_token_id=stop, pad_token_id=0, custom_generate=decode, dspark_head=head,
        dspark_drafter=lambda head: SuffixDrafter(corpus, max_tokens=head.config.num_draft_tokens),
        dspark_suffix=False, dspark_schedule=SCHEDULES[schedule_name], return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    assert torch.equal(out.sequences, plain)
    generated = plain[:, input_ids.shape[1] :]
    stops = [row.index(stop) if stop in row else MAX_NEW_TOKENS for row in generated.tolist()]
    assert min(stops) < MAX_NEW_TOKENS and len(set(stops)) > 1, "the test must exercise rows that stop early"
    stats = out.dspark_stats
    assert stats.num_accepted.sum() >= (30 if with_corpus else 15), "the test must exercise accepted suffix drafts"


def test_sampled_blocks_are_one_hot_and_padded_slots_stop_the_schedules(looping_target):
    blocks = []

    class Recording(SuffixDrafter):
        def __init__(self, head):
            super().__init__(max_tokens=head.config.num_draft_tokens)

        def draft(self, request):
            blocks.append(super().draft(request))
            return blocks[-1]

    input_ids, attention_mask = left_padded_prompts()
    looping_target.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=True, custom_generate=decode,
        dspark_head=tiny_head(looping_target), dspark_drafter=Recording, dspark_suffix=False, dspark_seed=0,
        pad_token_id=0, dspark_schedule=FixedLength(),
    )  # fmt: skip
    vocab_size = looping_target.config.vocab_size
    for block in blocks:
        num_slots = block.token_ids.shape[1]
        spread = block.target_probs(num_slots, vocab_size)
        assert torch.equal(spread, torch.nn.functional.one_hot(block.token_ids, vocab_size).float())
        assert block.probs.shape[-1] == len(block.vocab_ids) < vocab_size
    padded = torch.cat([block.confidence_logits == NO_CONFIDENCE for block in blocks])
    assert padded.any() and not padded.all()
    assert (padded.long().diff(dim=1) >= 0).all(), "a row's unproposed slots come after its proposal"


def suffix_drafter(drafter_class):
    """A drafter factory for the loop's seam: the suffix drafter filling the head's block."""
    return lambda head: drafter_class(max_tokens=head.config.num_draft_tokens)


@pytest.fixture(scope="module")
def sampling_target():
    """The target of test_generation_sampling: 6 tokens, LM head scaled by 10."""
    return tiny_target("llama", num_layers=2, vocab_size=SAMPLING_VOCAB, eos_token_id=None, lm_head_scale=10.0)


@pytest.mark.parametrize(
    ("setting", "schedule"),
    [
        ({"temperature": 0.7, "top_p": 0.8}, FixedLength()),
        ({"temperature": 1.0, "top_p": 0.9}, ConfidenceThreshold(0.3)),
    ],
    ids=["T=0.7,top-p=0.8,fixed", "T=1,top-p=0.9,threshold"],
)
def test_sampled_output_has_the_targets_distribution(sampling_target, setting, schedule):
    head = tiny_head(sampling_target, block_size=3)
    assert chi_square_p_value(sampling_target, setting, head, schedule, drafter=suffix_drafter(SuffixDrafter)) > 1e-4


class UniformQ(SuffixDrafter):
    """Mutant: q uniform over the drafted ids instead of one-hot at the drafted token."""

    def draft(self, request):
        block = super().draft(request)
        return replace(block, probs=torch.full_like(block.probs, 1.0 / block.probs.shape[-1]))


class ZeroQ(SuffixDrafter):
    """Mutant: q(d) = 0, so a draft is accepted whenever the target allows it, without the test."""

    def draft(self, request):
        block = super().draft(request)
        return replace(block, probs=torch.zeros_like(block.probs))


@pytest.mark.parametrize("mutant", [UniformQ, ZeroQ], ids=["q not one-hot", "accepted without the test"])
def test_a_wrong_q_is_caught(sampling_target, mutant):
    head = tiny_head(sampling_target, block_size=3)
    setting = {"temperature": 0.7, "top_p": 0.8}
    assert chi_square_p_value(sampling_target, setting, head, FixedLength(), drafter=suffix_drafter(mutant)) < 1e-8
