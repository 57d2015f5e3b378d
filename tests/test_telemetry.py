"""`SpeculativeStats`: what each step adds, tokens per second, and a summary that explains itself.

Steps are recorded through ``record_step`` (the call the generation loop makes) on a fake clock, so
the time split is exact and nothing is timed.
"""

from types import SimpleNamespace

import pytest
import torch

import spark_generate.telemetry as telemetry
from spark_generate.telemetry import DraftSource, SpeculativeStats, record_step

HEAD, SUFFIX, PLAIN = int(DraftSource.HEAD), int(DraftSource.SUFFIX), int(DraftSource.PLAIN)


class FakeClock:
    """Stands in for ``time.perf_counter`` in the telemetry module; steps advance it by hand."""

    def __init__(self):
        self.now = 100.0

    def step(self, stats, rows, num_verified, num_accepted, *, drafted: bool | list[int], draft: float,
             verify: float, then: float = 0.0) -> None:  # fmt: skip
        """One step: ``draft`` seconds before the target forward, ``verify`` in it, ``then`` committing after it.

        ``drafted``: every row by the head (True), none (False), or each row's :class:`DraftSource`.
        """
        start = self.now
        self.now += draft + verify
        if isinstance(drafted, bool):
            drafted = [HEAD if drafted else PLAIN] * len(rows)
        record_step(
            stats, torch.tensor(rows), torch.tensor(num_verified), torch.tensor(num_accepted), torch.tensor(drafted),
            torch.ones(len(rows), dtype=torch.bool), start, start + draft,
        )  # fmt: skip
        self.now += then


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(telemetry, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    return clock


def test_plain_steps_are_timed_apart_from_verification(clock):
    stats = SpeculativeStats.zeros(1, 4)
    clock.step(stats, [0], [4], [2], drafted=True, draft=1.0, verify=2.0, then=0.5)
    clock.step(stats, [0], [0], [0], drafted=False, draft=0.25, verify=2.75, then=0.5)
    clock.step(stats, [0], [0], [0], drafted=False, draft=0.0, verify=3.0, then=0.5)
    assert (stats.draft_seconds, stats.verify_seconds) == (1.0, 2.0)  # the speculative round only
    assert stats.plain_seconds == 6.0
    assert stats.decode_seconds == 10.0  # first step's start to the last forward's end, commits included
    assert stats.num_rounds.tolist() == [3] and stats.num_plain_steps.tolist() == [2]
    assert stats.num_emitted.tolist() == [5]  # 2 accepted + 1 bonus, then 1 token per plain step
    assert stats.tokens_per_second == 0.5


def test_summary_explains_forwards_throughput_and_time(clock):
    stats = SpeculativeStats.zeros(1, 4)
    clock.step(stats, [0], [4], [3], drafted=True, draft=0.5, verify=1.0, then=0.25)
    clock.step(stats, [0], [0], [0], drafted=False, draft=0.0, verify=0.75)
    assert stats.summary().splitlines() == [
        "DSpark: 2 target forwards per row: 1 speculative round (a drafted block verified)",
        "  + 1 plain decoding step (no draft: the schedule judged drafting would not pay)",
        "  tau 2.50 tokens per target forward; 3 of 4 drafts accepted",
        "  acceptance by draft position: 1.00 1.00 1.00 0.00",
        "  5 tokens in 2.500 s after the prefill: 2.0 tokens/s",
        "  time: draft 0.500 s, verify 1.000 s (speculative rounds), plain steps 0.750 s, other 0.250 s",
        "  head: 1 row-rounds, 3 of 4 drafts accepted, 4.00 tokens per row-round, 2.7 tokens/s",
        "  plain: 1 row-rounds, 1.00 tokens per row-round, 1.3 tokens/s",
    ]


def test_summary_of_a_batch_gives_means_per_row(clock):
    stats = SpeculativeStats.zeros(2, 3)
    clock.step(stats, [0, 1], [3, 3], [1, 0], drafted=True, draft=0.0, verify=1.0)
    clock.step(stats, [0], [0], [0], drafted=False, draft=0.0, verify=1.0)  # row 1 had stopped
    assert stats.summary().startswith(
        "DSpark: 1.5 target forwards per row (mean of 2 rows): 1 speculative round (a drafted block verified)\n"
        "  + 0.5 plain decoding steps"
    )


def test_rows_of_one_round_are_counted_per_drafter(clock):
    stats = SpeculativeStats.zeros(3, 4)
    clock.step(stats, [0, 1, 2], [4, 3, 0], [4, 1, 0], drafted=[SUFFIX, HEAD, PLAIN], draft=0.5, verify=2.5)
    clock.step(stats, [0, 1], [2, 0], [2, 0], drafted=[SUFFIX, PLAIN], draft=0.0, verify=2.0)
    assert stats.rounds_by_source.tolist() == [2, 1, 2]  # plain, head, suffix row-rounds
    assert stats.drafted_by_source.tolist() == [0, 3, 6] and stats.accepted_by_source.tolist() == [0, 1, 6]
    assert stats.seconds_by_source.tolist() == [2.0, 1.0, 2.0]  # each step's time shared by its rows
    assert stats.num_plain_steps.tolist() == [0, 1, 1]
    assert (stats.draft_seconds, stats.verify_seconds, stats.plain_seconds) == (0.5, 4.5, 0.0)
    assert stats.per_source_lines() == [
        "head: 1 row-rounds, 1 of 3 drafts accepted, 2.00 tokens per row-round, 2.0 tokens/s",
        "suffix: 2 row-rounds, 6 of 6 drafts accepted, 4.00 tokens per row-round, 4.0 tokens/s",
        "plain: 2 row-rounds, 1.00 tokens per row-round, 1.0 tokens/s",
    ]
