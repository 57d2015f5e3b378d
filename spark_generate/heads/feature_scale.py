"""Training ``fc`` on normalised target features, while every saved head stays a plain speculators head.

The tapped features a head reads are far from normalised. On SmolLM2-135M, for instance, the taps'
per-position RMS grows from about 3 to 25 with depth, one channel carries values of several
hundred at every position, and the first token's features are a hundred times larger than the
rest. ``fc`` mixes all of them before ``hidden_norm``, so a few massive channels set the direction
of every fused row, and gradient steps of equal size move the small channels' weights hundreds of
times too little. Scaling each input channel to unit RMS is the usual cure, but the speculators
format (and so vLLM) has no place for a scale: ``fc.weight`` must act on the raw features.

The two are reconciled by a reparametrisation. :func:`scale_fc_inputs` makes ``fc.weight`` a
computed tensor::

    fc.weight = W · diag(s)          W: the trained parameter, s: a fixed per-channel scale

so ``fc(x) = W (s ⊙ x)``: the optimizer trains ``W`` exactly as it would train a layer fed the
scaled features ``s ⊙ x``, and the forward pass already uses the product. :func:`export_state_dict`
writes that product as ``fc.weight``. A head therefore computes the same logits before and after
saving, in spark_generate and in speculators, because the saved weight *is* the weight it ran with.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["ChannelScale", "export_state_dict", "fc_input_scale", "scale_fc_inputs"]


class ChannelScale(nn.Module):
    """The parametrisation ``W -> W · diag(scale)`` of a linear layer's weight.

    Args:
        scale: ``[in_features]`` positive scale of each input channel.
    """

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        """``[out, in] -> [out, in]``: column ``c`` multiplied by ``scale[c]``."""
        return weight * self.scale.to(weight.dtype)


def fc_input_scale(fc: nn.Linear) -> torch.Tensor | None:
    """The ``[in_features]`` scale ``fc`` was reparametrised with, or None."""
    if not parametrize.is_parametrized(fc, "weight"):
        return None
    return next(p.scale for p in fc.parametrizations.weight if isinstance(p, ChannelScale))


def scale_fc_inputs(fc: nn.Linear, scale: torch.Tensor) -> None:
    """Reparametrises ``fc.weight`` as ``W · diag(scale)``, ``W`` the current weight.

    The current weight thus becomes the weight of a layer that reads scaled features: call this on
    an untrained head, so that its initialisation applies to unit-RMS inputs.

    Args:
        fc: The head's feature projection (``[H, m·H]`` weight).
        scale: ``[m·H]`` finite positive scales, e.g. one over each channel's RMS.

    Raises:
        ValueError: If ``fc`` is already reparametrised, or ``scale`` has the wrong shape or a
            non-finite or non-positive entry.
    """
    if fc_input_scale(fc) is not None:
        raise ValueError("fc is already trained on scaled features: scale_fc_inputs may be applied once per head.")
    scale = torch.as_tensor(scale, dtype=torch.float32, device=fc.weight.device)
    if scale.shape != (fc.in_features,) or not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ValueError(
            f"scale has shape {tuple(scale.shape)} (min {scale.min().item():.3g}): expected {fc.in_features} finite "
            "positive values, one per input channel of fc (the head's tapped features, m·H)."
        )
    parametrize.register_parametrization(fc, "weight", ChannelScale(scale))


def export_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every reparametrised weight written as the weight it computes.

    For a head trained with :func:`scale_fc_inputs`, ``fc.weight`` is ``W · diag(scale)`` and the
    parametrisation's own entries (``W`` and ``scale``) are left out: the result loads into a head
    that has no parametrisation, and into speculators.
    """
    state = {}
    for name, tensor in module.state_dict().items():
        owner, marker, rest = name.partition(".parametrizations.")
        if not marker:
            state[name] = tensor
        elif rest.endswith(".original"):  # the parametrised tensor, in the place of its parameter
            tensor_name = rest.removesuffix(".original")
            state[f"{owner}.{tensor_name}"] = getattr(module.get_submodule(owner), tensor_name).detach()
    return state
