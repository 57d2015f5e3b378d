"""The round-cost profile runs end to end on a tiny random target (what `benchmarks/bench_round.py` records).

Timings are never asserted (they belong to benchmarks); the test checks that every phase of a round
is measured, that an always-right drafter is accepted in full, and that the CSV and chart are written.
"""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("backbone", "draft_slots", "schedule", "target_forward", "verification", "commit", "bookkeeping")


def test_round_profile_on_a_tiny_target(tmp_path):
    output = tmp_path / "round.csv"
    command = [
        sys.executable, "benchmarks/bench_round.py", "--target", "tiny", "--oracle", "--batch-sizes", "1", "2",
        "--temperatures", "0", "1", "--new-tokens", "9", "--threads", "1", "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in output.read_text().splitlines() if not line.startswith("#")]
    rows = list(csv.DictReader(lines))
    assert [(row["batch_size"], row["temperature"]) for row in rows] == [
        ("1", "0.0"), ("1", "1.0"), ("2", "0.0"), ("2", "1.0")
    ]  # fmt: skip
    for row in rows:
        assert all(float(row[phase]) >= 0 for phase in PHASES if phase != "bookkeeping"), row
        assert float(row["target_forward"]) > 0 and float(row["plain_step_ms"]) > 0
    greedy = [row for row in rows if row["temperature"] == "0.0"]
    assert all(float(row["tau"]) > 7 for row in greedy)  # the always-right drafter: full blocks of 8
    assert output.with_suffix(".png").stat().st_size > 0
    assert output.read_text().startswith("# hardware:")
