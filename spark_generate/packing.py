"""Float32 linear layers on a CPU, run through oneDNN with pre-packed weights while decoding.

On a CPU, speculation pays only if a target forward over a few tokens costs little more than over
one. PyTorch's float32 ``linear`` does not always give that: it calls the BLAS ``sgemm``, whose
kernels for 2-8 rows can cost up to twice those for one (on a 2-core AMD EPYC with MKL 2024,
SmolLM2-135M: one token 61.6 ms, two 113.9 ms, eight 117.5 ms), so a round must emit about two
tokens to break even. oneDNN's inner-product primitive on weights reordered once into its blocked
layout (what ``torch.compile`` emits for frozen CPU models) costs about as much for 2 rows as for 1,
and there less than ``sgemm`` even for 1 (the 576 × 49,152 LM head: 4.4 ms against 9.5 ms for one
row, 4.5 ms against 20.7 ms for two). :func:`packed_linears` routes the ``nn.Linear`` layers of the
target and the head through it for the duration of a generation.

Which kernel is faster depends on the machine and the number of rows: on a 2-core Intel Xeon
(AVX-512, AMX) the same MKL ``sgemm`` beats the packed kernel at 1-2 rows (SmolLM2's 576 × 1,536
MLP projection: 52 µs against 71 µs for one row) and loses from about 8 (136 µs against 120 µs;
455 µs against 155 µs at 16). So each packed module (the target, the head) times a pass over all
of its linears, in order and on its own weights, with ``sgemm`` and packed at each row count of
``CROSSOVER_ROWS`` (powers of two), and a forward over ``rows`` input rows (batch × tokens) runs
packed only if the packed pass was at least as fast at the largest of those counts not above
``rows``. That is measured once per machine and set of layer shapes (a few seconds for SmolLM2)
and cached as JSON under ``$SPARK_GENERATE_CACHE/packing``, keyed by processor, thread count and
torch version, so that every later generation on the machine dispatches identically (unless other
processes kept the processors busy while it was timed: then it serves the process that timed it
and is not saved); a module whose packed pass won at no count is not routed at all. With
``SPARK_GENERATE_PROFILE=0`` nothing is measured and every row count runs packed.

What changes is the order of float32 additions inside each dot product, not the function: logits
move by rounding (about 1e-4 on SmolLM2's logits, argmax unchanged on every prompt position we
compared), as they already do between a one-token decode step and a multi-token verification.

The packed copies (one float32 copy of each packed weight: 540 MB for SmolLM2-135M) are cached per
layer, so only the first generation pays the reordering (about 0.3 s for SmolLM2), and are freed
with the layer, or by :func:`clear_packed_linears`; by default a model is not packed when its copies
would take more than half of the free memory. A weight whose values changed since it was packed is
packed again, however it changed: a replaced tensor or an in-place update is seen by the weight's
data pointer and version counter, and a write through ``.data`` (which bumps neither, as EMA and
weight-loading code do) by a checksum of the weight's bits: an integer sum that any change of one
element alters, and the rows' first elements by position, so reordered rows are seen too. It reads
the weight once, at its first packed use in each call (so a call whose forwards all run ``sgemm``,
say one-token decoding on a machine where ``sgemm`` wins at one row, never pays for it).
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
import dataclasses
import functools
import hashlib
import json
import os
import statistics
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from spark_generate.config import LoadWatch, cache_folder, processor_name, write_json_atomically

__all__ = ["clear_packed_linears", "packed_linears", "packed_row_counts", "packing_supported", "resolve_pack_linears"]

# A weight's fingerprint when packed: data pointer, version counter, checksum of its bits.
Fingerprint = tuple[int, int, tuple[int, int]]
# Per layer: the weight's fingerprint when packed, and the packed weight.
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[Fingerprint, torch.Tensor]] = weakref.WeakKeyDictionary()
# Per layer: how many active calls route it through the dispatcher installed as its forward.
_USERS: weakref.WeakKeyDictionary[nn.Linear, int] = weakref.WeakKeyDictionary()
# Guards _PACKED and _USERS, and the installing and removing of dispatchers.
_LOCK = threading.RLock()
# Per layer the current call packs, its route (empty for calls that do not pack).
_ROUTES: contextvars.ContextVar[Mapping[nn.Linear, _Route]] = contextvars.ContextVar(
    "spark_generate_packed_routes", default=types.MappingProxyType({})
)
# Per (threads, digest of the layers' shapes): whether the packed pass won, per count of CROSSOVER_ROWS.
_PACKED_WINS: dict[tuple[int, str], tuple[bool, ...]] = {}
CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts (1, 2, 4, ...) at which both passes are timed per module
CROSSOVER_REPEATS = 5  # timings of each pass per row count (the median counts), in alternating order


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
        How many layers this call routes through packed kernels (none of a module whose packed
        kernels measured slower than ``sgemm`` at every row count).
    """
    outer = _ROUTES.get()
    routes: dict[nn.Linear, _Route] = {}
    if enabled:
        with _LOCK:
            for layers in _module_layers(modules, skip=outer):  # the target, the head: each its own counts
                wins = _packed_wins(layers) if layers else ()
                if any(wins):  # else sgemm at every row count: nothing to route
                    routes.update((layer, _Route(layer, wins)) for layer in layers)
            for layer in routes:
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


def packed_row_counts(*modules: nn.Module) -> list[list[int]]:
    """Per module, the counts of ``CROSSOVER_ROWS`` at which (up to the next count) its linears run packed.

    Measured now if this machine has not measured these layers yet; what a cost table measured
    under packing depends on. Empty for a module with no layer to pack, or none that wins.
    """
    with _LOCK:
        return [
            [rows for rows, won in zip(CROSSOVER_ROWS, _packed_wins(layers), strict=True) if won] if layers else []
            for layers in _module_layers(modules, skip=())
        ]


def clear_packed_linears() -> None:
    """Frees every cached packed weight (they are packed again at the next generation)."""
    _PACKED.clear()


def _module_layers(modules: tuple[nn.Module, ...], skip: Mapping[nn.Linear, object]) -> list[list[nn.Linear]]:
    """Per module, its layers that qualify for packing, less those in ``skip`` or listed for an earlier module."""
    seen: set[nn.Module] = set(skip)
    groups = []
    for module in modules:
        layers = [layer for layer in module.modules() if layer not in seen and _qualifies(layer)]
        seen.update(layers)
        groups.append(layers)
    return groups


def _qualifies(layer: nn.Module) -> bool:
    """A plain ``nn.Linear`` with float32 CPU weights and nobody else's forward on the instance."""
    return (
        type(layer) is nn.Linear
        and ("forward" not in vars(layer) or layer in _USERS)
        and layer.weight.device.type == "cpu"
        and layer.weight.dtype == torch.float32
        and (layer.bias is None or layer.bias.dtype == torch.float32)
    )


@dataclasses.dataclass
class _Route:
    """A layer's packing in one call: the row counts that run packed, and its packed weight once one has."""

    layer: nn.Linear
    wins: tuple[bool, ...]  # per count of CROSSOVER_ROWS: whether that many input rows (up to the next) run packed
    packed: torch.Tensor | None = None

    def packed_weight(self) -> torch.Tensor:
        """The packed weight, checked against the layer's current one at the call's first packed use."""
        if self.packed is None:
            with _LOCK:
                self.packed = _packed_weight(self.layer)
        return self.packed


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
    route = _ROUTES.get().get(layer)
    if (
        route is None
        or torch.is_grad_enabled()
        or inputs.dtype != torch.float32
        or inputs.device.type != "cpu"
        or not route.wins[min((inputs.numel() // inputs.shape[-1]).bit_length(), len(CROSSOVER_ROWS)) - 1]
    ):
        return nn.functional.linear(inputs, layer.weight, layer.bias)
    return _packed_linear(inputs, route.packed_weight(), layer.bias)


def _packed_linear(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The inner product of ``inputs`` ``[..., in]`` with a oneDNN-packed ``[out, in]`` weight: ``[..., out]``."""
    return torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")


def _packed_wins(layers: list[nn.Linear]) -> tuple[bool, ...]:
    """Per count of ``CROSSOVER_ROWS``, whether these layers run packed from it on (call under ``_LOCK``).

    Looked up by the layers' shapes (in order) in memory, then in the cache file of this processor,
    thread count and torch version; shapes found in neither are timed (:func:`_time_passes`) and
    added to the file (written atomically; kept in memory only when other processes loaded the
    machine meanwhile, :class:`~spark_generate.config.LoadWatch`). Layers that are never to run
    packed keep no packed copy. ``SPARK_GENERATE_PROFILE=0``: packed at every count, without measuring.
    """
    if os.environ.get("SPARK_GENERATE_PROFILE", "1") == "0":
        return (True,) * len(CROSSOVER_ROWS)
    shapes = ",".join(f"{layer.out_features}x{layer.in_features}" for layer in layers)
    name = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    memo = (torch.get_num_threads(), name)
    if memo not in _PACKED_WINS:
        key = {"processor": processor_name(), "threads": memo[0], "torch": torch.__version__}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        path = cache_folder() / "packing" / f"{digest}.json"
        try:
            measured = json.loads(path.read_text())["packed_from"]
        except (OSError, ValueError, KeyError, TypeError):
            measured = {}  # none yet, or damaged: measured again and replaced
        if not isinstance(measured.get(name), list):
            with LoadWatch() as watch:
                wins = _time_passes([(layer.weight.detach(), _packed_weight(layer)) for layer in layers])
            measured[name] = [rows for rows, won in zip(CROSSOVER_ROWS, wins, strict=True) if won]
            if not any(wins):
                for layer in layers:
                    _PACKED.pop(layer, None)
            if watch.quiet:
                write_json_atomically(path, {"key": key, "packed_from": measured})
            else:
                watch.warn_unsaved(f"The packed kernels' crossover for {len(layers)} linear layers")
        _PACKED_WINS[memo] = tuple(rows in measured[name] for rows in CROSSOVER_ROWS)
    return _PACKED_WINS[memo]


@torch.no_grad()
def _time_passes(weights: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[bool, ...]:
    """Per count of ``CROSSOVER_ROWS``, whether a packed pass over these layers is as fast as an ``sgemm`` pass.

    A pass runs all the layers, in order, as a forward streams them (for a model larger than the
    processor's caches, from memory: a single layer timed alone would sit in the cache and favour
    another kernel); the two passes alternate, after one untimed pass each, and the medians of
    ``CROSSOVER_REPEATS`` timings are compared.

    Args:
        weights: Per layer, its float32 weight ``[out, in]`` and the same weight in oneDNN's layout.

    Returns:
        One flag per count of ``CROSSOVER_ROWS``.
    """
    generator = torch.Generator().manual_seed(0)
    wins = []
    for rows in CROSSOVER_ROWS:
        inputs = {size: torch.randn(rows, size, generator=generator) for size in {w.shape[1] for w, _ in weights}}

        def sgemm_pass(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for weight, _ in weights:
                nn.functional.linear(inputs[weight.shape[1]], weight)

        def packed_pass(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for weight, packed in weights:
                _packed_linear(inputs[weight.shape[1]], packed, None)

        seconds: dict[Callable[[], None], list[float]] = {sgemm_pass: [], packed_pass: []}
        sgemm_pass()  # untimed: oneDNN creates its primitive for each shape at the first call
        packed_pass()
        for repeat in range(CROSSOVER_REPEATS):
            for kernel in (sgemm_pass, packed_pass) if repeat % 2 else (packed_pass, sgemm_pass):
                start = time.perf_counter()
                kernel()
                seconds[kernel].append(time.perf_counter() - start)
        wins.append(statistics.median(seconds[packed_pass]) <= statistics.median(seconds[sgemm_pass]))
    return tuple(wins)
