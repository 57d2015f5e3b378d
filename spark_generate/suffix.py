"""Model-free drafting from what was already written: suffix matching over the row and a corpus.

Much of what a model writes was written before: code being edited, a table rebuilt from the
prompt, an earlier turn repeated with a change, stock phrases. SuffixDecoding (arXiv 2411.04975)
drafts that without any model: find the longest suffix of the row's text that occurred before,
and propose what followed it. :class:`SuffixDrafter` does this behind the
:class:`~spark_generate.drafting.Drafter` seam, so the loop, the schedules and verification are
the ones the head uses.

**What is proposed.** Let ``T`` be a row's committed tokens (prompt and output, ending with the
anchor) and ``x`` the longest suffix of ``T``, at most ``max_pattern_length`` tokens, that also
ends at an earlier position of ``T`` (a *match* of length ``m``). Every earlier occurrence of
``x`` is followed by a token; the proposal's first token is the most frequent of them (ties: the
most recent). Appending it to ``x`` and repeating walks one path through the tree of
continuations, the most frequent child at each step, as Arctic Inference's suffix trees do. Each
token gets an estimate of its acceptance: its conditional frequency ``f`` among the occurrences
of the pattern it continues, shrunk by that pattern's length ``l``, ``f · l / (l + 1.3)``
(calibrated on the target's own answers, see :class:`SuffixSettings`). The proposal stops before
the token that would bring the product of the estimates below ``min_probability``, or when the
continuations run out: a one-token match seen once proposes at most 5 tokens, a 16-token match
with one continuation the whole block. The schedule then chooses how many to verify, from the
estimates.

**The row index** (:class:`SuffixIndex`) is a suffix automaton of ``T`` (Blumer et al.), extended
token by token as tokens are committed: amortised O(1) new states and transitions per token, and
nothing rebuilt. Its states are the classes of substrings with the same set of end positions; a
state's *count* is the size of that set, kept exact for every state whose shortest string is at
most ``max_pattern_length + max_draft_length`` tokens (the only ones ever looked at) by walking
the suffix links from the state of the longest such suffix after each token, O(that length) at
worst and a few steps on ordinary text. The match is the first state on that walk that was seen
at least twice; a proposed token is the child with the largest count (ties: the latest end
position, also kept per state), with frequency that count over the parent's less the occurrence
at the very end of ``T``, which has no follower. A proposal costs a few dictionary lookups per
token, whatever the length of the row. Measured on this project's 2-core CPU, rows of 500 prompt
and 1,000 generated tokens of the target's answers: 1.9 µs per committed token, 8 µs per proposal
(99th percentile 20 µs).

**The corpus index** (:class:`CorpusIndex`) holds earlier texts: the target's own answers
(``examples/data/*.jsonl.xz``, :meth:`CorpusIndex.from_jsonl`), or outputs of earlier requests
added with :meth:`CorpusIndex.add`. It is an FM-style index of the reversed texts in NumPy (a
suffix array sorted by prefix doubling, the tokens that follow each suffix, and their positions
grouped by token): extending the match one token to the left narrows a range by binary search,
extending the proposal one token to the right maps the range by counting that token in it, both
O(log N); the candidates of each step are the followers of the range's occurrences (of 64 evenly
spaced ones in a range larger than that; their counts are exact). Ties go to the lower token id.
Texts added later form segments that are merged as they grow (as in a log-structured merge tree),
so adding a request re-sorts only a small segment. On the 1.25M answer tokens of
``examples/data``: built in 1.8 s into 120 MB, 100 µs per proposal (99th percentile 250 µs).
The drafter proposes from the row and from the corpus and keeps the proposal with the larger
expected number of accepted tokens (the sum of the running products of the estimates),
preferring the row's on a tie, as Arctic Inference does.

**Why it is lossless.** A suffix draft is a deterministic function of the committed tokens (and
of the corpus, fixed while a round is drafted): it is "sampled" from a point mass, and
verification is exact for any draft as long as ``q`` is the distribution the draft was drawn
from (:mod:`spark_generate.kernels`). Greedy decoding takes no ``q``; sampling gets the one-hot
``q`` of each drafted token (``probs`` over the block's distinct drafted ids, ``vocab_ids``), so
a draft ``d`` is accepted with probability ``p(d)`` and a rejection draws from ``p`` without
``d``. The confidence logits are the logits of the estimates. The schedule module's Appendix-A
argument (:mod:`spark_generate.schedule`) asks that whether slot ``j`` is verified never depend
on ``d_j`` beyond what was known before it was drawn; here nothing is drawn at all, the whole
block and its estimates are known from the past, so any decision read from them (how many slots
to verify, whether this drafter or another drafts the row this round) leaves the output law
unchanged. Slots past a row's proposal hold its anchor and the confidence
:data:`~spark_generate.drafting.NO_CONFIDENCE`, which stops every schedule before them (one that
verifies them anyway, such as ``FixedLength``, stays exact: they are one-hot drafts like the
others).

The drafter's blocks have ``max_tokens`` slots (:data:`MAX_DRAFT_TOKENS` by default, more than
the head's block: a long match is worth verifying far), whatever the head's block.
"""

from __future__ import annotations

import bisect
import json
import lzma
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spark_generate.drafting import NO_CONFIDENCE, DraftBlock, DraftRequest

__all__ = ["CorpusIndex", "Proposal", "SuffixDrafter", "SuffixIndex", "SuffixSettings"]

# The longest suffix of a row that is matched (longer matches are cut to their last tokens).
MAX_PATTERN_LENGTH = 16
# The most tokens a proposal has: the suffix drafter's block. On the target's own answers, 16 instead of
# the head's 7 adds 4% to the tokens per verified round from the row alone (6% with the corpus), 32 another 1%.
MAX_DRAFT_TOKENS = 16
# A proposal stops before the token that would bring the product of its estimates below this.
MIN_PROBABILITY = 0.1
# A token continuing a pattern of l tokens that was followed by it in a fraction f of its occurrences is
# accepted with probability about f · l / (l + PATTERN_PRIOR) (fitted on 47k proposals, see SuffixSettings).
PATTERN_PRIOR = 1.3
# Estimates are kept away from 0 and 1 by this much before taking logits.
LOGIT_EPSILON = 1e-6
# A corpus segment is merged into the one before it once it is at least this fraction of its size.
MERGE_FRACTION = 0.5
# Token separating documents in the corpus (never a token id).
SEPARATOR = -1
# A corpus proposal counts the continuations of at most this many evenly spaced occurrences to find
# candidate tokens (all of them below it; a token that follows a tenth of the occurrences is then
# missed with probability below 0.9 ** 64 ≈ 0.1%); each candidate's count is exact.
MAX_CANDIDATES = 64


@dataclass(frozen=True)
class SuffixSettings:
    """How proposals are made and how much they are trusted.

    The estimate of a proposed token is its conditional frequency ``f`` (the fraction of the
    occurrences of the pattern it continues that it followed), shrunk by the pattern's length
    ``l`` (the match plus the tokens proposed before it): ``f · l / (l + pattern_prior)``. A
    pattern of one token seen once is weak evidence (accepted 34% of the time), one of twenty
    strong (95%). The default prior was fitted by maximum likelihood on 47k proposals from the rows
    of 400 of SmolLM2-135M-Instruct's own greedy answers (``examples/data``, a held-out half of
    its prompts), where estimates binned by 0.2 match the acceptance within 0.05; proposals from
    the corpus are slightly overestimated there (0.85 for an accepted 0.76), which the adaptive
    schedule's per-slot correction absorbs.

    Attributes:
        max_pattern_length: The longest suffix matched. On those answers 8, 16 and 32 gave the same
            mean accepted length (within 0.1%).
        min_probability: A proposal stops before the token that would bring the product of the
            estimates below this; the schedule then chooses how many of the proposed tokens to verify.
        pattern_prior: See above; 0 trusts raw frequencies.
    """

    max_pattern_length: int = MAX_PATTERN_LENGTH
    min_probability: float = MIN_PROBABILITY
    pattern_prior: float = PATTERN_PRIOR

    def __post_init__(self) -> None:
        if self.max_pattern_length < 1:
            raise ValueError(f"max_pattern_length={self.max_pattern_length}; expected at least 1.")
        if not 0.0 <= self.min_probability <= 1.0:
            raise ValueError(f"min_probability={self.min_probability}; expected a probability in [0, 1].")
        if self.pattern_prior < 0:
            raise ValueError(f"pattern_prior={self.pattern_prior}; expected at least 0.")

    def estimate(self, count: int, total: int, pattern_length: int) -> float:
        """The probability that a token followed ``count`` of ``total`` occurrences of a pattern is accepted."""
        return count / total * pattern_length / (pattern_length + self.pattern_prior)


@dataclass(frozen=True)
class Proposal:
    """A proposed continuation and the evidence for it.

    Attributes:
        token_ids: The proposed tokens.
        estimates: Each token's estimated probability of being accepted if the tokens before it
            were (see :class:`SuffixSettings`).
        counts: For each token, how many occurrences of the pattern it continues (the match
            extended by the tokens before it) it followed.
        totals: For each token, how many occurrences of that pattern were followed by a token.
        match_length: Tokens of the matched suffix (0: nothing matched).
    """

    token_ids: tuple[int, ...] = ()
    estimates: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    totals: tuple[int, ...] = ()
    match_length: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens under the estimates: the sum of their running products."""
        score, running = 0.0, 1.0
        for estimate in self.estimates:
            running *= estimate
            score += running
        return score


class _Walk:
    """Collects a proposal token by token, stopping as :class:`SuffixSettings` says."""

    def __init__(self, settings: SuffixSettings, match_length: int, max_tokens: int):
        self.settings, self.match_length, self.max_tokens = settings, match_length, max_tokens
        self.token_ids: list[int] = []
        self.estimates: list[float] = []
        self.counts: list[int] = []
        self.totals: list[int] = []
        self.running = 1.0

    def wants_more(self) -> bool:
        return self.match_length > 0 and len(self.token_ids) < self.max_tokens

    def add(self, token_id: int, count: int, total: int) -> bool:
        """Appends a token unless the running estimate would fall below the threshold; returns whether it did."""
        estimate = self.settings.estimate(count, total, self.match_length + len(self.token_ids))
        if self.running * estimate < self.settings.min_probability:
            return False
        self.running *= estimate
        self.token_ids.append(token_id)
        self.estimates.append(estimate)
        self.counts.append(count)
        self.totals.append(total)
        return True

    def proposal(self) -> Proposal:
        return Proposal(
            tuple(self.token_ids), tuple(self.estimates), tuple(self.counts), tuple(self.totals), self.match_length
        )


class SuffixIndex:
    """An incremental suffix automaton of one row's tokens, proposing continuations of its end.

    Args:
        max_draft_length: The most tokens a proposal may have.
        settings: How proposals are made.
        token_ids: Tokens to index right away.
    """

    def __init__(
        self, max_draft_length: int, settings: SuffixSettings | None = None, token_ids: Iterable[int] = ()
    ) -> None:
        self.settings = settings or SuffixSettings()
        self.max_draft_length = max_draft_length
        # Counts are exact for states whose shortest string is at most this long.
        self._depth = self.settings.max_pattern_length + max_draft_length
        self.token_ids: list[int] = []
        # Per state: transitions, suffix link, longest length, end-position count, last end position.
        self._next: list[dict[int, int]] = [{}]
        self._link = [-1]
        self._length = [0]
        self._count = [1]
        self._last_end = [0]
        self._last = 0  # the state of the whole text
        self._deep = 0  # the state of the suffix of min(len(text), depth) tokens
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Appends tokens to the text (amortised O(1) states per token, O(depth) count updates at worst)."""
        for token_id in token_ids:
            self._append(int(token_id))

    def _append(self, token_id: int) -> None:
        nxt, link, length, count, last_end = self._next, self._link, self._length, self._count, self._last_end
        depth, old_size = self._depth, len(self.token_ids)
        self.token_ids.append(token_id)
        # The state of the old suffix of depth - 1 tokens: its successor by token_id is the new deep state.
        shorter = self._deep
        if old_size >= depth and length[link[shorter]] >= depth - 1:
            shorter = link[shorter]
        # The standard online construction (Blumer et al.): a new state for the whole text, maybe a clone.
        current = len(length)
        nxt.append({})
        link.append(0)
        length.append(old_size + 1)
        count.append(0)
        last_end.append(0)
        state = self._last
        while state != -1 and token_id not in nxt[state]:
            nxt[state][token_id] = current
            state = link[state]
        if state != -1:
            target = nxt[state][token_id]
            if length[state] + 1 == length[target]:
                link[current] = target
            else:
                clone = len(length)
                nxt.append(dict(nxt[target]))
                link.append(link[target])
                length.append(length[state] + 1)
                count.append(count[target])
                last_end.append(last_end[target])
                while state != -1 and nxt[state].get(token_id) == target:
                    nxt[state][token_id] = clone
                    state = link[state]
                link[target] = link[current] = clone
        self._last = current
        if old_size + 1 <= depth or depth > length[link[current]]:
            self._deep = current
        else:
            self._deep = nxt[shorter][token_id]
        # Every state holding a suffix of at most `depth` tokens gains the new end position.
        state, end = self._deep, old_size + 1
        while state != -1:
            count[state] += 1
            last_end[state] = end
            state = link[state]

    def match(self) -> tuple[int, int]:
        """``(state, m)``: the longest suffix of at most ``max_pattern_length`` tokens seen before; m = 0 if none."""
        link, length, count = self._link, self._length, self._count
        limit, state = self.settings.max_pattern_length, self._deep
        while state > 0 and (count[state] < 2 or length[link[state]] >= limit):
            state = link[state]
        return state, min(length[state], limit, len(self.token_ids))

    def propose(self, max_tokens: int | None = None) -> Proposal:
        """The continuation of the text's end that the index supports (see the module docstring).

        Args:
            max_tokens: The most tokens to propose; default ``max_draft_length``.
        """
        max_tokens = self.max_draft_length if max_tokens is None else min(max_tokens, self.max_draft_length)
        state, match_length = self.match()
        walk = _Walk(self.settings, match_length, max_tokens)
        count, last_end, end = self._count, self._last_end, len(self.token_ids)
        while walk.wants_more():
            # Occurrences with a continuation: all but one ending at the very end of the text.
            total = count[state] - (last_end[state] == end)
            children = self._next[state]
            if total <= 0 or not children:
                break
            token_id, child = max(children.items(), key=lambda item: (count[item[1]], last_end[item[1]]))
            if not walk.add(token_id, count[child], total):
                break
            state = child
        return walk.proposal()


class _Segment:
    """Documents and an FM-style index of their reversed concatenation.

    ``reversed_ids`` reads the documents backwards, each preceded by :data:`SEPARATOR`, so a
    suffix of it starting at ``i`` reads the corpus backwards from token ``i``: the occurrences of
    a pattern ``x`` are the suffixes starting with ``reversed(x)``, one range of the suffix array,
    and the token that followed an occurrence is the one before it in ``reversed_ids`` (the
    Burrows-Wheeler transform, ``following``). Extending ``x`` to the left narrows the range by a
    binary search; extending it to the right by ``t`` maps the range to the ``t`` bucket by
    counting the ``t`` in ``following`` before its ends (an FM-index step), both in O(log N).
    """

    def __init__(self, documents: list[list[int]], depth: int):
        self.documents = documents
        pieces = [np.array([SEPARATOR])]
        for document in documents:
            pieces += [np.asarray(document, dtype=np.int64), np.array([SEPARATOR])]
        reversed_ids = np.concatenate(pieces)[::-1].copy()
        # Every suffix but the first (a separator with nothing before it), sorted by its first `depth` tokens.
        suffix_array = _suffix_array(reversed_ids, depth)
        suffix_array = suffix_array[suffix_array > 0]
        self.num_tokens = len(reversed_ids) - len(documents) - 1
        first_ids = reversed_ids[suffix_array]
        self.following = reversed_ids[suffix_array - 1]
        # Suffix-array indices grouped by the token that follows them, for counting one token in a range.
        self.grouped = np.argsort(self.following, kind="stable")
        self._grouped = memoryview(self.grouped)
        self._reversed = memoryview(reversed_ids)
        self._suffixes = memoryview(suffix_array)
        # Per token: the start of its bucket (suffixes starting with it), and its span in `grouped`.
        self._bucket = _spans(first_ids)
        self._group = _spans(self.following[self.grouped])

    def narrow(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """``[(lo, hi)]``: the suffix-array ranges of the occurrences of the context's last 1, 2, ... tokens."""
        ranges: list[tuple[int, int]] = []
        if not context or context[-1] not in self._bucket:
            return ranges
        tokens, suffixes = self._reversed, self._suffixes
        lo, hi = self._bucket[context[-1]]
        ranges.append((lo, hi))
        for offset in range(1, len(context)):
            token_id = context[-1 - offset]

            def key(index: int, offset: int = offset) -> int:
                return tokens[index + offset]

            lo = bisect.bisect_left(suffixes, token_id, lo, hi, key=key)
            hi = bisect.bisect_right(suffixes, token_id, lo, hi, key=key)
            if lo == hi:
                break
            ranges.append((lo, hi))
        return ranges

    def _rank(self, token_id: int, lo: int, hi: int) -> tuple[int, int]:
        """How many of ``following[:lo]`` and of ``following[:hi]`` are ``token_id``."""
        start, end = self._group.get(token_id, (0, 0))
        grouped = self._grouped
        return bisect.bisect_left(grouped, lo, start, end) - start, bisect.bisect_left(grouped, hi, start, end) - start

    def continuations(self, lo: int, hi: int) -> dict[int, int]:
        """Tokens following the occurrences in ``[lo, hi)`` and how many (candidates only for large ranges)."""
        if hi - lo <= MAX_CANDIDATES:
            counts: dict[int, int] = {}
            for token_id in self.following[lo:hi].tolist():
                counts[token_id] = counts.get(token_id, 0) + 1
            counts.pop(SEPARATOR, None)
            return counts
        step = -(-(hi - lo) // MAX_CANDIDATES)
        candidates = set(self.following[lo:hi:step].tolist()) - {SEPARATOR}
        return {token_id: self.count(token_id, lo, hi) for token_id in candidates}

    def count(self, token_id: int, lo: int, hi: int) -> int:
        """How many occurrences in ``[lo, hi)`` are followed by ``token_id``."""
        before, after = self._rank(token_id, lo, hi)
        return after - before

    def extend(self, token_id: int, lo: int, hi: int) -> tuple[int, int]:
        """The range of the occurrences extended on the right by ``token_id`` (empty: ``lo == hi``)."""
        before, after = self._rank(token_id, lo, hi)
        bucket, _ = self._bucket.get(token_id, (0, 0))
        return bucket + before, bucket + after


def _spans(sorted_ids: np.ndarray) -> dict[int, tuple[int, int]]:
    """``{token: (start, end)}``: where each token's run lies in a sorted array of tokens."""
    ids, starts, counts = np.unique(sorted_ids, return_index=True, return_counts=True)
    return {i: (start, start + n) for i, start, n in zip(ids.tolist(), starts.tolist(), counts.tolist(), strict=True)}


def _suffix_array(tokens: np.ndarray, depth: int) -> np.ndarray:
    """Start positions of all suffixes, sorted by their first ``depth`` tokens (ties: by position).

    Prefix doubling: ranks by the first ``2^k`` tokens, ``k = 0, 1, ...``, until ``2^k >= depth``;
    any pattern of at most ``depth`` tokens then has its occurrences in one contiguous range, and a
    range maps to the range of the pattern extended by one token on the left (the FM-index step).
    """
    size = len(tokens)
    _, rank = np.unique(tokens, return_inverse=True)
    rank = rank.astype(np.int64).reshape(-1)
    width = 1
    while width < depth and rank.max() < size - 1:
        following = np.zeros(size, dtype=np.int64)  # past the end: rank 0, lower than every token
        following[: size - width] = rank[width:] + 1
        keys = rank * (size + 1) + following
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        rank = np.empty(size, dtype=np.int64)
        rank[order] = np.concatenate([[0], np.cumsum(sorted_keys[1:] != sorted_keys[:-1])])
        width *= 2
    return np.argsort(rank, kind="stable")


class CorpusIndex:
    """Earlier texts (answers of the target, outputs of earlier requests), searched by suffix.

    Args:
        documents: Token id sequences.
        settings: How proposals are made (shared with the row indexes of a drafter).
        max_draft_length: The most tokens a proposal may have.
    """

    def __init__(
        self,
        documents: Iterable[Sequence[int]] = (),
        settings: SuffixSettings | None = None,
        max_draft_length: int = MAX_DRAFT_TOKENS,
    ) -> None:
        self.settings = settings or SuffixSettings()
        self.max_draft_length = max_draft_length
        self._segments: list[_Segment] = []
        self.add(documents)

    @classmethod
    def from_jsonl(
        cls, *paths: str | Path, answers_only: bool = True, settings: SuffixSettings | None = None
    ) -> CorpusIndex:
        """Reads tokenized documents (``{"input_ids": [...], "loss_mask": [...]}`` per line, ``.xz`` allowed).

        Args:
            paths: JSONL files, as written by ``spark-generate regenerate`` (optionally xz-compressed).
            answers_only: Index only the loss-masked tokens (the target's answers), one document per
                contiguous span; False indexes whole documents.
            settings: How proposals are made.

        Raises:
            ValueError: A file is missing or a line is not a tokenized document.
        """
        documents = []
        for path in map(Path, paths):
            if not path.is_file():
                raise ValueError(f"corpus file {path} does not exist; expected a JSONL file of tokenized documents.")
            text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
            for number, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    input_ids, loss_mask = record["input_ids"], record.get("loss_mask")
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise ValueError(
                        f"{path}:{number} is not a tokenized document ({error!r}); expected a JSON object with "
                        '"input_ids" (and "loss_mask") lists.'
                    ) from error
                documents += _answer_spans(input_ids, loss_mask) if answers_only else [input_ids]
        return cls(documents, settings)

    @property
    def num_tokens(self) -> int:
        """Tokens indexed."""
        return sum(segment.num_tokens for segment in self._segments)

    @property
    def num_segments(self) -> int:
        """Segments the documents are kept in (merged as they grow)."""
        return len(self._segments)

    def add(self, documents: Iterable[Sequence[int]]) -> None:
        """Indexes more documents: a new segment, merged into earlier ones while it is comparable in size.

        Raises:
            ValueError: A document holds a negative token id.
        """
        documents = [[int(token_id) for token_id in document] for document in documents]
        documents = [document for document in documents if document]
        if not documents:
            return
        if any(min(document) < 0 for document in documents):
            raise ValueError("a corpus document holds a negative token id; expected token ids >= 0.")
        depth = self.settings.max_pattern_length + self.max_draft_length
        self._segments.append(_Segment(documents, depth))
        while len(self._segments) > 1 and (
            self._segments[-1].num_tokens >= MERGE_FRACTION * self._segments[-2].num_tokens
        ):
            newer, older = self._segments.pop(), self._segments.pop()
            self._segments.append(_Segment(older.documents + newer.documents, depth))

    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal:
        """The continuation of ``context``'s end that the corpus supports (see the module docstring).

        Args:
            context: The row's tokens (only the last ``max_pattern_length`` are read).
            max_tokens: The most tokens to propose (at most ``max_draft_length``).
        """
        context = list(context[-self.settings.max_pattern_length :])
        segments = self._segments
        ranges = [segment.narrow(context) for segment in segments]

        def at_length(length: int) -> list[tuple[int, int]]:  # each segment's range of the last `length` tokens
            return [found[length - 1] if len(found) >= length else (0, 0) for found in ranges]

        # The longest match with an occurrence that is followed by a token (not at a document's end).
        match_length = max((len(found) for found in ranges), default=0)
        while match_length and not self._total(at_length(match_length)):
            match_length -= 1
        walk = _Walk(self.settings, match_length, min(max_tokens, self.max_draft_length))
        current = at_length(match_length) if match_length else []
        while walk.wants_more():
            total = self._total(current)
            counts: dict[int, int] = {}
            for segment, (lo, hi) in zip(segments, current, strict=True):
                if lo < hi:
                    for token_id, count in segment.continuations(lo, hi).items():
                        counts[token_id] = counts.get(token_id, 0) + count
            if not total or not counts:
                break
            token_id = max(counts, key=lambda value: (counts[value], -value))  # ties: the lower id
            if not walk.add(token_id, counts[token_id], total):
                break
            current = [segment.extend(token_id, lo, hi) for segment, (lo, hi) in zip(segments, current, strict=True)]
        return walk.proposal()

    def _total(self, current: list[tuple[int, int]]) -> int:
        """Occurrences in the ranges that are followed by a token."""
        return sum(
            hi - lo - segment.count(SEPARATOR, lo, hi)
            for segment, (lo, hi) in zip(self._segments, current, strict=True)
            if lo < hi
        )


def _answer_spans(input_ids: Sequence[int], loss_mask: Sequence[int] | None) -> list[list[int]]:
    """The contiguous loss-masked spans of a document (the whole document without a mask)."""
    if loss_mask is None:
        return [list(input_ids)]
    spans, current = [], []
    for token_id, masked in zip(input_ids, loss_mask, strict=True):
        if masked:
            current.append(int(token_id))
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


class SuffixDrafter:
    """Drafts by suffix matching over each row's text and, optionally, a corpus (one per generation).

    The loop builds one per generation when suffix drafting is on. Through the drafter seam it
    stands in for the head (which then only names the tapped layers and the block size)::

        corpus = CorpusIndex.from_jsonl("examples/data/smollm2-135m-instruct-mixed.jsonl.xz")
        drafter = lambda head: SuffixDrafter(corpus, max_tokens=head.config.num_draft_tokens)
        out = target.generate(**inputs, custom_generate=spark_generate.decode, dspark_head=head,
                              dspark_drafter=drafter)

    Args:
        corpus: Earlier texts to propose from when they support a continuation better than the row.
        settings: How the rows' proposals are made (the corpus keeps its own).
        max_tokens: ``L``, the slots of its blocks: the most tokens it proposes per row.

    Raises:
        TypeError: ``corpus`` is not a :class:`CorpusIndex` (a head, say: see the example).
        ValueError: ``max_tokens`` is below 1, or the corpus was built for shorter proposals.
    """

    def __init__(
        self,
        corpus: CorpusIndex | None = None,
        *,
        settings: SuffixSettings | None = None,
        max_tokens: int = MAX_DRAFT_TOKENS,
    ) -> None:
        if corpus is not None and not isinstance(corpus, CorpusIndex):
            raise TypeError(
                f"corpus is a {type(corpus).__name__}; expected a CorpusIndex or None. As a drafter for the head's "
                "block, pass dspark_drafter=lambda head: SuffixDrafter(max_tokens=head.config.num_draft_tokens)."
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}; expected at least 1 draft slot.")
        if corpus is not None and corpus.max_draft_length < max_tokens:
            raise ValueError(
                f"the corpus proposes at most {corpus.max_draft_length} tokens but the drafter drafts {max_tokens}; "
                f"build it with CorpusIndex(..., max_draft_length={max_tokens})."
            )
        self.corpus = corpus
        self.settings = settings or SuffixSettings()
        self.max_tokens = max_tokens
        self.indexes: list[SuffixIndex] | None = None  # one per running row, built at the first draft

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keeps the indexes of the rows ``keep``."""
        if self.indexes is not None:
            self.indexes = [self.indexes[row] for row in keep.tolist()]

    def draft(self, request: DraftRequest) -> DraftBlock:
        """Indexes the tokens committed since the last call, then proposes up to ``L`` tokens per row.

        Returns:
            ``token_ids [B, L]`` (a row's anchor after its proposal), one-hot ``probs [B, L, U]``
            over the ``U`` distinct drafted ids ``vocab_ids`` when sampling (None when greedy), and
            ``confidence_logits [B, L]``: the logits of the proposal's estimates, then
            :data:`~spark_generate.drafting.NO_CONFIDENCE` (no schedule verifies those slots).
        """
        proposals = [self._propose(index) for index in self._catch_up(request)]
        anchor_ids = request.anchor_ids.tolist()
        num_slots = self.max_tokens
        token_ids = [
            list(proposal.token_ids) + [anchor_id] * (num_slots - len(proposal.token_ids))
            for proposal, anchor_id in zip(proposals, anchor_ids, strict=True)
        ]
        confidence_logits = [
            [_logit(estimate) for estimate in proposal.estimates]
            + [NO_CONFIDENCE] * (num_slots - len(proposal.estimates))
            for proposal in proposals
        ]
        device = request.anchor_ids.device
        token_ids = torch.tensor(token_ids, dtype=torch.int64, device=device).reshape(len(proposals), num_slots)
        confidence_logits = torch.tensor(confidence_logits, dtype=torch.float32, device=device)
        if request.sampling.greedy:
            return DraftBlock(token_ids, None, None, confidence_logits.reshape(token_ids.shape))
        # The draft is a point mass: q is one-hot at the drafted token, over the batch's drafted ids.
        vocab_ids, columns = torch.unique(token_ids, return_inverse=True)
        probs = torch.nn.functional.one_hot(columns, len(vocab_ids)).float()
        return DraftBlock(token_ids, probs, vocab_ids, confidence_logits.reshape(token_ids.shape))

    def _catch_up(self, request: DraftRequest) -> list[SuffixIndex]:
        """The rows' indexes, extended by the tokens committed since they were last extended."""
        prefixes = request.prefixes
        lengths = prefixes.lengths.tolist()
        if self.indexes is None:
            self.indexes = [SuffixIndex(self.max_tokens, self.settings) for _ in lengths]
        if len(self.indexes) != len(lengths):
            raise ValueError(
                f"the drafter holds {len(self.indexes)} rows but the request has {len(lengths)}; the loop must "
                "call select_rows(keep) whenever rows leave the batch."
            )
        start = min(len(index) for index in self.indexes)
        new_ids = prefixes.token_ids[:, start : max(lengths)].tolist()  # one copy for the whole batch
        for index, row_ids, length in zip(self.indexes, new_ids, lengths, strict=True):
            index.extend(row_ids[len(index) - start : length - start])
        return self.indexes

    def _propose(self, index: SuffixIndex) -> Proposal:
        """The row's proposal, or the corpus's when its expected accepted length is larger."""
        proposal = index.propose()
        if self.corpus is None:
            return proposal
        from_corpus = self.corpus.propose(index.token_ids, self.max_tokens)
        return from_corpus if from_corpus.score > proposal.score else proposal


def _logit(probability: float) -> float:
    probability = min(max(probability, LOGIT_EPSILON), 1.0 - LOGIT_EPSILON)
    return math.log(probability / (1.0 - probability))
