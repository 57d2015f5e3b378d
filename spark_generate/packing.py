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
would take more than half of the free memory. A weight whose values changed since it was packed is
packed again, however it changed: a replaced tensor or an in-place update is seen by the weight's
data pointer and version counter, and a write through ``.data`` (which bumps neither, as EMA and
weight-loading code do) by a checksum of the weight's bits taken at every entry: an integer sum
that any change of one element alters, and the rows' first elements by position, so reordered
rows are seen too. It reads each weight once (for SmolLM2-135M about a tenth of a decoding step)
and is paid once per generation.
Only plain ``nn.Linear`` layers (not subclasses, which may quantize or hook their forward) with
float32 CPU weights are packed, only while gradients are off, and only where oneDNN passes a
one-off numerical self-check; everything else runs unchanged. ``pack_linears=False`` (or
``SPARK_GENERATE_PACK_LINEARS=0``) turns it off.

Packing belongs to the call that asked for it, so one model serves many threads: while any call
packs a layer, the layer's forward is a dispatcher that looks the packed weight up in the calling
context (a :class:`contextvars.ContextVar`), and forwards of calls that did not ask for packing run
``F.linear`` as if nothing were patched. The first call to pack a layer installs the dispatcher and
the last to leave removes it (counted under a lock).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
import types
import weakref
from collections.abc import Iterator, Mapping

import torch
from torch import nn

__all__ = ["clear_packed_linears", "packed_linears", "packing_supported", "resolve_pack_linears"]

# A weight's fingerprint when packed: data pointer, version counter, checksum of its bits.
Fingerprint = tuple[int, int, tuple[int, int]]
# Per layer: the weight's fingerprint when packed, and the packed weight.
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[Fingerprint, torch.Tensor]] = weakref.WeakKeyDictionary()
# Per layer: how many active calls route it through the dispatcher installed as its forward.
_USERS: weakref.WeakKeyDictionary[nn.Linear, int] = weakref.WeakKeyDictionary()
# Guards _PACKED and _USERS, and the installing and removing of dispatchers.
_LOCK = threading.RLock()
# The packed weights of the layers the current call packs (empty for calls that do not pack).
_ROUTES: contextvars.ContextVar[Mapping[nn.Linear, torch.Tensor]] = contextvars.ContextVar(
    "spark_generate_packed_routes", default=types.MappingProxyType({})
)


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
    """Runs the qualifying ``nn.Linear`` layers of ``modules`` through oneDNN while inside, for this call only.

    Re-entrant: layers already packed by an enclosing block stay packed until it exits. Other
    threads (and other contexts) running the same layers meanwhile are not affected.

    Args:
        *modules: The models whose linear layers to pack (the target and its head).
        enabled: If False, does nothing (so callers need no second code path).

    Yields:
        How many layers were packed here.
    """
    outer = _ROUTES.get()
    routes: dict[nn.Linear, torch.Tensor] = {}
    if enabled:
        with _LOCK:
            for module in modules:
                for layer in module.modules():
                    if layer not in outer and layer not in routes and _qualifies(layer):
                        routes[layer] = _packed_weight(layer)
                        _USERS[layer] = _USERS.get(layer, 0) + 1
                        if _USERS[layer] == 1:
                            layer.forward = functools.partial(_dispatch_forward, layer)
    token = _ROUTES.set({**outer, **routes}) if routes else None
    try:
        yield len(routes)
    finally:
        if token is not None:
            _ROUTES.reset(token)
        with _LOCK:
            for layer in routes:
                _USERS[layer] -= 1
                if _USERS[layer] == 0:
                    del _USERS[layer], layer.forward


def clear_packed_linears() -> None:
    """Frees every cached packed weight (they are packed again at the next generation)."""
    _PACKED.clear()


def _qualifies(layer: nn.Module) -> bool:
    """A plain ``nn.Linear`` with float32 CPU weights and nobody else's forward on the instance."""
    return (
        type(layer) is nn.Linear
        and ("forward" not in vars(layer) or layer in _USERS)
        and layer.weight.device.type == "cpu"
        and layer.weight.dtype == torch.float32
        and (layer.bias is None or layer.bias.dtype == torch.float32)
    )


def _packed_weight(layer: nn.Linear) -> torch.Tensor:
    """The layer's weight in oneDNN's layout: cached, packed again if the weight changed (call under ``_LOCK``)."""
    weight = layer.weight.detach()
    key = (weight.data_ptr(), layer.weight._version, _checksum(weight))
    cached = _PACKED.get(layer)
    if cached is None or cached[0] != key:
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight, None))
        _PACKED[layer] = cached
    return cached[1]


def _checksum(weight: torch.Tensor) -> tuple[int, int]:
    """An integer fingerprint of a float32 ``[out, in]`` weight's bits, at about the cost of reading it once.

    The sum of all bit patterns as int32 (wrapping, so exact and independent of the summation
    order) changes with any change of any one element; the first element of each row weighted by
    its row's position changes when rows are reordered.
    """
    bits = weight.view(torch.int32)
    first = bits.reshape(len(weight), -1)[:, 0].long()
    return int(bits.sum(dtype=torch.int32)), int((first * (2 * torch.arange(len(first)) + 1)).sum())


def _dispatch_forward(layer: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    """``layer(inputs)``: by oneDNN when the calling context packs the layer, else by ``F.linear``.

    ``F.linear`` also when gradients are on or the input is not float32 on the CPU.
    """
    packed = _ROUTES.get().get(layer)
    if packed is None or torch.is_grad_enabled() or inputs.dtype != torch.float32 or inputs.device.type != "cpu":
        return nn.functional.linear(inputs, layer.weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(inputs, packed, layer.bias, "none", [], "")
