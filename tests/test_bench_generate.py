"""The peer benchmark taken in parts: finished cells are kept on disk and a rerun continues with the next.

Runs the real SmolLM2-135M-Instruct (from its PyPI package, as the benchmark does) on one prompt
and four new tokens per cell, plain systems only; timings are never asserted.
"""

import csv
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path, *extra):
    command = [
        sys.executable, "benchmarks/bench_generate.py", "--domains", "code", "math", "--systems", "plain",
        "plain-packed", "--prompts", "1", "--max-new-tokens", "4", "--batch-sizes", "1", "--temperatures", "0",
        "--threads", "1", "--output", str(tmp_path), *extra,
    ]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_benchmark_stopped_at_its_budget_continues_with_the_next_cell(tmp_path):
    first = _bench(tmp_path, "--max-minutes", "0.001")
    assert first.returncode != 0 and "1 of 2 cells done" in first.stderr, first.stderr[-2000:]
    [log] = json.loads((tmp_path / "generate_smollm2_cpu.cells.json").read_text())["recordings"]
    assert list(log["cells"]) == ["code/T=0/batch=1"] and not (tmp_path / "generate_smollm2_cpu.csv").exists()
    second = _bench(tmp_path, "--max-minutes", "0.001")
    assert second.returncode == 0, second.stderr[-2000:]
    lines = (tmp_path / "generate_smollm2_cpu.csv").read_text().splitlines()
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert [(row["domain"], row["system"]) for row in rows] == [
        ("code", "plain"), ("code", "plain-packed"), ("math", "plain"), ("math", "plain-packed")
    ]  # fmt: skip
    assert [row["ttft_ms"] for row in rows[:2]] == [str(row["ttft_ms"]) for row in log["cells"]["code/T=0/batch=1"]]
    assert all(row["identical"] == "1/1" for row in rows)
    assert any("cells finished" in line for line in lines if line.startswith("#"))


def test_cells_of_other_settings_head_or_sources_are_not_kept_those_of_other_machines_are(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_generate

    row = bench_generate.Row(
        domain="copy", temperature=1.0, batch_size=4, system="plain", requests=4, new_tokens=40, ttft_ms=1.0,
        request_tok_s=1.0, throughput_tok_s=1.0, p95_latency_s=1.0, tau=1.0, acceptance="", speedup=1.0,
        vs_plain_packed=None, identical="", drafters="", compile_s=0.0,
    )  # fmt: skip
    key = {
        "settings": {"repeats": 3}, "head_sha256": "a", "sources_sha256": bench_generate.sources_digest(),
        "hardware": "AMD EPYC, 2 threads",
    }  # fmt: skip
    log = bench_generate.CellLog(tmp_path / "cells.json", key)
    assert log.rows("copy", 1.0, 4) is None and log.span() == "no cell finished"
    log.add([row], {"plain-compiled": "no compiler"})
    kept = bench_generate.CellLog(tmp_path / "cells.json", key)
    assert kept.rows("copy", 1.0, 4) == [row] and kept.failures == {"plain-compiled": "no compiler"}
    assert kept.rows("copy", 0.0, 4) is None
    intel = bench_generate.CellLog(tmp_path / "cells.json", {**key, "hardware": "Intel Xeon, 2 threads"})
    assert intel.rows("copy", 1.0, 4) is None and intel.failures == {}  # another machine: its own recording
    intel.add([replace(row, tau=2.0)], {})
    for hardware, tau in (("AMD EPYC, 2 threads", 1.0), ("Intel Xeon, 2 threads", 2.0)):  # both kept
        machine = bench_generate.CellLog(tmp_path / "cells.json", {**key, "hardware": hardware})
        [kept_row] = machine.rows("copy", 1.0, 4)
        assert kept_row.tau == tau
    for changed in ({"settings": {"repeats": 1}}, {"head_sha256": "b"}, {"sources_sha256": "c"}):
        other = bench_generate.CellLog(tmp_path / "cells.json", {**key, **changed})
        assert other.rows("copy", 1.0, 4) is None and other.failures == {}
    other.add([row], {})  # a new run drops the recordings of the old one, on every machine
    assert bench_generate.CellLog(tmp_path / "cells.json", key).rows("copy", 1.0, 4) is None


def test_the_sources_digest_follows_generation_code_and_the_benchmark_not_training_code(tmp_path, monkeypatch):
    """A recording spans training work: a change outside ``training/``, or to the benchmark, starts it over."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_generate

    package = tmp_path / "spark_generate"
    (package / "training").mkdir(parents=True)
    for name, text in (("__init__.py", ""), ("generation.py", "STEP = 1\n"), ("training/recipe.py", "LR = 1\n")):
        (package / name).write_text(text)
    monkeypatch.setattr(bench_generate, "spark_generate", SimpleNamespace(__file__=str(package / "__init__.py")))
    benchmark = tmp_path / "bench_generate.py"
    benchmark.write_text("REPEATS = 1\n")
    monkeypatch.setattr(bench_generate, "__file__", str(benchmark))
    before = bench_generate.sources_digest()
    (package / "training" / "recipe.py").write_text("LR = 2\n")
    assert bench_generate.sources_digest() == before
    (package / "generation.py").write_text("STEP = 2\n")
    changed = bench_generate.sources_digest()
    assert changed != before
    benchmark.write_text("REPEATS = 2\n")
    assert bench_generate.sources_digest() != changed


def test_paired_ratios_in_alternating_order_cancel_a_steady_drift(monkeypatch):
    """Three equally fast systems on a host slowing 1% a run: the recorded ratios stay at 1, the median runs' not."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_generate

    systems, runs, clock = ["plain", "plain-packed", "dspark"], {}, 0
    for repeat in range(4):
        for system in bench_generate.run_order(systems, repeat):
            seconds = 10.0 * (1 + 0.01 * clock)
            outcome = bench_generate.Outcome([[1] * 100], [seconds], seconds, [0.1], 1.0, [], "")
            runs.setdefault(system, []).append(outcome)
            clock += 1
    rows = {row.system: row for row in bench_generate.cell_rows("code", 0.0, 1, runs)}
    assert abs(rows["dspark"].vs_plain_packed - 1) <= 0.001 and abs(rows["dspark"].speedup - 1) <= 0.001
    naive = bench_generate.throughput(bench_generate.median_run(runs["dspark"])) / bench_generate.throughput(
        bench_generate.median_run(runs["plain-packed"])
    )
    assert abs(naive - 1) > 0.005
