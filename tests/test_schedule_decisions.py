"""What each schedule decides, one row at a time: never from later slots, and by hand where it is only speed.

Losslessness: the confidence of slot ``j`` reads the draft ``d_{j-1}``, so whether slot ``j`` is
verified must be a function of the confidences of slots ``<= j`` (and the past) only. Under
Hypothesis, every schedule (fixed, threshold, Algorithm 1 and the adaptive default after a drawn
history of rounds) is given two confidence vectors of one row that agree on slots ``0..j`` and
differ freely after ``j``; ``min(length, j + 1)``, i.e. whether each of slots ``0..j`` is verified,
must come out the same. Cost tables are drawn too, including the CPU-like shape (a steep first
draft, then nearly flat) on which the adaptive lookahead admits a block that no single slot pays
for: that is where a search that skipped a non-paying slot and went on would let a later slot's
confidence decide whether the earlier ones are verified. The consequence of such a bug on the
output law is checked too, by a chi-square test on the paper's Appendix A construction, replayed
after a history in which that search would go wrong.

Speed: what the adaptive schedule decides does not change the output distribution, so nothing
else pins it; here its arithmetic is checked against decisions computed by hand on small tables:
later slots are projected with *their own* past acceptance, confidences corrected above 1 are
clamped to 1, and a round costs a forward over its drafts *and* its anchor.
"""

from collections.abc import Callable

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from scipy.stats import chisquare

from spark_generate import AdaptiveSchedule, ConfidenceThreshold, CostTable, FixedLength, GoodputSchedule
from spark_generate.drafting import NO_CONFIDENCE
from spark_generate.kernels import RandomStream, rejection_sample
from spark_generate.sampling import sample
from spark_generate.schedule import AdaptiveRun, lookahead_lengths
from spark_generate.telemetry import DraftSource

NUM_SLOTS = 4
HEAD, SUFFIX, PLAIN = int(DraftSource.HEAD), int(DraftSource.SUFFIX), int(DraftSource.PLAIN)
# Confidences, the extremes drawn often: a head sure of a slot, or sure it fails, is where plans change most.
confidence = st.sampled_from([0.01, 0.99]) | st.floats(0.01, 0.99)


@st.composite
def cost_tables(draw) -> CostTable:
    """Positive costs at increasing token counts, or the CPU shape: a steep first draft, then nearly flat."""
    if draw(st.booleans()):
        step = draw(st.floats(0.3, 1.5))
        return CostTable((1, 2, 12), (1.0, 1.0 + step, 1.1 + step), draft_seconds=draw(st.floats(0.0, 0.5)))
    num_points = draw(st.integers(1, 5))
    points = sorted(draw(st.sets(st.integers(1, 12), min_size=num_points, max_size=num_points)))
    seconds = draw(st.lists(st.floats(0.1, 5.0), min_size=num_points, max_size=num_points))
    return CostTable(tuple(points), tuple(seconds), draft_seconds=draw(st.floats(0.0, 1.0)))


@st.composite
def histories(draw) -> list[tuple[list[float], int, int]]:
    """Past drafted rounds of one row, each repeated a few times: (confidences, drafts verified, tokens emitted)."""
    rounds = []
    for _ in range(draw(st.integers(0, 3))):
        verified = draw(st.integers(0, NUM_SLOTS))
        past = draw(st.lists(confidence, min_size=NUM_SLOTS, max_size=NUM_SLOTS))
        rounds += [(past, verified, draw(st.integers(1, verified + 1)))] * draw(st.integers(1, 6))
    return rounds


def logits_of(confidences: list[float]) -> torch.Tensor:
    """``[1, S]`` confidence logits of one row."""
    return torch.logit(torch.tensor([confidences], dtype=torch.float64)).float()


def adaptive_after(table: CostTable, history, num_slots: int = NUM_SLOTS, temperatures=None) -> AdaptiveRun:
    """An adaptive run of one row that has planned, verified and recorded the rounds of ``history``."""
    run = AdaptiveSchedule(table, temperatures=temperatures).start(table, num_slots)
    for past, verified, emitted in history:
        run.lengths(logits_of(past[:num_slots]), 1, num_slots)
        run.record(torch.tensor([verified]), torch.tensor([emitted]), torch.tensor([True]))
    return run


def one_row_lengths(
    name: str, table: CostTable, history, temperatures: torch.Tensor | None, threshold: float
) -> Callable[[list[float]], int]:
    """A function from one row's confidences to its verify length, for the schedule ``name``.

    The adaptive schedule first goes through the rounds of ``history``; the fixed length is the
    threshold's share of the block.
    """
    if name == "adaptive":
        run = adaptive_after(table, history, temperatures=temperatures)
        return lambda confidences: int(run.lengths(logits_of(confidences), 1, NUM_SLOTS)[0])
    schedule = {
        "fixed": FixedLength(int(threshold * (NUM_SLOTS + 1))),
        "threshold": ConfidenceThreshold(threshold, temperatures),
        "goodput": GoodputSchedule(table, temperatures),
    }[name]
    return lambda confidences: int(schedule(logits_of(confidences), 1, NUM_SLOTS)[0])


# Slot 1 was reached and rejected three times where the head said 0.01: its acceptance is 1/5, its
# correction near 1, so a confident slot 1 is valued at once and the slots after it at the prior 1/2.
REJECTED_SLOT_1 = [([0.99, 0.01, 0.01, 0.01], 2, 2)] * 3
CPU_COSTS = CostTable((1, 2, 12), (1.0, 2.0, 2.1), draft_seconds=0.2)


@pytest.mark.parametrize("name", ["adaptive", "goodput", "threshold", "fixed"])
@given(
    table=cost_tables(),
    history=histories(),
    confidences=st.lists(confidence, min_size=NUM_SLOTS, max_size=NUM_SLOTS),
    later=st.lists(confidence, min_size=NUM_SLOTS, max_size=NUM_SLOTS),
    temperatures=st.none() | st.lists(st.floats(0.25, 4.0), min_size=NUM_SLOTS, max_size=NUM_SLOTS),
    threshold=st.floats(0.0, 0.99),
)
@example(  # no slot pays alone; a lookahead going on past slot 0 admitted slots 0-3 when slot 1 was confident
    table=CPU_COSTS, history=REJECTED_SLOT_1, confidences=[0.602, 0.487, 0.838, 0.19], later=[0.5] * NUM_SLOTS,
    temperatures=None, threshold=0.5,
)  # fmt: skip
def test_whether_a_slot_is_verified_never_depends_on_later_slots(
    name, table, history, confidences, later, temperatures, threshold
):
    """For every slot j, confidences equal on slots 0..j give the same ``min(length, j + 1)``.

    The later slots are replaced by drawn values, and by the most and least confident ones.
    """
    lengths = one_row_lengths(name, table, history, temperatures and torch.tensor(temperatures), threshold)
    length = lengths(confidences)
    for slot in range(NUM_SLOTS):
        for replacement in (later, [0.99] * NUM_SLOTS, [0.01] * NUM_SLOTS):
            changed = confidences[: slot + 1] + replacement[slot + 1 :]
            assert min(length, slot + 1) == min(lengths(changed), slot + 1), (slot, confidences, changed)


def test_a_later_slot_confident_only_after_one_draft_leaves_the_first_token_exact():
    """Appendix A after a history: the output law of the first token stays the target's (0.7, 0.3).

    Three slots of two tokens, drafts uniform; ``c_0 = 0.75``, ``c_1 = 0.99`` when ``d_0 = 0`` and
    0.01 otherwise, ``c_2 = 0.99``; the run remembers slot 1 rejected three times at confidence
    0.01. Verifying nothing is best whatever ``d_0`` is. A lookahead that went on past slot 0 would
    verify the block exactly when ``d_0 = 0`` (always accepted: ``p / q = 1.4``), so token 0 would
    come out with probability ``0.5 + 0.5 * 0.7 = 0.85``.
    """
    num_rows, table = 20_000, CostTable((1, 2, 12), (1.0, 2.0, 2.1))
    run = adaptive_after(table, REJECTED_SLOT_1, num_slots=3)
    length_after = {
        first: int(run.lengths(logits_of([0.75, c_1, 0.99]), 1, 3)[0]) for first, c_1 in [(0, 0.99), (1, 0.01)]
    }
    seeds = torch.arange(num_rows, dtype=torch.int64)
    draft_probs = torch.full((num_rows, 3, 2), 0.5)
    drafts = torch.stack(
        [sample(draft_probs[:, slot], seed=seeds, positions=1 + slot, stream=RandomStream.DRAFT) for slot in range(3)],
        dim=1,
    )
    num_verified = torch.where(drafts[:, 0] == 0, length_after[0], length_after[1])
    target_probs = torch.tensor([[0.7, 0.3]] + [[0.5, 0.5]] * 3).expand(num_rows, -1, -1).contiguous()
    output, _ = rejection_sample(target_probs, draft_probs, drafts, num_verified, seed=seeds, positions=1)
    counts = torch.bincount(output[:, 0], minlength=2).double()
    assert chisquare(counts.numpy(), [0.7 * num_rows, 0.3 * num_rows]).pvalue > 1e-4, (counts, length_after)


# ----------------------------------------------------------------------------- speed: decisions by hand


def test_the_lookahead_projects_each_later_slot_with_its_own_acceptance():
    """One row, survivals (0.7, 0.49), past acceptance 0.1 at slot 0 and 0.9 at slot 1; SPS(n) = 1 / cost.

    Costs 1, 2 and 2.05 for 1, 2 and 3 tokens. Stopping: 1 token per 1. Slot 0 alone: 1.7 / 2 = 0.85;
    with slot 1 projected at its own acceptance 0.9: (1.7 + 0.7 * 0.9) / 2.05 = 1.137 > 1, so slot 0
    is admitted (at slot 0's 0.1 it would be 1.77 / 2.05 = 0.863: nothing verified). Then slot 1 on
    its survival: 2.19 / 2.05 = 1.068 > 0.85: both are verified.
    """
    table = CostTable((1, 2, 3), (1.0, 2.0, 2.05))
    assert lookahead_lengths(torch.tensor([[0.7, 0.49]]), torch.tensor([0.1, 0.9]), table).tolist() == [2]


def test_corrected_confidences_are_clamped_to_one():
    """A head that said 0.5 for a first slot accepted in all 4 rounds is corrected by (4 + 1) / (2 + 1) = 5/3.

    Its next 0.9 becomes 1.5, clamped to 1: one sure draft yields 2 tokens for a forward costing 2.25
    single steps, 0.89 per step against plain decoding's 1, so nothing is verified (a survival of 1.5
    would claim 2.5 / 2.25 = 1.11 and verify it).
    """
    table = CostTable((1, 2), (1.0, 2.25))
    run = adaptive_after(table, [([0.5], 1, 2)] * 4, num_slots=1)
    assert run.head.accepted_by_slot.tolist() == [4] and run.head.confidence_by_slot.tolist() == [2.0]
    assert run.lengths(logits_of([0.9]), 1, 1).tolist() == [0]


def test_a_round_costs_a_forward_over_its_drafts_and_its_anchor():
    """One row verified one draft and emitted 2 tokens; drafting costs 0.2, a forward 1 over one token, 1.9 over two.

    The round cost 0.2 + 1.9 = 2.1 plain steps for 2 tokens: a gain of 0.95 < 1, so the next round
    steps aside (costed without the anchor, 1.2 steps, it would have seemed to pay 1.67).
    """
    table = CostTable((1, 2), (1.0, 1.9), draft_seconds=0.2)
    run = AdaptiveSchedule(table).start(table, 4)
    run.record(torch.tensor([1]), torch.tensor([2]), torch.tensor([True]))
    assert run.cost == pytest.approx(2.1) and run.gain == pytest.approx(2 / 2.1)
    assert not run.should_draft()


def suffix_logits(rows: list[list[float] | None], num_slots: int = 2) -> torch.Tensor:
    """``[R, L]`` suffix confidence logits: a row's per-slot confidences, or None for a row without a match."""
    unmatched = torch.full((num_slots,), NO_CONFIDENCE)
    return torch.stack([unmatched if row is None else torch.logit(torch.tensor(row)) for row in rows])


def test_one_rows_suffix_draft_is_taken_alone_and_left_when_the_batch_would_pay_for_its_width():
    """The forward is a padded block: a wide round pays off for one row, but not for four where three only wait.

    One or two verified drafts cost 1.5 plain steps for any number of rows here. The suffix draft
    of the first row (two slots it is all but sure of, no record yet) is worth about 3 tokens:
    alone, 3 / 1.5 = 2 > 1, so it drafts; beside three rows without a match, (3 + 1 + 1 + 1) / 4 /
    1.5 < 1 does not beat plain steps, so every row steps plain; with three matches it drafts again,
    and the row without one steps plain.
    """
    table = CostTable((1, 2, 3, 4, 8, 12), (1.0, 1.5, 1.5, 1.0, 1.5, 1.5))
    alone = AdaptiveSchedule(table).start(table, 2).sources(suffix_logits([[0.999, 0.999]]), 1, head_slots=0)
    assert alone.tolist() == [SUFFIX]
    batch = suffix_logits([[0.999, 0.999], None, None, None])
    assert AdaptiveSchedule(table).start(table, 2).sources(batch, 4, head_slots=0).tolist() == [PLAIN] * 4
    sure = suffix_logits([[0.999, 0.999]] * 3 + [None])  # (3 * 3 + 1) / 4 / 1.5 > 1
    assert AdaptiveSchedule(table).start(table, 2).sources(sure, 4, head_slots=0).tolist() == [SUFFIX] * 3 + [PLAIN]


def test_a_suffix_draft_that_pays_over_a_short_context_is_left_over_a_long_one():
    """The round's costs are the table's at the batch's context: attention makes wide rounds dearer there.

    Measured at 64 cached tokens a row, two drafts cost 1.5 plain steps, so a sure two-slot draft
    (about 3 tokens) pays; 1,000 tokens later a plain step costs 2 and the wide round 6, and it no
    longer does. The lengths and the running cost the round is judged by read the same costs.
    """
    slopes = (0.001, 0.0045, 0.0045)  # seconds per cached token
    table = CostTable((1, 2, 3), (1.0, 1.5, 1.5), context_length=64, verify_seconds_per_context=slopes)
    sure = suffix_logits([[0.999, 0.999]])
    run = AdaptiveSchedule(table).start(table, 2)
    assert run.sources(sure, 1, head_slots=0, context_length=64).tolist() == [SUFFIX]
    assert run.sources(sure, 1, head_slots=0, context_length=1064).tolist() == [PLAIN]
    assert run.round_costs == table.at_context(1064)
    assert run.sources(sure, 1, head_slots=0).tolist() == [SUFFIX]  # no context given: the table as measured


def test_the_head_runs_only_where_its_record_says_a_round_pays_and_a_declined_turn_backs_off():
    """The head's turn is judged by its per-slot acceptance so far (1/2 before any evidence), drafting included.

    Drafting costs 0.6 of a forward and each draft 0.1 more: before evidence, one draft is worth
    1.5 / 1.7 < 1, two 1.75 / 1.8 < 1 and three 1.875 / 1.9 < 1, so on this table the head is not
    expected to pay. A prior is no evidence: its first turn probes. After it, its turns are
    declined as probes that did not pay (1, then 2 plain rounds after them) until it has not
    drafted for ``max_backoff=4`` rounds, when it drafts anyway (or once the rounds without it
    have paid for a probe at ``probe_budget`` per round). With a cheaper pass (0.2) it drafts at
    once, not as a probe; after rounds that accepted nothing, it no longer pays.
    """
    dear = CostTable((1, 2, 3, 4), (1.0, 1.1, 1.2, 1.3), draft_seconds=0.6)
    run = AdaptiveSchedule(dear, max_backoff=4).start(dear, 3)
    assert run.sources(None, 1, head_slots=3).tolist() == [HEAD] and run.probing
    turns = [int(run.sources(None, 1, head_slots=3)[0]) for _ in range(6)]
    assert turns == [PLAIN, PLAIN, PLAIN, PLAIN, PLAIN, HEAD] and run.rounds_without_head == 0
    # With a probe budget of a tenth of a plain step per round, the 0.7-step probe (the 0.6-step pass and
    # 0.1 for the wider forward) is paid for after 7 rounds without the head: the first turn after them
    # (declined turns back off 1, 2, 4 rounds).
    run = AdaptiveSchedule(dear, probe_budget=0.1).start(dear, 3)
    turns = [int(run.sources(None, 1, head_slots=3)[0]) for _ in range(12)]
    assert turns == [HEAD] + [PLAIN] * 10 + [HEAD]
    cheap = CostTable((1, 2, 3, 4), (1.0, 1.1, 1.2, 1.3), draft_seconds=0.2)
    run = AdaptiveSchedule(cheap).start(cheap, 3)
    assert run.sources(None, 1, head_slots=3).tolist() == [HEAD] and not run.probing
    for _ in range(4):  # four rounds whose first draft was rejected: acceptance (0 + 1) / (4 + 2) at slot 1
        run.head.record(torch.tensor([3]), torch.tensor([0]), None)
    assert run.sources(None, 1, head_slots=3).tolist() == [PLAIN] and run.plain_steps_left == 1


def test_a_probe_is_paid_for_with_its_wider_forward_not_only_its_drafting_pass():
    """A probe costs its drafting pass and a forward over one draft more per row: both are paid for first.

    Drafting costs 0.1 of a forward and the first draft 0.6 more: before evidence the head's best
    round is worth 1.75 / 1.9 < 1. With a probe budget of a tenth of a plain step per round, the
    0.7-step probe is paid for after 7 rounds without the head (after the first turn's probe, the
    first turn after them is the eleventh round: declined turns back off 1, 2, 4 rounds); counting
    the 0.1-step pass alone, it would probe at the third.
    """
    wide = CostTable((1, 2, 3, 4), (1.0, 1.6, 1.8, 2.0), draft_seconds=0.1)
    run = AdaptiveSchedule(wide, probe_budget=0.1).start(wide, 3)
    turns = [int(run.sources(None, 1, head_slots=3)[0]) for _ in range(12)]
    assert turns == [HEAD] + [PLAIN] * 10 + [HEAD]
    rows = CostTable((2, 4, 6, 8), (1.0, 1.6, 1.8, 2.0), draft_seconds=0.1)  # two rows: the forward over 4 tokens
    run = AdaptiveSchedule(rows, probe_budget=0.1).start(rows, 3)
    assert [int(run.sources(None, 2, head_slots=3)[0]) for _ in range(12)] == [HEAD] + [PLAIN] * 10 + [HEAD]


def test_a_probe_verifies_a_draft_even_where_its_confidences_would_verify_none():
    """A probing round is there to learn how the head drafts now: it verifies at least one draft per row.

    On the table of the test above the head's first turn probes: its confidences (0.01 a slot)
    would have it verify nothing, yet the probe verifies slot 1. A round where the head drafts
    because its record says it pays keeps the lookahead's plan (here: nothing).
    """
    dear = CostTable((1, 2, 3, 4), (1.0, 1.1, 1.2, 1.3), draft_seconds=0.6)
    run = AdaptiveSchedule(dear, max_backoff=4).start(dear, 3)
    assert run.sources(None, 1, head_slots=3).tolist() == [HEAD] and run.probing
    unsure = torch.logit(torch.full((1, 3), 0.01))
    assert run.lengths(unsure, 1, 3).tolist() == [1]
    cheap = CostTable((1, 2, 3, 4), (1.0, 1.1, 1.2, 1.3), draft_seconds=0.0)
    run = AdaptiveSchedule(cheap).start(cheap, 3)
    assert run.sources(None, 1, head_slots=3).tolist() == [HEAD] and not run.probing
    assert run.lengths(unsure, 1, 3).tolist() == [0]


def test_a_head_round_and_a_suffix_draft_share_a_batch_where_each_row_expects_more_from_its_own():
    """With the head drafting, a row takes the suffix draft only where it is worth more than the head's."""
    table = CostTable((1, 2, 4, 8), (1.0, 1.0, 1.0, 1.0), draft_seconds=0.1)
    run = AdaptiveSchedule(table).start(table, 3)
    logits = suffix_logits([[0.999, 0.999, 0.999], [0.2, 0.2, 0.2]], num_slots=3)
    assert run.sources(logits, 2, head_slots=3).tolist() == [SUFFIX, HEAD]
