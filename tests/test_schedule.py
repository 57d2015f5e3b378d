"""Confidence scheduling: the three schedules, the cost table, and why Algorithm 1 must stop early.

The key property: whether slot ``j`` of a row is verified may depend on the confidences of slots
``<= j`` (which read drafts ``< j``) but never on those after ``j`` (which read ``d_j``). It is
checked directly under Hypothesis, and through its consequence on the paper's Appendix A
counterexample: a retrospective global search over verify lengths turns a target distribution
(0.7, 0.3) into (0.85, 0.15), while Algorithm 1 with its early stop stays exact.
"""

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import chisquare
from test_config import fake_load
from test_generation import ARCHITECTURES, OracleDrafter, prompts, tiny_head, tiny_target

from spark_generate import (
    AdaptiveSchedule,
    ConfidenceThreshold,
    CostTable,
    FixedLength,
    GoodputSchedule,
    decode,
    profile_costs,
    profiling,
)
from spark_generate.kernels import RandomStream, rejection_sample
from spark_generate.profiling import cost_table_for
from spark_generate.sampling import sample
from spark_generate.schedule import load_calibration, lookahead_lengths


def logits_of(confidences: list[list[float]]) -> torch.Tensor:
    return torch.logit(torch.tensor(confidences, dtype=torch.float64)).float()


def test_fixed_length_and_threshold():
    confidence_logits = logits_of([[0.9, 0.4, 0.9], [0.6, 0.7, 0.8], [0.3, 0.9, 0.9]])
    assert FixedLength()(confidence_logits, 3, 3).tolist() == [3, 3, 3]
    assert FixedLength(2)(None, 3, 3).tolist() == [2, 2, 2]
    assert ConfidenceThreshold(0.5)(confidence_logits, 3, 3).tolist() == [1, 3, 0]
    assert ConfidenceThreshold(0.0)(confidence_logits, 3, 3).tolist() == [3, 3, 3]
    temperatures = torch.tensor([1.0, 1.0, 100.0])  # a hot last slot: sigmoid(z / 100) ~ 0.5
    assert ConfidenceThreshold(0.51, temperatures)(confidence_logits, 3, 3).tolist() == [1, 2, 0]
    with pytest.raises(ValueError, match="no confidence head"):
        ConfidenceThreshold(0.5)(None, 3, 3)


def test_goodput_admits_by_survival_until_goodput_drops():
    # SPS(n) = 1 / (2 + n): a fixed cost per round, then one unit per verified token.
    table = CostTable(num_tokens=(1, 8), verify_seconds=(1.0, 8.0), draft_seconds=2.0)
    confidence_logits = logits_of([[0.99, 0.99, 0.2], [0.5, 0.9, 0.9]])
    # survivals: row 0: .99 .98 .196; row 1: .5 .45 .405. Start: goodput 2 / 4 = .5; admit .99
    # (2.99 / 5 = .598) and .98 (3.97 / 6 = .662); .5 would give 4.47 / 7 = .639: stop there.
    assert GoodputSchedule(table)(confidence_logits, 2, 3).tolist() == [2, 0]
    free = CostTable(num_tokens=(1,), verify_seconds=(1.0,))  # verification costs nothing extra
    assert GoodputSchedule(free)(confidence_logits, 2, 3).tolist() == [3, 3]


@given(
    confidences=st.lists(st.lists(st.floats(0.01, 0.99), min_size=4, max_size=4), min_size=1, max_size=4),
    seconds=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=6),
    replacement=st.floats(0.01, 0.99),
    data=st.data(),
)
def test_goodput_decision_for_a_slot_ignores_later_slots(confidences, seconds, replacement, data):
    """Changing the confidences after slot j (they read d_j) never changes whether j is verified."""
    table = CostTable(num_tokens=tuple(range(1, len(seconds) + 1)), verify_seconds=tuple(seconds))
    schedule = GoodputSchedule(table)
    original = schedule(logits_of(confidences), len(confidences), 4)
    row = data.draw(st.integers(0, len(confidences) - 1))
    slot = data.draw(st.integers(0, 3))
    changed = [list(c) for c in confidences]
    changed[row][slot + 1 :] = [replacement] * (3 - slot)
    after = schedule(logits_of(changed), len(confidences), 4)
    assert (original[row] > slot) == (after[row] > slot)


def retrospective_schedule(confidence_logits: torch.Tensor, table: CostTable) -> torch.Tensor:
    """The biased alternative: the verify length maximising goodput over *all* prefixes (one row)."""
    survival = torch.sigmoid(confidence_logits[0]).cumprod(0).tolist()
    goodputs = [(1 + sum(survival[:n])) * table.steps_per_second(1 + n) for n in range(len(survival) + 1)]
    return torch.tensor([max(range(len(goodputs)), key=goodputs.__getitem__)])


@pytest.mark.parametrize("schedule_name", ["algorithm1", "adaptive", "retrospective"])
def test_appendix_a_counterexample(schedule_name):
    """Target (0.7, 0.3) at the first slot; drafts uniform; c_2 = 1 iff d_1 = token 0, else 0.

    Verifying one draft is not worth its cost (SPS(2) = SPS(3) = 0.6 < 1 / 1.5), two are, when
    c_2 = 1. A retrospective search verifies d_1 exactly when d_1 = 0, so token 0 comes out with
    probability 0.5 · 1 + 0.5 · 0.7 = 0.85.
    """
    num_rows = 20_000
    table = CostTable(num_tokens=(1, 2, 3), verify_seconds=(1.0, 1 / 0.6, 1 / 0.6))
    target_probs = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.5, 0.5]]).expand(num_rows, -1, -1).contiguous()
    draft_probs = torch.full((num_rows, 2, 2), 0.5)
    seeds = torch.arange(num_rows, dtype=torch.int64)
    drafts = torch.stack(
        [sample(draft_probs[:, slot], seed=seeds, positions=1 + slot, stream=RandomStream.DRAFT) for slot in range(2)],
        dim=1,
    )
    confidence_logits = torch.stack([torch.zeros(num_rows), torch.where(drafts[:, 0] == 0, 30.0, -30.0)], dim=1)
    if schedule_name == "algorithm1":
        num_verified = GoodputSchedule(table)(confidence_logits, num_rows, 2)
    elif schedule_name == "adaptive":
        num_verified = AdaptiveSchedule(table).start(table, 2).lengths(confidence_logits, num_rows, 2)
    else:
        num_verified = torch.cat([retrospective_schedule(row[None], table) for row in confidence_logits])
    output, _ = rejection_sample(target_probs, draft_probs, drafts, num_verified, seed=seeds, positions=1)
    counts = torch.bincount(output[:, 0], minlength=2).double()
    p_value = chisquare(counts.numpy(), (torch.tensor([0.7, 0.3]) * num_rows).numpy()).pvalue
    if schedule_name != "retrospective":
        assert p_value > 1e-4, counts
    else:
        assert p_value < 1e-12 and abs(float(counts[0]) / num_rows - 0.85) < 0.02, counts


def test_cost_table_interpolates_and_round_trips(tmp_path):
    table = CostTable(num_tokens=(1, 3), verify_seconds=(1.0, 3.0), draft_seconds=1.0)
    assert table.steps_per_second(2) == pytest.approx(1 / 3)
    assert table.steps_per_second(0) == pytest.approx(1 / 2) and table.steps_per_second(9) == pytest.approx(1 / 4)
    table.save(tmp_path / "costs.json")
    assert CostTable.load(tmp_path / "costs.json") == table


def test_a_cost_table_grows_with_the_context_beyond_the_one_it_was_measured_at(tmp_path):
    """Each count's cost rises by its own slope per cached token past the measured context; never below it."""
    table = CostTable((1, 8), (1.0, 2.0), draft_seconds=0.5, context_length=64,
                      verify_seconds_per_context=(0.001, 0.004), draft_seconds_per_context=0.0005)  # fmt: skip
    longer = table.at_context(564)
    assert longer.verify_seconds == pytest.approx((1.5, 4.0)) and longer.draft_seconds == pytest.approx(0.75)
    assert longer.verify_cost(8) / longer.verify_cost(1) > table.verify_cost(8) / table.verify_cost(1)
    assert longer.at_context(1064) == table.at_context(1064)  # read from any context, the same costs
    assert table.at_context(10) is table and table.at_context(64) is table
    flat = CostTable((1, 8), (1.0, 2.0))  # measured at one context: the same everywhere
    assert flat.at_context(10_000) is flat
    table.save(tmp_path / "costs.json")
    assert CostTable.load(tmp_path / "costs.json") == table
    (tmp_path / "old.json").write_text(json.dumps({"num_tokens": [1, 8], "verify_seconds": [1.0, 2.0]}))
    assert CostTable.load(tmp_path / "old.json") == flat  # tables written before the context was kept


def test_profile_costs_writes_a_table(tmp_path):
    target = tiny_target("llama", num_layers=2)
    head = tiny_head(target, block_size=3)
    table = profile_costs(target, head, batch_size=2, context_length=8, repeats=1, path=tmp_path / "costs.json")
    # Two rows of 1..4 tokens, and one row of 1..4 (the small batches left when rows finish).
    assert table.num_tokens == (1, 2, 3, 4, 6, 8)
    assert all(seconds > 0 for seconds in table.verify_seconds) and table.draft_seconds > 0
    assert json.loads((tmp_path / "costs.json").read_text())["num_tokens"] == [1, 2, 3, 4, 6, 8]
    # Measured again after a long prompt: how each cost grows with the context (never shrinks).
    slopes = table.verify_seconds_per_context
    assert table.context_length == 8 and len(slopes) == len(table.num_tokens)
    assert all(slope >= 0 for slope in slopes) and list(slopes) == sorted(slopes)
    assert table.draft_seconds_per_context >= 0
    short = profile_costs(target, head, batch_size=2, context_length=8, long_context_length=None, repeats=1)
    assert short.verify_seconds_per_context == () and short.at_context(4096) is short
    with pytest.raises(ValueError, match="must exceed context_length=8"):
        profile_costs(target, head, batch_size=2, context_length=8, long_context_length=8, repeats=1)
    target.config.max_position_embeddings = 12  # a short-context model: measured at one length only
    assert profile_costs(target, head, batch_size=2, context_length=8, repeats=1).verify_seconds_per_context == ()


def test_profile_costs_measures_blocks_wider_than_its_context():
    """A suffix drafter's blocks may be longer than the profiling prompt (20 drafts after an 8-token context)."""
    target = tiny_target("llama", num_layers=2)
    table = profile_costs(target, None, batch_size=1, context_length=8, repeats=1, num_drafts=20)
    assert table.num_tokens == tuple(range(1, 22)) and table.draft_seconds == 0.0


def test_load_calibration(tmp_path):
    (tmp_path / "sts.json").write_text(json.dumps({"temperatures": [1.0, 1.5, 2.0]}))
    assert load_calibration(tmp_path / "sts.json").tolist() == [1.0, 1.5, 2.0]
    (tmp_path / "bad.json").write_text(json.dumps({"temperatures": [1.0, -1.0]}))
    with pytest.raises(ValueError, match="positive"):
        load_calibration(tmp_path / "bad.json")


def test_schedules_drive_generation_and_stay_exact(tmp_path):
    """A measured cost table and a threshold, end to end: greedy output unchanged, fewer drafts verified."""
    target = tiny_target("llama", num_layers=2)
    head = tiny_head(target, block_size=4, enable_confidence_head=True)
    input_ids = torch.randint(2, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    plain = target.generate(input_ids, do_sample=False, max_new_tokens=12)
    table = profile_costs(target, head, batch_size=2, context_length=8, repeats=1, path=tmp_path / "costs.json")
    drafted = {}
    for name, schedule in {
        "fixed": FixedLength(),
        "threshold": ConfidenceThreshold(0.999),
        "goodput": GoodputSchedule(CostTable.load(tmp_path / "costs.json")),
    }.items():
        out = target.generate(
            input_ids, do_sample=False, max_new_tokens=12, custom_generate=decode, dspark_head=head,
            dspark_schedule=schedule, return_dict_in_generate=True,
        )  # fmt: skip
        assert torch.equal(out.sequences, plain), name
        drafted[name] = int(out.dspark_stats.num_drafted.sum())
    assert drafted["threshold"] < drafted["fixed"] and table.num_tokens[0] == 1


# ------------------------------------------------------------------------ the adaptive default


def test_adaptive_switch_steps_aside_and_probes_with_growing_backoff():
    """Rounds that do not pay (gain < 1) are followed by 1, 2, 4, 4 plain steps; one that pays resets."""
    table = CostTable(num_tokens=(1, 8), verify_seconds=(1.0, 1.0), draft_seconds=1.0)  # a round costs 2 steps
    run = AdaptiveSchedule(table, smoothing=1.0, max_backoff=4).start(table, 3)
    plain_steps = []
    for emitted in [1, 1, 1, 1, 3, 1]:  # tokens emitted by each drafted round of one row
        assert run.should_draft()
        run.record(torch.tensor([3]), torch.tensor([emitted]), torch.tensor([True]))
        skipped = 0
        while not run.should_draft():
            skipped += 1
        plain_steps.append(skipped)
    assert plain_steps == [1, 2, 4, 4, 0, 1]


def test_lookahead_sees_past_a_first_draft_that_costs_most():
    """A CPU-like table: the first draft nearly doubles the forward, later ones are almost free.

    With confidences 0.7, no single draft pays (Algorithm 1 stops at once: 1.7 / 2.1 < 1 / 1.2),
    three do (2.53 / 2.13); the lookahead admits them, and stops where the survivals of the
    admitted slots say the next one no longer pays.
    """
    table = CostTable(num_tokens=(1, 2, 8), verify_seconds=(1.0, 1.9, 2.0), draft_seconds=0.2)
    acceptance = torch.full((3,), 0.7)
    assert GoodputSchedule(table)(logits_of([[0.7] * 3]), 1, 3).tolist() == [0]
    assert lookahead_lengths(torch.tensor([[0.7, 0.49, 0.343]]), acceptance, table).tolist() == [3]
    assert lookahead_lengths(torch.tensor([[0.14, 0.098, 0.069]]), acceptance, table).tolist() == [0]
    # Slot 1 is admitted on the projected later slots; once paid for, slot 2 is nearly free, slot 3 is not.
    assert lookahead_lengths(torch.tensor([[0.7, 0.02, 0.01]]), acceptance, table).tolist() == [2]
    two_rows = CostTable(num_tokens=(2, 4, 16), verify_seconds=(1.0, 1.9, 2.0), draft_seconds=0.2)
    survival = torch.tensor([[0.7, 0.49, 0.343], [0.1, 0.01, 0.001]])
    assert lookahead_lengths(survival, acceptance, two_rows).tolist() == [3, 3]  # a padded block: rows alike


def test_adaptive_acceptance_is_per_slot_when_reached():
    """Slot j counts as reached when verified with every earlier slot accepted."""
    table = CostTable(num_tokens=(1, 8), verify_seconds=(1.0, 1.0))
    run = AdaptiveSchedule(table).start(table, 3)
    run.record(torch.tensor([3, 3, 1, 0, 3]), torch.tensor([4, 2, 2, 1, 4]), torch.tensor([True] * 4 + [False]))
    assert run.head.reached_by_slot.tolist() == [3, 2, 1] and run.head.accepted_by_slot.tolist() == [3, 1, 1]
    assert torch.allclose(run.head.acceptance, torch.tensor([4 / 5, 2 / 4, 2 / 3]))


def test_adaptive_corrects_the_confidences_by_past_acceptance():
    """A head that says 0.9 where only half the reached drafts are accepted is scaled down, per slot."""
    table = CostTable(num_tokens=(1, 8), verify_seconds=(1.0, 1.0))
    run = AdaptiveSchedule(table).start(table, 2)
    for accepted in [0, 1] * 20:  # slot 1 always reached, accepted every other round; slot 2 always rejected
        run.lengths(logits_of([[0.9, 0.9]]), 1, 2)
        run.record(torch.tensor([2]), torch.tensor([1 + accepted]), torch.tensor([True]))
    assert run.head.reached_by_slot.tolist() == [40, 20] and run.head.accepted_by_slot.tolist() == [20, 0]
    assert torch.allclose(run.head.confidence_by_slot, torch.tensor([36.0, 18.0]))
    correction = (run.head.accepted_by_slot + 1) / (run.head.confidence_by_slot + 1)
    assert torch.allclose(correction, torch.tensor([21 / 37, 1 / 19]))


@given(
    confidences=st.lists(st.lists(st.floats(0.01, 0.99), min_size=4, max_size=4), min_size=1, max_size=4),
    history=st.lists(st.integers(1, 5), max_size=6),
    replacement=st.floats(0.01, 0.99),
    data=st.data(),
)
def test_adaptive_decisions_never_read_the_drafts_they_decide_on(confidences, history, replacement, data):
    """Whether a round drafts depends only on past rounds; whether slot j is verified ignores slots > j."""
    table = CostTable(num_tokens=(1, 4, 16), verify_seconds=(1.0, 1.3, 2.5), draft_seconds=0.2)
    run = AdaptiveSchedule(table).start(table, 4)
    for emitted in history:  # past rounds of one row, all 4 drafts verified
        run.record(torch.tensor([4]), torch.tensor([emitted]), torch.tensor([True]))
    original = run.lengths(logits_of(confidences), len(confidences), 4)
    row = data.draw(st.integers(0, len(confidences) - 1))
    slot = data.draw(st.integers(0, 3))
    changed = [list(c) for c in confidences]
    changed[row][slot + 1 :] = [replacement] * (3 - slot)
    after = run.lengths(logits_of(changed), len(confidences), 4)
    assert (original[row] > slot) == (after[row] > slot)
    # Without a confidence head, lengths come from past acceptance alone: the same for every row.
    assert len(set(run.lengths(None, 3, 4).tolist())) == 1


class PhasedOracle(OracleDrafter):
    """Right for two rounds, then wrong for seven (long enough to pull the running gain below 1), then right."""

    def __init__(self, head, reference):
        super().__init__(head, reference)
        self.round = 0

    def draft(self, request):
        block = super().draft(request)
        self.round += 1
        if 3 <= self.round < 10:
            return replace(block, token_ids=(block.token_ids + 1) % 128)
        return block


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_adaptive_default_with_plain_steps_is_exact(architecture):
    """Greedy output equals plain greedy while the schedule drafts, steps aside and probes again."""
    target = tiny_target(architecture)
    head = tiny_head(target, block_size=4, enable_confidence_head=True)
    input_ids, attention_mask = prompts(3)
    plain = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40)
    table = CostTable(num_tokens=(1, 15), verify_seconds=(1.0, 1.2), draft_seconds=0.3)
    out = target.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40, custom_generate=decode,
        dspark_head=head, dspark_drafter=lambda head: PhasedOracle(head, plain), dspark_suffix=False,
        dspark_schedule=AdaptiveSchedule(table, temperatures=torch.full((4,), 1e-3)), return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, plain)
    stats = out.dspark_stats
    assert stats.num_plain_steps.sum() > 0 and stats.num_accepted.sum() > 0
    assert (stats.num_rounds > stats.num_plain_steps).all()


def test_cost_table_is_profiled_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    target = tiny_target("llama", num_layers=2)
    head = tiny_head(target, block_size=3)
    first = cost_table_for(target, head, batch_size=2)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    assert cost_table_for(target, head, batch_size=2) == first  # read back, not measured again
    cost_table_for(target, head, batch_size=3)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2
    monkeypatch.setenv("SPARK_GENERATE_PROFILE", "0")
    assert cost_table_for(target, head, batch_size=2) == CostTable.estimate("cpu", 2 * 4)


def test_a_cost_table_measured_on_a_busy_machine_serves_the_process_but_is_not_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPARK_GENERATE_MAX_OTHER_CORES", "0.25")
    monkeypatch.setattr(profiling, "_UNSAVED_TABLES", {})
    measured = []
    table = CostTable((1,), (1.0,))
    monkeypatch.setattr(profiling, "profile_costs", lambda *args, **kwargs: measured.append(1) or table)
    fake_load(monkeypatch, 10**9)
    target = tiny_target("llama", num_layers=2)
    head = tiny_head(target, block_size=3)
    with pytest.warns(RuntimeWarning, match="cost table of LlamaForCausalLM at batch size 2 was measured while"):
        first = cost_table_for(target, head, batch_size=2, pack_linears=False)
    assert cost_table_for(target, head, batch_size=2, pack_linears=False) is first  # this process: kept
    assert len(measured) == 1 and not (tmp_path / "costs").exists()
    profiling._UNSAVED_TABLES.clear()  # a new process, on a quiet machine now: measured again, and saved
    fake_load(monkeypatch, 0)
    cost_table_for(target, head, batch_size=2, pack_linears=False)
    assert len(measured) == 2 and len(list((tmp_path / "costs").glob("*.json"))) == 1
