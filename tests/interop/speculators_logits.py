"""Draft and confidence logits of DSpark head folders, as the real speculators package computes them.

This script runs in a side virtualenv that holds speculators 0.9.0 (the owner of the ``"dspark"``
checkpoint format that vLLM serves), never in the project's own environment, and it imports
nothing from spark_generate: it is the independent half of ``tests/test_speculators_interop.py``.
Build the environment with ``tests/interop/build_speculators_venv.sh``, then::

    $SPARK_SPECULATORS_PYTHON tests/interop/speculators_logits.py MANIFEST.json

``MANIFEST.json`` is a list of cases ``{"head": DIR, "verifier": DIR, "inputs": NPZ, "output": NPZ}``:

* ``head``: a head folder (``config.json`` and ``model.safetensors``), loaded with speculators'
  own ``DSparkSpeculatorConfig`` and ``DSparkDraftModel``;
* ``verifier``: the target's folder, from which speculators reloads the embedding (and, for a full
  draft vocabulary, the LM head), since a head folder never carries them;
* ``inputs``: ``context_hidden`` float ``[N, p, m·H]``, the tapped target features of positions
  ``0 .. p-1`` of ``N`` independent blocks, and ``block_ids`` int ``[N, K]``, the tokens at positions
  ``p .. p+K-1``: the anchor, then the (teacher-forced) tokens after it;
* ``output``: written with ``logits`` float32 ``[N, K, V_d]`` (base logits plus Markov bias) and,
  for a head with a confidence head, ``confidence_logits`` float32 ``[N, K]``.

Slot ``k`` predicts position ``p+k+1`` when the head's ``sample_from_anchor`` is true, else
``p+k`` (slot 0 then drafts nothing).

speculators has no inference path: ``DSparkDraftModel.forward`` is its teacher-forced training
forward, which draws anchors where ``loss_mask`` is 1, builds each block from ``input_ids``, adds the
Markov bias and hands ``logits`` and ``confidence_logits`` to its loss (``compute_metrics``). Each
block is therefore one ``forward`` call with a single anchor at ``p``, and ``compute_metrics`` is
replaced by a function that records its inputs and returns a zero loss. Every computation on the
way is speculators' own; the eager attention implementation is chosen because the default flex
attention compiles for tens of seconds on CPU (their results agree).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.models.dspark import core as dspark_core


def load_head(head_dir: Path, verifier_dir: Path) -> DSparkDraftModel:
    """Loads a head folder the way speculators' trainer does, strictly, in float32 and eval mode.

    Raises:
        SystemExit: If the folder lacks a weight the model owns (transformers would only print a
            report and initialise it at random), holds one it does not own, or a NaN remains
            (the verifier's embedding was not found).
    """
    config = DSparkSpeculatorConfig.from_pretrained(head_dir)
    if config.speculators_config is None:
        sys.exit(f"{head_dir}/config.json has no speculators_config: speculators cannot find the verifier")
    config.transformer_layer_config._attn_implementation = "eager"  # never serialized
    config.speculators_config.verifier.name_or_path = str(verifier_dir)
    model = DSparkDraftModel.from_pretrained(head_dir, config=config)
    owned = set(model.state_dict())
    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as weights:
        stored = set(weights.keys())
    missing = owned - set(model._keys_to_ignore_on_save) - stored
    if missing or stored - owned:
        sys.exit(f"{head_dir}: weights missing {sorted(missing)}, not owned by speculators {sorted(stored - owned)}")
    with_nan = [
        name for name, tensor in model.state_dict().items() if tensor.is_floating_point() and tensor.isnan().any()
    ]
    if with_nan:
        sys.exit(f"{head_dir}: NaN in {with_nan} after loading; is {verifier_dir} the verifier?")
    return model.float().eval()


class _Recorder:
    """Stands in for ``compute_metrics``: records the logits DSpark's forward would train on."""

    def __init__(self) -> None:
        self.logits: torch.Tensor | None = None
        self.confidence_logits: torch.Tensor | None = None

    def __call__(
        self, logits: torch.Tensor, targets: torch.Tensor, confidence_logits: torch.Tensor | None, *args, **kwargs
    ):
        self.logits, self.confidence_logits = logits, confidence_logits
        return logits.new_zeros(()), {}


def block_logits(
    model: DSparkDraftModel, context_hidden: torch.Tensor, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block through ``DSparkDraftModel.forward``.

    Args:
        model: The loaded head.
        context_hidden: ``[p, m·H]`` tapped features of the context.
        block_ids: ``[K]`` the anchor and the tokens after it.

    Returns:
        ``[K, V_d]`` logits and ``[K]`` confidence logits (None without a confidence head).
    """
    context_length, block_size = context_hidden.shape[0], model.block_size
    # Anchors are never drawn from the last K rows, so one spare row keeps position p eligible.
    length = context_length + block_size + 1
    hidden_size = model.config.transformer_layer_config.hidden_size
    hidden_states = torch.zeros(1, length, context_hidden.shape[1])
    hidden_states[0, :context_length] = context_hidden  # rows from p on are masked out for block p
    input_ids = torch.zeros(1, length, dtype=torch.long)
    input_ids[0, context_length : context_length + block_size] = block_ids
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, context_length] = 1
    recorder = _Recorder()
    original, dspark_core.compute_metrics = dspark_core.compute_metrics, recorder
    try:
        with torch.no_grad():
            model(
                hidden_states=hidden_states,
                input_ids=input_ids,
                loss_mask=loss_mask,
                verifier_last_hidden_states=torch.zeros(1, length, hidden_size),  # loss targets only
                document_ids=torch.zeros(1, length, dtype=torch.long),
                max_anchors=1,
            )
    finally:
        dspark_core.compute_metrics = original
    confidence = None if recorder.confidence_logits is None else recorder.confidence_logits.view(block_size)
    return recorder.logits.view(block_size, -1), confidence


def run_case(model: DSparkDraftModel, inputs: Path, output: Path) -> None:
    """Computes every block of an inputs file and writes the output file."""
    arrays = np.load(inputs)
    context_hidden = torch.from_numpy(arrays["context_hidden"]).float()
    block_ids = torch.from_numpy(arrays["block_ids"]).long()
    if block_ids.shape != (context_hidden.shape[0], model.block_size):
        sys.exit(f"{inputs}: block_ids has shape {tuple(block_ids.shape)}, expected (N, {model.block_size})")
    blocks = [block_logits(model, context, ids) for context, ids in zip(context_hidden, block_ids, strict=True)]
    result = {"logits": torch.stack([logits for logits, _ in blocks]).numpy()}
    if blocks[0][1] is not None:
        result["confidence_logits"] = torch.stack([confidence for _, confidence in blocks]).numpy()
    np.savez(output, **result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("manifest", type=Path, help="JSON list of {head, verifier, inputs, output}")
    cases = json.loads(parser.parse_args().manifest.read_text())
    models: dict[tuple[str, str], DSparkDraftModel] = {}
    for case in cases:
        key = (case["head"], case["verifier"])
        if key not in models:
            models[key] = load_head(Path(case["head"]), Path(case["verifier"]))
        run_case(models[key], Path(case["inputs"]), Path(case["output"]))


if __name__ == "__main__":
    main()
