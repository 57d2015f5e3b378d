"""The target side of the loop: its verification forward, its tapped features, and cache holes.

The batch shares one cache length. Rows that accept fewer tokens than others leave *holes* in the
cache: the entries stay, and the loop's 2-D attention mask marks them 0, so later queries never
see them. Positions are passed explicitly, so a hole does not shift any row's positions. Holes do
shift a sliding window (it counts cache entries) and would enter a linear-attention state, so
:func:`check_holes_allowed` refuses batches of such targets unless the window can never slide.

Hidden states of the tapped layers are captured by forward hooks (:class:`FeatureTap`) rather than
``output_hidden_states``, whose list form changed meaning between releases and which would keep
every layer. A tap belongs to one generation: its hooks record only the forwards of the thread that
entered it, so threads generating on one shared target each see their own features. What differs
between Transformers releases (the cache keyword, cache rollback) lives in :mod:`spark_generate.hf`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Cache, PreTrainedModel

__all__ = ["FeatureTap", "check_holes_allowed", "target_forward"]


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
    """Captures the hidden states of chosen target layers on every forward, by hooks.

    Use as a context manager (hooks are removed on exit). After each target forward in the thread
    that entered the tap, :meth:`take` returns the concatenated features of that forward; forwards
    of other threads (other generations on the same target) pass unrecorded.

    Layer ids follow :class:`~spark_generate.config.DSparkConfig`'s ``target_layer_ids``: id
    ``l >= 0`` is the raw output of decoder layer ``l`` (before the final norm), i.e.
    ``hidden_states[l + 1]`` of a Transformers forward with ``output_hidden_states=True``; id ``-1``
    (DeepSpec's) is the embedding output, i.e. the input of decoder layer 0, ``hidden_states[0]``
    (a pre-hook on layer 0 reads it, so model-specific embedding scaling is included). Python's
    negative indexing never applies: ``-1`` does not mean the last layer.

    Args:
        model: The target; its decoder layers are ``model.get_decoder().layers``.
        layer_ids: Ids in ``[-1, num_layers)``, as above; features come in this order.
        device: Where the features go (the head's device; layers may sit on other devices).

    Raises:
        ValueError: The model has no ``get_decoder().layers``, or an id is outside ``[-1, num_layers)``.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: list[int], device: torch.device):
        layers = getattr(model.get_decoder(), "layers", None)
        layer_ids = [int(layer_id) for layer_id in layer_ids]
        if not isinstance(layers, nn.ModuleList) or not layers:
            found = "an empty nn.ModuleList" if isinstance(layers, nn.ModuleList) else "no nn.ModuleList"
            raise ValueError(
                f"cannot tap layers {layer_ids} of {type(model).__name__}: found {found} at "
                "model.get_decoder().layers; expected a decoder-only Transformers model with those layers."
            )
        bad = [layer_id for layer_id in layer_ids if not -1 <= layer_id < len(layers)]
        if not layer_ids or bad:
            raise ValueError(
                f"cannot tap layers {layer_ids} of {type(model).__name__}: "
                + (f"ids {bad} are" if bad else "no id is")
                + f" in [-1, {len(layers)}) for its {len(layers)} decoder layers (-1 is the embedding "
                "output, l >= 0 the output of decoder layer l); give at least one id in that range."
            )
        self._layer_ids = layer_ids
        self._layers = layers
        self._device = device
        self._outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._thread: int | None = None

    def __enter__(self) -> FeatureTap:
        self._thread = threading.get_ident()
        for slot, layer_id in enumerate(self._layer_ids):
            if layer_id == -1:  # the embedding output: what decoder layer 0 receives
                handle = self._layers[0].register_forward_pre_hook(self._pre_hook(slot), with_kwargs=True)
            else:
                handle = self._layers[layer_id].register_forward_hook(self._hook(slot))
            self._handles.append(handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, slot: int) -> Callable[[nn.Module, Any, Any], None]:
        def store(module: nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() == self._thread:
                self._outputs[slot] = output[0] if isinstance(output, tuple) else output

        return store

    def _pre_hook(self, slot: int) -> Callable[[nn.Module, Any, dict[str, Any]], None]:
        def store(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            if threading.get_ident() == self._thread:
                self._outputs[slot] = args[0] if args else kwargs["hidden_states"]

        return store

    def take(self) -> torch.Tensor:
        """Returns ``[B, T, m·H]``: the tapped features of the last forward, in tap order."""
        if any(output is None for output in self._outputs):
            raise RuntimeError("no target forward ran since the last take(); the tap has nothing to return")
        features = torch.cat([output.to(self._device) for output in self._outputs], dim=-1)
        self._outputs = [None] * len(self._outputs)
        return features
