"""The quickstart notebook runs from top to bottom and shows what it claims.

``examples/quickstart.ipynb`` loads SmolLM2 and its shipped DSpark head by default; with
``SPARK_GENERATE_NOTEBOOK_TINY=1`` it builds a tiny random Llama and an untrained head instead, so
the notebook is executed here, in a fresh kernel that inherits that variable, in seconds and
without any download. Every cell must run without error, the greedy cell must report output
identical to plain ``generate()``, and the committed file must carry no outputs, so that it stays a
clean document rather than a record of someone's last run.
"""

from pathlib import Path

import nbclient
import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "quickstart.ipynb"


def test_committed_notebook_has_no_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells
    for cell in code_cells:
        assert cell.outputs == [] and cell.execution_count is None, cell.source


def test_notebook_runs_on_the_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_GENERATE_NOTEBOOK_TINY", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    printed = "".join(output.text for output in outputs if output.output_type == "stream")
    assert "greedy output identical to plain generate(): True" in printed
    assert "same seed, same tokens: True" in printed
    assert any("image/png" in output.get("data", {}) for output in outputs)
