"""Float32 linear layers on a CPU, run through oneDNN with pre-packed weights while decoding.

On a CPU, speculation pays only if a target forward over a few tokens costs little more than over
one. PyTorch's float32 ``linear`` does not give that: it calls the BLAS ``sgemm``, whose kernels for
2-8 rows cost up to twice those for one (on a 2-core AMD EPYC with MKL 2024, SmolLM2-135M: one token
61.6 ms, two 113.9 ms, eight 117.5 ms), so a round must emit about two tokens to break even.
oneDNN's inner-product primitive on weights reordered once into its blocked layout (what
``torch.compile`` emits for frozen CPU models) costs about as much for 2 rows as for 1, and less
than ``sgemm`` even for 1 (the 576 × 49,152 LM head: 4.4 ms against 9.5 ms for one row, 4.5 ms
against 20.7 ms for two). :func:`packed_linears` routes the ``nn.Linear`` layers of the target and
the head through it for the duration of a generation.

What changes is the order of float32 additions inside each dot product, not the function: logits
move by rounding (about 1e-4 on SmolLM2's logits, argmax unchanged on every prompt position we
compared), as they already do between a one-token decode step and a multi-token verification.

The packed copies (one float32 copy of each packed weight: 540 MB for SmolLM2-135M) are cached per
layer, so only the first generation pays the reordering (about 0.3 s for SmolLM2), and are freed
with the layer, or by :func:`clear_packed_linears`; by default a model is not packed when its copies
would take more than half of the free memory. A weight changed in place (a training step) is
packed again. Only plain ``nn.Linear`` layers (not subclasses, which may quantize or hook their
forward) with float32 CPU weights are packed, only while gradients are off, and only where oneDNN
passes a one-off numerical self-check; everything else runs unchanged. ``pack_linears=False`` (or
``SPARK_GENERATE_PACK_LINEARS=0``) turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["clear_packed_linears", "packed_linears", "packing_supported", "resolve_pack_linears"]

# Per layer: the weight's identity and version when packed, and the packed weight.
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple[int, int], torch.Tensor]] = weakref.WeakKeyDictionary()


@functools.cache
def packing_supported() -> bool:
    """Whether this PyTorch build runs oneDNN's packed float32 linear, and agrees with ``F.linear``."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(24, 40, generator=generator), torch.randn(24, generator=generator)
        inputs = torch.randn(2, 3, 40, generator=generator)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        output = torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(output, nn.functional.linear(inputs, weight, bias), rtol=1e-4, atol=1e-5))


def resolve_pack_linears(model: nn.Module, pack_linears: bool | None) -> bool:
    """Whether a generation on ``model`` packs its linears.

    ``None`` (the default of every entry point) means: on a CPU, for a float32 model whose packed
    copies would take less than half of the free memory, unless ``SPARK_GENERATE_PACK_LINEARS=0``;
    ``True`` or ``False`` force it (``True`` still packs only the layers that qualify, see the
    module docstring).
    """
    if pack_linears is not None:
        return bool(pack_linears) and packing_supported()
    parameter = next(model.parameters(), None)
    return (
        os.environ.get("SPARK_GENERATE_PACK_LINEARS", "1") != "0"
        and parameter is not None
        and parameter.device.type == "cpu"
        and parameter.dtype == torch.float32
        and packing_supported()
        and _copies_fit_in_memory(model)
    )


def _copies_fit_in_memory(model: nn.Module) -> bool:
    """Whether packed copies of the model's linears would take less than half of the free memory."""
    needed = sum(layer.weight.numel() * 4 for layer in model.modules() if _qualifies(layer) and layer not in _PACKED)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows): trust the caller
        return True
    return needed < free // 2


@contextlib.contextmanager
def packed_linears(*modules: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Runs the qualifying ``nn.Linear`` layers of ``modules`` through oneDNN while inside.

    Re-entrant: layers already packed by an enclosing block stay packed until it exits.

    Args:
        *modules: The models whose linear layers to pack (the target and its head).
        enabled: If False, does nothing (so callers need no second code path).

    Yields:
        How many layers were packed here.
    """
    patched: list[nn.Linear] = []
    if enabled:
        for module in modules:
            for layer in module.modules():
                if _qualifies(layer):  # also skips a layer two modules share, once patched
                    layer.forward = functools.partial(_packed_forward, layer, _packed_weight(layer))
                    patched.append(layer)
    try:
        yield len(patched)
    finally:
        for layer in patched:
            del layer.forward


def clear_packed_linears() -> None:
    """Frees every cached packed weight (they are packed again at the next generation)."""
    _PACKED.clear()


def _qualifies(layer: nn.Module) -> bool:
    """A plain ``nn.Linear`` with float32 CPU weights and nobody else's forward on the instance."""
    return (
        type(layer) is nn.Linear
        and "forward" not in vars(layer)
        and layer.weight.device.type == "cpu"
        and layer.weight.dtype == torch.float32
        and (layer.bias is None or layer.bias.dtype == torch.float32)
    )


def _packed_weight(layer: nn.Linear) -> torch.Tensor:
    """The layer's weight in oneDNN's layout: cached, packed again if the weight changed."""
    key = (layer.weight.data_ptr(), layer.weight._version)
    cached = _PACKED.get(layer)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None))
        _PACKED[layer] = cached
    return cached[1]


def _packed_forward(layer: nn.Linear, packed: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """``layer(inputs)`` by oneDNN; by ``F.linear`` when gradients are on or the input is not float32 CPU."""
    if torch.is_grad_enabled() or inputs.dtype != torch.float32 or inputs.device.type != "cpu":
        return nn.functional.linear(inputs, layer.weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(inputs, packed, layer.bias, "none", [], "")
