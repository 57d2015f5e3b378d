"""How an untrained head starts: the scale its ``fc`` trains with, and draft layers copied from the target.

**Feature scale.** :meth:`~spark_generate.heads.DSparkHead.scale_target_features` trains ``fc`` on scaled features
and saves the folded weight (:mod:`spark_generate.heads.feature_scale`); this module measures the
scale. The statistics leave out each document's first ``skip_first`` positions: the first token of
a causal LM is an attention sink whose features are orders of magnitude larger than the rest
(about 1,000 against 7 to 25 in SmolLM2-135M's deeper taps), and it would otherwise set the
scale of every channel it touches. ``hidden_norm`` after ``fc`` normalises each position anyway.

``kind="channel"`` gives every channel its own scale; ``kind="tap"`` one scale per tapped layer
(the RMS over the layer's channels), which evens out the layers' magnitudes but leaves a massive
channel massive within its layer.

**Draft layers from the target.** :func:`init_draft_layers_from_target` copies the weights of the
target's last decoder layers into the draft layers wherever names and shapes agree (attention
projections, MLP, layer norms); the draft-only ``q_norm``/``k_norm`` keep their initial ones. The
draft layers then start as the computation that turns deep target states into next-token states.

**A deeper head from a trained one.** :func:`grow_draft_layers` gives a trained head more draft
layers without changing what it drafts: the new layers go before the trained ones (which keep
their place next to the output), start as copies of the target's layers before those the trained
ones came from, and have their attention output and MLP down projections set to zero. A residual
layer whose two branches add exact zeros passes its input through, so the grown head's logits are
the trained head's bit for bit; training then opens the new layers from the zero projections,
which receive gradients from the first step. Whether the extra depth pays is the evaluation's call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import PreTrainedModel

from spark_generate.heads import DSparkHead
from spark_generate.training.data import TokenDataset
from spark_generate.training.feature_cache import FeatureCache, target_states

__all__ = [
    "SCALE_KINDS",
    "feature_scale",
    "feature_scale_from_cache",
    "feature_scale_from_target",
    "grow_draft_layers",
    "init_draft_layers_from_target",
]

SCALE_KINDS = ("channel", "tap")
SKIP_FIRST = 1
"""Positions left out at the start of each document (the attention sink)."""


def feature_scale(
    documents: Iterable[torch.Tensor], num_taps: int, kind: str = "channel", skip_first: int = SKIP_FIRST
) -> torch.Tensor:
    """One over the RMS of each feature channel (or tap) over documents' positions.

    Args:
        documents: Each ``[T, m·H]`` tapped features of one document.
        num_taps: ``m``, the number of tapped layers.
        kind: ``"channel"`` or ``"tap"``.
        skip_first: Positions left out at the start of every document.

    Returns:
        ``[m·H]`` float32 scales (equal within a tap for ``kind="tap"``).

    Raises:
        ValueError: For another ``kind``, or when no position is left to measure.
    """
    if kind not in SCALE_KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {SCALE_KINDS}.")
    total, count = None, 0
    for features in documents:
        rows = features[skip_first:].double()
        total = rows.square().sum(0) if total is None else total + rows.square().sum(0)
        count += len(rows)
    if total is None or count == 0:
        raise ValueError(
            f"no feature rows to measure: every document has at most skip_first={skip_first} positions. "
            "Measure the scale on longer documents."
        )
    mean_square = total / count
    if kind == "tap":
        per_tap = mean_square.view(num_taps, -1)
        mean_square = per_tap.mean(1, keepdim=True).expand_as(per_tap).flatten()
    rms = mean_square.sqrt()
    floor = rms[rms > 0].median() * 1e-3 if bool((rms > 0).any()) else torch.tensor(1.0, dtype=rms.dtype)
    return (1 / rms.clamp(min=floor)).float()


def feature_scale_from_cache(
    cache: FeatureCache, indices: Sequence[int], num_taps: int, kind: str = "channel"
) -> torch.Tensor:
    """:func:`feature_scale` of the cached documents ``indices`` (reads only those rows)."""
    cpu = torch.device("cpu")
    documents = (cache.states([index], cpu, torch.float32).features[0] for index in indices)
    return feature_scale(documents, num_taps, kind)


def feature_scale_from_target(
    target: PreTrainedModel, layer_ids: Sequence[int], dataset: TokenDataset, indices: Sequence[int],
    kind: str = "channel",
) -> torch.Tensor:  # fmt: skip
    """:func:`feature_scale` of documents ``indices``, running the target on each (one document per forward)."""
    device = next(target.parameters()).device

    def documents() -> Iterable[torch.Tensor]:
        for index in indices:
            batch = dataset.batch([index]).to(device)
            yield target_states(target, list(layer_ids), batch.input_ids, batch.attention_mask, device).features[0]

    return feature_scale(documents(), len(layer_ids), kind)


def _copy_target_layer(layer: torch.nn.Module, target_layer: torch.nn.Module) -> list[str]:
    """Copies ``target_layer``'s weights into ``layer`` wherever names and shapes agree; returns the names copied."""
    source = target_layer.state_dict()
    copied = []
    with torch.no_grad():
        for name, tensor in layer.state_dict().items():
            if name in source and source[name].shape == tensor.shape:
                tensor.copy_(source[name])
                copied.append(name)
    return copied


def init_draft_layers_from_target(head: DSparkHead, target: PreTrainedModel) -> list[str]:
    """Copies the target's last ``num_draft_layers`` decoder layers into the draft layers, in order.

    Args:
        head: An untrained head.
        target: Its target (a decoder whose layers sit at ``target.get_decoder().layers``).

    Returns:
        The draft-layer weights that were copied (e.g. ``layers.0.self_attn.q_proj.weight``).

    Raises:
        ValueError: If no weight of a draft layer matches its target layer in name and shape.
    """
    target_layers = target.get_decoder().layers
    first = len(target_layers) - len(head.layers)
    copied = [
        f"layers.{index}.{name}"
        for index, layer in enumerate(head.layers)
        for name in _copy_target_layer(layer, target_layers[first + index])
    ]
    if not copied:
        raise ValueError(
            f"no weight of the draft layers matches {type(target_layers[0]).__name__} in name and shape: the "
            "target's layers are laid out differently. Train the head from its own initialisation."
        )
    return copied


def grow_draft_layers(head: DSparkHead, num_draft_layers: int, target: PreTrainedModel) -> DSparkHead:
    """A head with ``num_draft_layers`` draft layers that drafts exactly as ``head`` does, its new layers to train.

    Args:
        head: A trained head (any dtype and device; it is not modified).
        num_draft_layers: The grown head's draft layers, at least ``head``'s.
        target: The head's target: the new layers start from its decoder layers just before the last
            ``len(head.layers)`` (the layers :func:`init_draft_layers_from_target` gave the head).

    Returns:
        A new head, in ``head``'s dtype and on its device, not attached to ``target``.

    Raises:
        ValueError: If ``num_draft_layers`` is smaller than the head's, or the target has too few layers.
    """
    old = len(head.layers)
    target_layers = target.get_decoder().layers
    if not old <= num_draft_layers <= len(target_layers):
        raise ValueError(
            f"num_draft_layers={num_draft_layers}: expected {old} (the head's draft layers) to "
            f"{len(target_layers)} (the target's decoder layers); a head is grown, never cut."
        )
    added = num_draft_layers - old
    config = head.config.to_dict()
    layer_config = config["transformer_layer_config"]
    layer_config["num_hidden_layers"] = num_draft_layers
    if layer_config.get("layer_types") is not None:
        layer_config["layer_types"] = [layer_config["layer_types"][0]] * added + layer_config["layer_types"]
    parameter = next(head.parameters())
    grown = type(head)(type(head.config).from_dict(config)).to(device=parameter.device, dtype=parameter.dtype)
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            name = f"layers.{int(index) + added}.{rest}"
        state[name] = tensor
    result = grown.load_state_dict(state, strict=False)
    new_layers = {f"layers.{index}.{name}" for index in range(added) for name in grown.layers[index].state_dict()}
    if result.unexpected_keys or set(result.missing_keys) != new_layers:  # only the new layers are left to fill
        raise ValueError(f"the grown head does not hold exactly the head's weights: {result}")
    first = len(target_layers) - num_draft_layers
    with torch.no_grad():
        for layer, target_layer in zip(grown.layers[:added], target_layers[first : first + added], strict=True):
            _copy_target_layer(layer, target_layer)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown
