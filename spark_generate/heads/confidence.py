"""The confidence head: one logit per draft token estimating that it survives verification.

``z_k = w·[h_k ; W1[x_{k-1}]] + b`` (paper eq. 7), a ``Linear(H (+ r) -> 1)`` with bias; the Markov
embedding is included when ``confidence_head_with_markov`` is set. The head returns the logit
``z_k``; ``σ(z_k / T_k)`` (with optional calibration temperatures) is the scheduler's business.
``c_k`` estimates the *conditional* probability that draft token ``k`` is accepted given that the
tokens before it were. It runs in float32 whatever the dtype of the backbone, as in DeepSpec.
"""

from __future__ import annotations

import torch
from torch import nn


class ConfidenceHead(nn.Module):
    """``Linear(in_features -> 1)`` with bias, computed in float32.

    Args:
        in_features: ``H``, or ``H + r`` when the head reads the Markov embedding.
    """

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, draft_hidden: torch.Tensor, prev_embeddings: torch.Tensor | None) -> torch.Tensor:
        """Computes confidence logits.

        Args:
            draft_hidden: ``[*, H]`` backbone hidden states ``h_k``.
            prev_embeddings: ``[*, r]`` Markov embeddings ``W1[x_{k-1}]``, or None.

        Returns:
            ``[*]`` float32 logits.
        """
        features = draft_hidden if prev_embeddings is None else torch.cat([draft_hidden, prev_embeddings], -1)
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1).float()
