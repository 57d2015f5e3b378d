"""`DSparkHead`: the draft model users download, attach to their target, and draft blocks with.

One drafting round of the generation loop reads, top to bottom::

    features = head.select_target_features(target_out.hidden_states)      # [B, C_new, m·H]
    out = head(head.block_input_ids(anchor_ids), anchor_positions,         # one parallel pass
               target_hidden_states=features, draft_cache=cache)           # -> [B, 1, S, ·]
    prev, state = anchor_ids, out.first_markov_state(0)
    for j in range(head.config.num_draft_tokens):                          # the sequential stage
        step = head.draft_step(out.base_logits[:, 0, j], out.draft_hidden[:, 0, j], prev, state)
        draft_ids = <sample from step.draft_logits>                       # not the head's job
        prev, state = head.draft_to_target_ids(draft_ids), step.markov_state

The head is deterministic: it returns logits, never samples. The target's embedding and LM head
are *referenced* from the live target by :meth:`DSparkHead.attach` (never copied, never saved);
only a reduced-vocabulary LM head (``V_d < V`` rows, required by the speculators format) is owned
and saved, with the ``t2d``/``d2t`` maps. Draft token ``j`` (``S = num_draft_tokens`` of them) comes
from backbone slot ``j`` when ``sample_from_anchor`` else slot ``j + 1``; its Markov predecessor is
always block token ``j`` (the anchor for ``j = 0``), so training predecessors are
``block_token_ids[..., :S]`` in both conventions. In the second convention an ``rnn`` Markov head
also steps over the anchor slot, so the first draft token starts from the state
``out.markov_state`` rather than from zero (see :mod:`spark_generate.heads.markov`).

Block tokens are embedded as the *raw rows* of the target's input-embedding table, and the base
logits are the target LM head's raw output: for Gemma-family targets, neither the ``sqrt(H)``
embedding scale nor the final-logit soft-cap is applied. This is what the two runtimes of the
speculators ``"dspark"`` format compute, and they agree: speculators trains on a copy of the
verifier's ``embed_tokens.weight`` and ``lm_head(norm(h))``; vLLM's DSpark and DFlash drafters
(``qwen3_dspark.py``, ``qwen3_dflash.py``) share the target's ``VocabParallelEmbedding`` module,
a plain lookup (its Gemma models apply the ``sqrt(H)`` normalizer in the model's forward, outside
that module), and compute draft logits with a ``LogitsProcessor`` that has no soft-cap. A head
that scaled or capped would therefore draft differently once served. (DeepSpec's Gemma-4 drafter
applies both, but it also uses Gemma-4 decoder layers: it is a different model, not read here.)
The soft-cap still matters for training, since the *target's* distribution is capped; the trainer
applies it to the target logits it supervises with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from spark_generate.config import DSparkConfig, DSparkConfigError
from spark_generate.heads.backbone import DraftKVCache, DSparkDecoderLayer, block_attention_mask
from spark_generate.heads.confidence import ConfidenceHead
from spark_generate.heads.feature_scale import export_state_dict, fc_input_scale, scale_fc_inputs
from spark_generate.heads.hub_io import DSparkHubMixin
from spark_generate.heads.markov import MarkovHead, MarkovStep
from spark_generate.hf import Qwen3RMSNorm, Qwen3RotaryEmbedding


@dataclass(frozen=True)
class DSparkBackboneOutput:
    """The parallel pass over ``N`` blocks of ``K`` slots, restricted to the ``S`` drafting slots.

    Attributes:
        draft_hidden: ``[B, N, S, H]`` final-normed hidden states ``h``.
        base_logits: ``[B, N, S, V_d]`` backbone logits ``U``.
        markov_state: ``[B, N, r]`` the ``rnn`` state the first draft token of each block starts
            from, when the recurrence has stepped over a non-drafting anchor slot (``rnn`` head,
            ``sample_from_anchor=False``); None otherwise (the zero state).
    """

    draft_hidden: torch.Tensor
    base_logits: torch.Tensor
    markov_state: torch.Tensor | None = None

    def first_markov_state(self, block: int) -> torch.Tensor | None:
        """The ``[B, r]`` state to pass to :meth:`DSparkHead.draft_step` for draft token 0 of ``block``."""
        return None if self.markov_state is None else self.markov_state[:, block]


@dataclass(frozen=True)
class DraftStep:
    """The logits one draft token is sampled from, for every sequence of the batch.

    Attributes:
        draft_logits: ``[B, V_d]`` ``U_k + b_k``.
        confidence_logits: ``[B]`` float32, or None without a confidence head.
        markov_state: ``[B, r]`` to pass to the next step (``rnn`` head), else None.
    """

    draft_logits: torch.Tensor
    confidence_logits: torch.Tensor | None
    markov_state: torch.Tensor | None


@dataclass(frozen=True)
class DraftBlockLogits:
    """Teacher-forced logits of whole blocks (training and evaluation).

    Attributes:
        draft_logits: ``[*, S, V_d]``.
        confidence_logits: ``[*, S]`` float32, or None without a confidence head.
    """

    draft_logits: torch.Tensor
    confidence_logits: torch.Tensor | None


@dataclass(frozen=True)
class _TargetModules:
    """References to the live target's modules; a plain object, so they are not registered."""

    embed_tokens: nn.Module
    lm_head: nn.Module


class DSparkHead(DSparkHubMixin):
    """DSpark draft head: DFlash backbone, Markov head and confidence head (arXiv 2607.05147).

    Weight names are those of the speculators ``"dspark"`` format: ``fc``, ``hidden_norm``,
    ``layers.{i}.*``, ``norm``, ``markov_head.*``, ``confidence_head.proj``, and with a reduced
    vocabulary ``lm_head``, ``t2d``, ``d2t``.

    Args:
        config: The head's configuration.
    """

    config_class = DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "block_input_ids"
    _no_split_modules: ClassVar[list[str]] = ["DSparkDecoderLayer"]
    supports_gradient_checkpointing = True

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        for field in ("target_layer_ids", "mask_token_id"):
            if getattr(config, field) is None:
                raise DSparkConfigError(
                    f"{field}=None is invalid for building a head: expected a value. "
                    "Use DSparkHead.from_target(target), which chooses it."
                )
        layer_config = config.transformer_layer_config
        hidden = layer_config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=layer_config.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(layer_config, i) for i in range(config.num_draft_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=layer_config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(layer_config)
        self.markov_head = None
        if config.markov_rank > 0:
            self.markov_head = MarkovHead(
                target_vocab_size=config.target_vocab_size,
                draft_vocab_size=config.draft_vocab_size,
                markov_rank=config.markov_rank,
                hidden_size=hidden,
                head_type=config.markov_head_type,
            )
        self.confidence_head = None
        if config.enable_confidence_head:
            markov_features = config.markov_rank if config.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(hidden + markov_features)
        self.lm_head = None
        if self.has_reduced_vocab:
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False).requires_grad_(False)
            self.register_buffer("t2d", torch.arange(config.target_vocab_size) < config.draft_vocab_size)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self._target: _TargetModules | None = None
        # The last copy made by for_drafting, with what it was made for and from (see there).
        self._drafting_copy: tuple[tuple[Any, ...], DSparkHead] | None = None
        self.post_init()

    @property
    def has_reduced_vocab(self) -> bool:
        """Whether the draft vocabulary is a strict subset of the target's (``V_d < V``)."""
        return self.config.draft_vocab_size < self.config.target_vocab_size

    # ----------------------------------------------------------------------------------- building

    @classmethod
    def from_target(
        cls,
        target_model: PreTrainedModel,
        *,
        draft_vocab_ids: torch.Tensor | None = None,
        **config_overrides: Any,
    ) -> DSparkHead:
        """Builds an untrained head sized for any Transformers causal LM, attached to it.

        Args:
            target_model: The target (verifier) model.
            draft_vocab_ids: ``[V_d]`` target ids forming a reduced draft vocabulary (e.g. the
                most frequent tokens of the training data); default: ids ``0 .. V_d - 1`` when
                ``draft_vocab_size`` is given.
            **config_overrides: :meth:`DSparkConfig.for_target` arguments and config fields:
                ``block_size``, ``num_draft_layers``, ``markov_rank``, ``markov_head_type``,
                ``target_layer_ids``, ``draft_vocab_size``, ``mask_token_id``, ...

        Returns:
            The head, attached to ``target_model``, in the target's dtype and on its device.
        """
        if draft_vocab_ids is not None:
            config_overrides.setdefault("draft_vocab_size", len(draft_vocab_ids))
        if not target_model.config.architectures:
            config_overrides.setdefault("verifier_architectures", [type(target_model).__name__])
        config = DSparkConfig.for_target(target_model.config, **config_overrides)
        head = cls(config).attach(target_model)
        if head.has_reduced_vocab:
            head.set_draft_vocab(draft_vocab_ids if draft_vocab_ids is not None else torch.arange(len(head.d2t)))
        parameter = next(target_model.parameters())
        return head.to(device=parameter.device, dtype=parameter.dtype)

    def attach(self, target_model: PreTrainedModel) -> DSparkHead:
        """References the target's embedding and LM head (no copy), after checking compatibility.

        Raises:
            DSparkConfigError: If the target does not match the head (vocabulary, hidden size,
                number of layers, tap layers); a differing verifier name only warns.
        """
        self.config.check_target(target_model.config, target_name=target_model.config.name_or_path or None)
        lm_head = target_model.get_output_embeddings()
        if lm_head is None:
            raise DSparkConfigError(
                f"{type(target_model).__name__} has no output embeddings: expected a causal LM "
                "(a *ForCausalLM model). Load the target with AutoModelForCausalLM."
            )
        self._target = _TargetModules(target_model.get_input_embeddings(), lm_head)
        return self

    def for_drafting(self, target_model: PreTrainedModel) -> DSparkHead:
        """The head that drafts for ``target_model``: this one, attached, or an attached copy in the target's dtype.

        Generation drafts in the floating dtype of the target's LM head, however the head was passed
        (a folder, a Hub id or a :class:`DSparkHead`), so the same head drafts the same tokens every
        way. A head already in that dtype (or next to a target whose LM head is not floating point,
        e.g. quantized) is returned as is. Any other head is **not modified**: the copy is rebuilt
        from its saved form (feature scale folded, as :meth:`save_pretrained` writes it) and cast
        like ``from_pretrained(folder, dtype=...)`` casts (the confidence head stays float32), so it
        equals the head loaded in the target's dtype; it keeps :attr:`sts_temperatures` and sits on
        this head's device. The copy is kept for the next call while this head's weights stay the
        same: each call compares a fingerprint of them (data pointers, version counters and an
        integer sum of their bits, so a change through ``.data`` counts too) and builds a new copy
        when it differs. Load the head in the target's dtype to draft without a copy:
        ``DSparkHead.from_pretrained(folder, dtype=target.dtype)``.

        Raises:
            DSparkConfigError: If the target does not match the head (see :meth:`attach`).
        """
        self.attach(target_model)
        dtype = self._require_target().lm_head.weight.dtype
        if not dtype.is_floating_point or dtype == self.fc.weight.dtype:
            return self
        key = (dtype, self.fc.weight.device, _fingerprint(self), self.sts_temperatures)
        cached = self._drafting_copy
        if cached is not None and _same_key(cached[0], key):
            return cached[1].attach(target_model)
        with torch.random.fork_rng(devices=[]):  # building a head draws a random initialization: leave no trace
            head = type(self)(self.config)
        head.load_state_dict(export_state_dict(self))
        head._place(dtype=dtype, device=self.fc.weight.device)
        head.sts_temperatures = self.sts_temperatures
        self._drafting_copy = (key, head)
        return head.attach(target_model).eval()

    def set_draft_vocab(self, draft_vocab_ids: torch.Tensor) -> None:
        """Sets a reduced draft vocabulary: ``t2d``, ``d2t`` and the LM head rows (from the target).

        Args:
            draft_vocab_ids: ``[V_d]`` distinct target ids; they are sorted (draft ids ascend).
        """
        ids = torch.as_tensor(draft_vocab_ids, dtype=torch.long, device=self.d2t.device).sort().values
        vocab_size = self.config.target_vocab_size
        if ids.shape != self.d2t.shape or ids.unique().numel() != len(ids) or ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(
                f"draft_vocab_ids has {ids.numel()} entries ({ids.unique().numel()} distinct, in "
                f"[{ids.min()}, {ids.max()}]): expected {len(self.d2t)} distinct target ids "
                f"in [0, {vocab_size})"
            )
        self.t2d.zero_()
        self.t2d[ids] = True
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        with torch.no_grad():
            self.lm_head.weight.copy_(self._require_target().lm_head.weight[ids])

    def scale_target_features(self, scale: torch.Tensor) -> None:
        """Trains ``fc`` on features scaled per channel; saved heads hold the folded weight.

        ``fc.weight`` becomes ``W · diag(scale)`` with ``W`` the current weight (see
        :mod:`spark_generate.heads.feature_scale`): call it on an untrained head, with e.g. one over
        each channel's RMS on the training data, before training.

        Args:
            scale: ``[m·H]`` finite positive scale of each tapped feature channel.
        """
        scale_fc_inputs(self.fc, scale)

    @property
    def target_feature_scale(self) -> torch.Tensor | None:
        """``[m·H]`` the scale ``fc`` trains with (:meth:`scale_target_features`), or None."""
        return fc_input_scale(self.fc)

    def _require_target(self) -> _TargetModules:
        if self._target is None:
            raise RuntimeError(
                "this DSpark head is not attached to a target: call head.attach(target_model) first "
                "(the head uses the target's embedding and LM head)"
            )
        return self._target

    # ------------------------------------------------------------------------------ vocabularies

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Maps draft-vocabulary ids to target ids (``id + d2t[id]``; identity for a full vocab)."""
        return draft_ids + self.d2t[draft_ids] if self.has_reduced_vocab else draft_ids

    def target_to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Maps target ids to draft ids through ``t2d``; -1 for tokens outside the draft vocab."""
        if not self.has_reduced_vocab:
            return target_ids
        lookup = (self.t2d.long().cumsum(0) - 1).masked_fill(~self.t2d, -1)
        return lookup[target_ids]

    # ------------------------------------------------------------------------------- backbone

    def new_draft_cache(self) -> DraftKVCache:
        """An empty draft KV cache for one generation (see :class:`DraftKVCache`)."""
        return DraftKVCache(self.config.num_draft_layers)

    def block_input_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Builds ``[B, 1, K]`` block inputs ``[anchor, MASK, ..., MASK]`` from ``[B]`` anchor ids."""
        block = torch.full(
            (anchor_ids.shape[0], 1, self.config.block_size),
            self.config.mask_token_id,
            device=anchor_ids.device,
        )
        block[:, 0, 0] = anchor_ids
        return block

    def select_target_features(self, target_hidden_states: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """Concatenates the tapped layers from a Transformers ``hidden_states`` tuple.

        Args:
            target_hidden_states: ``L + 1`` tensors ``[B, T, H]`` (slot 0 = embeddings); slots that
                are not tapped may be None, as with ``output_hidden_states=[l + 1 for l in ids]``
                on transformers >= 5.23 (5.18 to 5.22 read such a list as layer indices and drop
                the embeddings slot, which this method does not accept).

        Returns:
            ``[B, T, m·H]``: ``hidden_states[l + 1]`` for each tap ``l``, in order.
        """
        num_layers = len(target_hidden_states) - 1
        if self.config.target_layer_ids[-1] >= num_layers - 1:
            raise DSparkConfigError(
                f"target_layer_ids={self.config.target_layer_ids} need raw layer outputs below layer "
                f"{num_layers - 1} of this {num_layers}-layer target (its last slot is final-normed)"
            )
        return torch.cat([target_hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    def fuse_target_features(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """Fuses tapped features into context features ``C = hidden_norm(fc(x))``.

        Shapes: ``[B, T, m·H] -> [B, T, H]``.

        Computing ``C`` is the first step of :meth:`forward`; it is exposed for training caches.
        """
        return self.hidden_norm(self.fc(target_hidden_states.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_input_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        target_hidden_states: torch.Tensor | None = None,
        context_position_ids: torch.Tensor | None = None,
        draft_cache: DraftKVCache | None = None,
    ) -> DSparkBackboneOutput:
        """Runs the backbone over ``N`` blocks per sequence in one parallel pass.

        Args:
            block_input_ids: ``[B, N, K]`` target ids, ``[anchor, MASK, ...]`` per block.
            anchor_positions: ``[B, N]`` absolute position ``p`` of each anchor.
            target_hidden_states: ``[B, C_new, m·H]`` tapped target features of the *new*
                context rows (all rows when there is no cache), or None.
            context_position_ids: ``[B, C_new]`` their positions; default: consecutive, after the
                rows already in ``draft_cache`` (or from 0).
            draft_cache: Keeps context rows across rounds (inference); block rows never enter it.

        Returns:
            Hidden states and base logits of the drafting slots, and for an ``rnn`` head with
            ``sample_from_anchor=False`` the Markov state after the anchor slot.
        """
        target = self._require_target()
        batch, num_blocks, block_size = block_input_ids.shape
        if block_size != self.config.block_size:
            raise ValueError(f"block_input_ids has {block_size} slots per block, expected {self.config.block_size}")
        if target_hidden_states is None:
            target_hidden_states = self.fc.weight.new_zeros(batch, 0, self.fc.in_features)
        context_features = self.fuse_target_features(target_hidden_states)
        if context_position_ids is None:
            start = draft_cache.num_context_rows if draft_cache is not None else 0
            positions = torch.arange(start, start + context_features.shape[1], device=block_input_ids.device)
            context_position_ids = positions.expand(batch, -1)
        all_context_positions = context_position_ids
        if draft_cache is not None:
            all_context_positions = draft_cache.append_positions(context_position_ids)
        slots = torch.arange(block_size, device=block_input_ids.device)
        block_positions = (anchor_positions[..., None] + slots).reshape(batch, -1)
        mask = block_attention_mask(all_context_positions, anchor_positions, block_size)
        # Raw embedding rows, never the module's forward: Gemma's embedding module scales by
        # sqrt(H), which neither speculators nor vLLM apply to draft blocks (module docstring).
        # With a target split over devices (device_map), its embedding and LM head may live on
        # other devices than the head: bring their outputs to the head's device.
        embedding_table = target.embed_tokens.weight
        embeddings = F.embedding(block_input_ids.reshape(batch, -1).to(embedding_table.device), embedding_table)
        states = embeddings.to(self.fc.weight.device, self.fc.weight.dtype)
        rope = self.rotary_emb(states, torch.cat([context_position_ids, block_positions], dim=1))
        for layer in self.layers:
            states = layer(states, context_features, rope, mask, draft_cache)
        hidden = self.norm(states).view(batch, num_blocks, block_size, -1)
        if self.config.sample_from_anchor:
            return DSparkBackboneOutput(hidden, self.base_logits(hidden))
        markov_state = None
        if self._anchor_slot_advances_markov_state:
            markov_state = self.markov_head.advance(block_input_ids[..., 0], hidden[:, :, 0])
        draft_hidden = hidden[:, :, 1:]
        return DSparkBackboneOutput(draft_hidden, self.base_logits(draft_hidden), markov_state)

    def base_logits(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        """Backbone logits over the draft vocabulary, never soft-capped: ``[*, H] -> [*, V_d]``."""
        lm_head = self.lm_head if self.lm_head is not None else self._require_target().lm_head
        return lm_head(draft_hidden.to(lm_head.weight.dtype)).to(draft_hidden.device)

    # ------------------------------------------------------------------- Markov and confidence

    @property
    def _anchor_slot_advances_markov_state(self) -> bool:
        """Whether the first draft token's ``rnn`` state comes from the anchor slot (not zero)."""
        return (
            self.markov_head is not None and self.markov_head.head_type == "rnn" and not self.config.sample_from_anchor
        )

    def _check_markov_state(self, markov_state: torch.Tensor | None) -> None:
        if markov_state is None and self._anchor_slot_advances_markov_state:
            raise ValueError(
                "markov_state=None is invalid for an rnn Markov head with sample_from_anchor=False: the "
                "recurrence has already stepped over the anchor slot, so every draft token needs a state. "
                "Pass the backbone output's state for the first draft token (out.first_markov_state(n) to "
                "draft_step, out.markov_state to teacher_forced), then each step's markov_state."
            )

    def _correct(
        self, base_logits: torch.Tensor, draft_hidden: torch.Tensor, markov: MarkovStep | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        draft_logits = base_logits if markov is None else base_logits + markov.bias.to(base_logits.dtype)
        if self.confidence_head is None:
            return draft_logits, None
        markov_features = markov.prev_embeddings if self.config.confidence_head_with_markov else None
        return draft_logits, self.confidence_head(draft_hidden, markov_features)

    def draft_step(
        self,
        base_logits: torch.Tensor,
        draft_hidden: torch.Tensor,
        prev_token_ids: torch.Tensor,
        markov_state: torch.Tensor | None = None,
    ) -> DraftStep:
        """The serial step: the logits draft token ``j`` is sampled from, given its predecessor.

        Args:
            base_logits: ``[B, V_d]`` backbone logits of draft token ``j``.
            draft_hidden: ``[B, H]`` its hidden state.
            prev_token_ids: ``[B]`` predecessor as *target* ids: the anchor for ``j = 0``, then
                ``draft_to_target_ids(sampled draft ids)``.
            markov_state: ``[B, r]`` the previous step's ``markov_state``; at ``j = 0`` the backbone
                output's ``first_markov_state(n)`` (None except for an ``rnn`` head with
                ``sample_from_anchor=False``).

        Raises:
            ValueError: If an ``rnn`` head with ``sample_from_anchor=False`` gets no state.
        """
        self._check_markov_state(markov_state)
        markov = (
            None if self.markov_head is None else self.markov_head.step(prev_token_ids, draft_hidden, markov_state)
        )
        draft_logits, confidence_logits = self._correct(base_logits, draft_hidden, markov)
        return DraftStep(draft_logits, confidence_logits, None if markov is None else markov.state)

    def teacher_forced(
        self,
        base_logits: torch.Tensor,
        draft_hidden: torch.Tensor,
        prev_token_ids: torch.Tensor,
        markov_state: torch.Tensor | None = None,
    ) -> DraftBlockLogits:
        """The parallel path: logits of all draft tokens from ground-truth predecessors.

        Args:
            base_logits: ``[*, S, V_d]``.
            draft_hidden: ``[*, S, H]``.
            prev_token_ids: ``[*, S]`` target ids, ``block_token_ids[..., :S]`` (anchor first).
            markov_state: ``[*, r]`` the backbone output's ``markov_state`` (None except for an
                ``rnn`` head with ``sample_from_anchor=False``).

        Raises:
            ValueError: If an ``rnn`` head with ``sample_from_anchor=False`` gets no state.
        """
        self._check_markov_state(markov_state)
        markov = None
        if self.markov_head is not None:
            markov = self.markov_head.teacher_forced(prev_token_ids, draft_hidden, markov_state)
        return DraftBlockLogits(*self._correct(base_logits, draft_hidden, markov))


def _fingerprint(module: nn.Module) -> tuple[tuple[int, int, int], ...]:
    """Per parameter and buffer: data pointer, version counter, and the wrapping integer sum of its bits.

    Floating tensors are summed as 32-bit words (two bfloat16 values per word where they pair up),
    which reads them at memory speed; any change of any element changes the sum.
    """
    prints = []
    for tensor in (*module.parameters(), *module.buffers()):
        data = tensor.detach().reshape(-1)
        if data.dtype.is_floating_point or data.dtype == torch.bool:
            if data.element_size() == 2 and len(data) % 2 == 0:
                data = data.view(torch.int32)
            else:
                data = data.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[data.element_size()])
        prints.append(
            (
                tensor.data_ptr(),
                tensor._version,
                int(data.sum(dtype=torch.int32 if data.element_size() <= 4 else torch.int64)),
            )
        )
    return tuple(prints)


def _same_key(cached: tuple[Any, ...], key: tuple[Any, ...]) -> bool:
    """Whether two :meth:`DSparkHead.for_drafting` keys are equal (temperatures compared by value)."""
    *cached_rest, cached_temperatures = cached
    *rest, temperatures = key
    if cached_rest != rest:
        return False
    if cached_temperatures is None or temperatures is None:
        return cached_temperatures is temperatures
    return torch.equal(cached_temperatures, temperatures)
