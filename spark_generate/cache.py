"""The target side of the loop: its KV cache, its verification forward, and its tapped features.

Everything that differs between Transformers 5.x releases, or between model families, lives here,
so the generation loop reads the same on every version:

* the cache keyword of ``forward`` (``cache`` from 5.24, ``past_key_values`` before; remote-code
  models may keep either), found by inspecting the model's signature once;
* the cache object handed to a ``custom_generate`` callable (``cache`` or ``past_key_values`` in
  ``model_kwargs``; none at all on 5.0, in which case a fresh :class:`~transformers.DynamicCache`);
* rollback: ``Cache.crop(x)`` cuts to an absolute length for ``x >= 0`` up to 5.12 and removes
  ``|x|`` tokens for ``x <= 0`` from 5.18 on, so :func:`crop_cache` only ever calls ``crop(-n)``
  with ``n > 0``, which means "remove ``n`` tokens" in every release;
* hidden states of the tapped decoder layers, captured by forward hooks (:class:`FeatureTap`)
  rather than ``output_hidden_states``, whose list form changed meaning between releases and
  which would keep every layer.

The batch shares one cache length. Rows that accept fewer tokens than others leave *holes* in the
cache: the entries stay, and the loop's 2-D attention mask marks them 0, so later queries never
see them. Positions are passed explicitly, so a hole does not shift any row's positions. Holes do
shift a sliding window (it counts cache entries) and would enter a linear-attention state, so
:func:`check_holes_allowed` refuses batches of such targets unless the window can never slide.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache, PreTrainedModel

__all__ = ["FeatureTap", "cache_kwarg_name", "check_holes_allowed", "crop_cache", "take_cache", "target_forward"]

CACHE_KWARG_NAMES = ("cache", "past_key_values")


def cache_kwarg_name(model: PreTrainedModel) -> str:
    """The keyword under which ``model.forward`` takes its KV cache (``cache`` or ``past_key_values``)."""
    parameters = inspect.signature(model.forward).parameters
    for name in CACHE_KWARG_NAMES:
        if name in parameters:
            return name
    raise ValueError(
        f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; expected a "
        "Transformers causal LM with a KV cache."
    )


def take_cache(model: PreTrainedModel, model_kwargs: dict[str, Any]) -> Cache:
    """Pops the (empty) cache ``generate()`` prepared from ``model_kwargs``, or makes one.

    Calls ``activate_past_recording()`` where it exists (5.18+), which sliding-window and
    linear-attention layers need before any rollback.

    Raises:
        ValueError: The cache already holds tokens, or cannot be rolled back.
    """
    cache = None
    for name in CACHE_KWARG_NAMES:
        cache = model_kwargs.pop(name, None) or cache
    if cache is None:
        cache = DynamicCache(config=model.config)
    if cache.get_seq_length() != 0:
        raise ValueError(
            f"the cache passed to generate already holds {cache.get_seq_length()} tokens; DSpark decoding "
            "expects an empty cache (continuing from a prefilled cache is not supported): drop `cache=`."
        )
    if not getattr(cache, "is_croppable", True):
        raise ValueError(
            f"{type(cache).__name__} cannot be cropped, but speculative decoding rolls back rejected "
            "tokens; use the default dynamic cache (drop `cache_implementation=`)."
        )
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def check_holes_allowed(model: PreTrainedModel, batch_size: int, max_cache_length: int) -> None:
    """Refuses batched decoding where holes in the cache would change the target's attention.

    Args:
        model: The target.
        batch_size: Rows decoded together (holes only appear with more than one).
        max_cache_length: The most entries the cache can reach, holes included.

    Raises:
        ValueError: ``batch_size > 1`` with linear-attention (or other non-softmax) layers, or
            with sliding-window layers whose window is shorter than ``max_cache_length``.
    """
    if batch_size == 1:
        return
    text_config = model.config.get_text_config()
    layer_types = set(getattr(text_config, "layer_types", None) or [])
    window = getattr(text_config, "sliding_window", None)
    sliding = window is not None and (not layer_types or "sliding_attention" in layer_types)
    other = sorted(layer_types - {"full_attention", "sliding_attention"})
    if other or (sliding and max_cache_length > window):
        found = f"layer types {other}" if other else f"a sliding window of {window} tokens"
        raise ValueError(
            f"batched DSpark decoding of {type(model).__name__} is not supported: it has {found}, and rows that "
            f"accept different numbers of drafts leave holes in the shared cache (up to {max_cache_length} "
            "entries here) that would change its attention. Generate one prompt at a time (batch size 1)."
        )


def crop_cache(cache: Cache, length: int) -> None:
    """Removes every cached token after the first ``length`` (the same call on every 5.x release)."""
    num_removed = cache.get_seq_length() - length
    if num_removed < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}: it is shorter.")
    if num_removed > 0:
        cache.crop(-num_removed)


def target_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    cache: Cache,
    cache_kwarg: str,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    num_logits: int,
) -> torch.Tensor:
    """Runs the target on new tokens after the cached ones and returns their last logits.

    Args:
        model: The target.
        input_ids: ``[B, T]`` new tokens.
        cache: Extended in place by ``T`` tokens.
        cache_kwarg: :func:`cache_kwarg_name` of the model.
        attention_mask: ``[B, C + T]``, 1 for real tokens, 0 for padding and holes.
        position_ids: ``[B, T]`` absolute positions of the new tokens.
        num_logits: How many of the last positions to return logits for.

    Returns:
        ``[B, num_logits, V]`` logits in the model's dtype, on the device of ``input_ids``.
    """
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=num_logits,
        **{cache_kwarg: cache},
    )
    return outputs.logits[:, -num_logits:].to(input_ids.device)  # the LM head may sit on another device


class FeatureTap:
    """Captures the outputs of chosen decoder layers of the target on every forward, by hooks.

    Use as a context manager (hooks are removed on exit). After each target forward,
    :meth:`take` returns the concatenated outputs of that forward.

    Args:
        model: The target; its decoder layers are ``model.get_decoder().layers``.
        layer_ids: 0-based decoder layers whose raw outputs (before the final norm) to keep.
        device: Where the features go (the head's device; layers may sit on other devices).
    """

    def __init__(self, model: PreTrainedModel, layer_ids: list[int], device: torch.device):
        layers = getattr(model.get_decoder(), "layers", None)
        if not isinstance(layers, nn.ModuleList) or max(layer_ids) >= len(layers):
            found = "no decoder layers" if layers is None else f"{len(layers)} decoder layers"
            raise ValueError(
                f"cannot tap layers {layer_ids} of {type(model).__name__}: found {found} at "
                "model.get_decoder().layers; expected a decoder-only Transformers model with those layers."
            )
        self._layers = [layers[i] for i in layer_ids]
        self._device = device
        self._outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> FeatureTap:
        for slot, layer in enumerate(self._layers):
            self._handles.append(layer.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, slot: int) -> Callable[[nn.Module, Any, Any], None]:
        def store(module: nn.Module, args: Any, output: Any) -> None:
            self._outputs[slot] = output[0] if isinstance(output, tuple) else output

        return store

    def take(self) -> torch.Tensor:
        """Returns ``[B, T, m·H]``: the tapped outputs of the last forward, in tap order."""
        if any(output is None for output in self._outputs):
            raise RuntimeError("no target forward ran since the last take(); the tap has nothing to return")
        features = torch.cat([output.to(self._device) for output in self._outputs], dim=-1)
        self._outputs = [None] * len(self._outputs)
        return features
