"""The DFlash backbone of a DSpark head: Qwen3 decoder layers with KV injection of target features.

The target's tapped hidden states are fused once (``fc`` then ``hidden_norm``, in
:class:`~spark_generate.heads.DSparkHead`) into context features ``C``, one row per target position.
Each draft layer projects ``C`` with its *own* ``k_proj``/``v_proj`` and attends, from the block
queries only, jointly over ``[context rows ; block rows]`` (DSpark, arXiv 2607.05147, eq. 3)::

    Ẑ = input_layernorm(Z)                           Z: block states [B, N·K, H]
    Q = RoPE(q_norm(W_Q Ẑ))                          at block positions p + k
    K = RoPE(k_norm([W_K C ; W_K Ẑ]))                context rows at their own positions
    V = [W_V C ; W_V Ẑ]
    Z = Z + W_O softmax(Q Kᵀ / √d_head + M) V
    Z = Z + MLP(post_attention_layernorm(Z))

Context rows are never queries: they only supply keys and values. The mask ``M``
(:func:`block_attention_mask`) lets a block of anchor position ``p`` see context rows of positions
``j < p`` and its own ``K`` slots (bidirectionally), never another block. At inference a
:class:`DraftKVCache` keeps the projected context rows of every layer across rounds, so each round
passes only the *new* context rows; block rows never enter the cache, which is exactly the
"append, then crop back to the anchor" of the reference implementations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_layers import GradientCheckpointingLayer

from spark_generate.hf import Qwen3MLP, Qwen3RMSNorm, rotate_half


class DraftKVCache:
    """Projected context keys and values of every draft layer, kept across drafting rounds.

    Only context rows are stored (block rows are recomputed each round), so after a draft forward
    the cache already ends at the anchor. :meth:`crop` rolls it back further, e.g. when the
    generation loop rewinds.

    Attributes:
        keys: Per layer, ``[B, num_kv_heads, C, head_dim]`` (after ``k_norm`` and RoPE).
        values: Per layer, ``[B, num_kv_heads, C, head_dim]``.
        positions: ``[B, C]`` absolute positions of the cached context rows.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None

    @property
    def num_context_rows(self) -> int:
        """Number of cached context rows ``C``."""
        return 0 if self.positions is None else self.positions.shape[1]

    def append_positions(self, new_positions: torch.Tensor) -> torch.Tensor:
        """Appends ``[B, C_new]`` positions and returns all ``[B, C]`` cached positions."""
        self.positions = new_positions if self.positions is None else torch.cat([self.positions, new_positions], 1)
        return self.positions

    def update(
        self, layer_idx: int, new_keys: torch.Tensor, new_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends a layer's new context rows (``[B, n_kv, C_new, d_head]``) and returns all of them."""
        old_keys, old_values = self.keys[layer_idx], self.values[layer_idx]
        if old_keys is not None and old_values is not None:
            new_keys = torch.cat([old_keys, new_keys], dim=2)
            new_values = torch.cat([old_values, new_values], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = new_keys, new_values
        return new_keys, new_values

    def crop(self, num_context_rows: int) -> None:
        """Keeps only the first ``num_context_rows`` context rows of every layer.

        Raises:
            ValueError: If more rows are asked for than the cache holds.
        """
        if not 0 <= num_context_rows <= self.num_context_rows:
            raise ValueError(
                f"cannot crop the draft cache to {num_context_rows} rows: it holds {self.num_context_rows}; "
                "expected 0 <= num_context_rows <= num_context_rows held"
            )
        for layer_idx, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            if keys is not None and values is not None:
                self.keys[layer_idx] = keys[:, :, :num_context_rows]
                self.values[layer_idx] = values[:, :, :num_context_rows]
        if self.positions is not None:
            self.positions = self.positions[:, :num_context_rows]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keeps only the given batch rows (``[R]`` int64 indices), e.g. when finished rows leave the batch."""
        self.keys = [None if keys is None else keys[rows] for keys in self.keys]
        self.values = [None if values is None else values[rows] for values in self.values]
        if self.positions is not None:
            self.positions = self.positions[rows]


def block_attention_mask(
    context_positions: torch.Tensor, anchor_positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Builds the DSpark attention mask of block queries over ``[context rows ; block rows]``.

    Block ``n`` (anchor at position ``p_n``) sees context row ``j`` iff its position is ``< p_n``,
    and all ``K`` slots of its own block; it never sees another block.

    Example (one context of positions 0..3, anchors at 2 and 4, ``K = 2``; rows are queries)::

        ctx 0 1 2 3 | block0 | block1
        b0  1 1 0 0 |  1 1   |  0 0
        b0  1 1 0 0 |  1 1   |  0 0
        b1  1 1 1 1 |  0 0   |  1 1
        b1  1 1 1 1 |  0 0   |  1 1

    Args:
        context_positions: ``[B, C]`` positions of the context rows.
        anchor_positions: ``[B, N]`` anchor position of each block.
        block_size: ``K``.

    Returns:
        ``[B, N·K, C + N·K]`` bool, True where attention is allowed.
    """
    queries_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [B, N·K]
    sees_context = context_positions[:, None, :] < queries_anchor[:, :, None]  # [B, N·K, C]
    num_blocks = anchor_positions.shape[1]
    block_ids = torch.arange(num_blocks, device=anchor_positions.device).repeat_interleave(block_size)
    sees_block = block_ids[:, None] == block_ids[None, :]  # [N·K, N·K]
    sees_block = sees_block.expand(anchor_positions.shape[0], -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)


def _apply_rope(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``[B, heads, S, d_head]`` states by ``[B, S, d_head]`` cos/sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return states * cos + rotate_half(states) * sin


class DSparkAttention(nn.Module):
    """Qwen3 attention whose keys and values also cover the injected context rows."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _keys_values(
        self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*states.shape[:2], self.num_kv_heads, self.head_dim)
        keys = self.k_norm(self.k_proj(states).view(shape)).transpose(1, 2)
        values = self.v_proj(states).view(shape).transpose(1, 2)
        return _apply_rope(keys, cos, sin), values

    def forward(
        self,
        block_states: torch.Tensor,
        context_features: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        draft_cache: DraftKVCache | None,
    ) -> torch.Tensor:
        """Attends from the block over ``[context ; block]``.

        Args:
            block_states: ``[B, Q, H]`` normed block states (``Q = N·K``).
            context_features: ``[B, C_new, H]`` fused target features of the new context rows.
            rope: cos and sin, each ``[B, C_new + Q, d_head]``, context positions first.
            attention_mask: ``[B, Q, C + Q]`` bool, ``C`` counting cached rows too.
            draft_cache: Receives the new context rows' keys and values, or None.

        Returns:
            ``[B, Q, H]`` attention output after ``o_proj``.
        """
        num_new = context_features.shape[1]
        cos, sin = rope
        batch, num_queries, _ = block_states.shape
        queries = self.q_norm(self.q_proj(block_states).view(batch, num_queries, self.num_heads, self.head_dim))
        queries = _apply_rope(queries.transpose(1, 2), cos[:, num_new:], sin[:, num_new:])
        context_keys, context_values = self._keys_values(context_features, cos[:, :num_new], sin[:, :num_new])
        if draft_cache is not None:
            context_keys, context_values = draft_cache.update(self.layer_idx, context_keys, context_values)
        block_keys, block_values = self._keys_values(block_states, cos[:, num_new:], sin[:, num_new:])
        keys = torch.cat([context_keys, block_keys], dim=2)
        values = torch.cat([context_values, block_values], dim=2)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attention_mask.unsqueeze(1), enable_gqa=True
        )
        return self.o_proj(attended.transpose(1, 2).reshape(batch, num_queries, -1))


class DSparkDecoderLayer(GradientCheckpointingLayer):
    """One draft layer: pre-norm KV-injection attention and a SwiGLU MLP, with residuals."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DSparkAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        block_states: torch.Tensor,
        context_features: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        draft_cache: DraftKVCache | None = None,
    ) -> torch.Tensor:
        """Runs the layer; arguments as in :meth:`DSparkAttention.forward`. Returns ``[B, Q, H]``."""
        attended = self.self_attn(
            self.input_layernorm(block_states), context_features, rope, attention_mask, draft_cache
        )
        block_states = block_states + attended
        return block_states + self.mlp(self.post_attention_layernorm(block_states))
