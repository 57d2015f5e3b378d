"""The machinery benchmark runs end to end on a tiny random target (what `benchmarks/bench_overhead.py` records).

Timings are never asserted (they belong to benchmarks); the script itself checks that DSpark's
greedy output equals plain ``generate()``'s and that its never-drafting schedule keeps every round
of the default loop a plain step, so a schedule that drafts where nothing can pay fails here.
"""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_machinery_benchmark_on_a_tiny_target(tmp_path):
    output = tmp_path / "overhead.csv"
    command = [
        sys.executable, "benchmarks/bench_overhead.py", "--models", "tiny-llama", "--batch-sizes", "1", "3",
        "--new-tokens", "12", "--repeats", "1", "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in output.read_text().splitlines() if not line.startswith("#")]
    rows = list(csv.DictReader(lines))
    assert [row["batch_size"] for row in rows] == ["1", "3"]
    for row in rows:
        assert float(row["plain_ms_per_step"]) >= 0 and float(row["loop_plain_ms_per_step"]) > 0, row
        assert float(row["loop_plain_vs_plain"]) > 0, row
    assert output.read_text().startswith("# hardware:")
