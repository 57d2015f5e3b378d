"""The Markov head: a low-rank bias that restores the dependency between the tokens of a block.

The backbone drafts all slots of a block in one parallel pass, so its base logits ``U_k`` cannot
depend on the tokens drafted before slot ``k``. DSpark (paper eqs. 4-6) adds a cheap sequential
correction, keeping every draft distribution an exact softmax::

    q_k = softmax(U_k + b_k),   e_{k-1} = W1[x_{k-1}]          (W1: [V, r], W2: [V_d, r])

    vanilla  b_k = W2 e_{k-1}
    gated    g_k = σ(gate_proj([h_k ; e_{k-1}])),   b_k = W2 (g_k ⊙ e_{k-1})
    rnn      (a_g, a_c, a_o) = split3(joint_proj([s_{k-1} ; e_{k-1} ; h_k])),
             s_k = σ(a_g) ⊙ s_{k-1} + (1 - σ(a_g)) ⊙ tanh(a_c),   b_k = W2 tanh(a_o),   s_0 = 0

``x_{k-1}`` is the predecessor of draft token ``k`` as a *target*-vocabulary id (the anchor for the
first draft token; a sampled draft id must be mapped to the target vocabulary first), and ``h_k``
the backbone's final-normed hidden state for that draft token. Training feeds ground-truth
predecessors to :meth:`MarkovHead.teacher_forced` (parallel, except the ``rnn`` recurrence);
inference calls :meth:`MarkovHead.step` once per draft token with the token just sampled. Both
give identical biases for identical predecessors.

The ``rnn`` recurrence runs over every slot of a block, as in speculators (the format's owner):
with the DFlash slot convention (``sample_from_anchor=False``) the anchor slot drafts nothing but
still advances the state, with the anchor as predecessor and the anchor slot's hidden state, so
the first draft token starts from ``s_1 = MarkovHead.advance(anchor, h_anchor, s_0 = 0)`` rather
than from zero (its predecessor is the anchor again). :class:`~spark_generate.heads.DSparkHead`
computes that state in its backbone pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MarkovStep:
    """The Markov head's output for one draft token of every sequence in the batch.

    Attributes:
        bias: ``[B, V_d]`` bias ``b_k`` added to the base logits.
        prev_embeddings: ``[B, r]`` ``W1[x_{k-1}]`` (also read by the confidence head).
        state: ``[B, r]`` recurrent state ``s_k`` after this token (``rnn`` only), else None.
    """

    bias: torch.Tensor
    prev_embeddings: torch.Tensor
    state: torch.Tensor | None


class MarkovHead(nn.Module):
    """Low-rank sequential bias over the draft vocabulary (vanilla, gated or rnn).

    Args:
        target_vocab_size: ``V``, rows of ``markov_w1`` (predecessors are target ids).
        draft_vocab_size: ``V_d``, outputs of ``markov_w2``.
        markov_rank: ``r > 0``.
        hidden_size: ``H`` of the backbone hidden states (gated and rnn read them).
        head_type: ``"vanilla"``, ``"gated"`` or ``"rnn"``.
    """

    def __init__(
        self,
        *,
        target_vocab_size: int,
        draft_vocab_size: int,
        markov_rank: int,
        hidden_size: int,
        head_type: str,
    ):
        super().__init__()
        self.head_type = head_type
        self.markov_rank = markov_rank
        self.markov_w1 = nn.Embedding(target_vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + markov_rank, markov_rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank)

    def step(self, prev_token_ids: torch.Tensor, draft_hidden: torch.Tensor, state: torch.Tensor | None) -> MarkovStep:
        """Computes the bias of one draft token from its predecessor.

        Args:
            prev_token_ids: ``[*]`` target-vocabulary ids of the predecessors ``x_{k-1}``.
            draft_hidden: ``[*, H]`` backbone hidden states ``h_k``.
            state: ``[*, r]`` recurrent state ``s_{k-1}`` (``rnn``; None means ``s_0 = 0``).

        Returns:
            The bias, the predecessor embeddings and the next state.
        """
        prev_embeddings = self.markov_w1(prev_token_ids)
        if self.head_type == "vanilla":
            return MarkovStep(self.markov_w2(prev_embeddings), prev_embeddings, None)
        draft_hidden = draft_hidden.to(prev_embeddings.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([draft_hidden, prev_embeddings], dim=-1)))
            return MarkovStep(self.markov_w2(gate * prev_embeddings), prev_embeddings, None)
        output_logits, next_state = self._recur(prev_embeddings, draft_hidden, state)
        return MarkovStep(self.markov_w2(torch.tanh(output_logits)), prev_embeddings, next_state)

    def advance(self, prev_token_ids: torch.Tensor, draft_hidden: torch.Tensor) -> torch.Tensor:
        """Runs the ``rnn`` recurrence over one slot from ``s_0 = 0`` and returns ``s_1`` (no bias).

        This is the step over an anchor slot that drafts nothing (DFlash slot convention).

        Args:
            prev_token_ids: ``[*]`` target ids of the anchors.
            draft_hidden: ``[*, H]`` the anchor slot's hidden states.

        Returns:
            ``[*, r]`` the state the first draft token starts from.

        Raises:
            ValueError: If the head is not an ``rnn`` head (the others have no state).
        """
        if self.head_type != "rnn":
            raise ValueError(f"advance() runs the rnn recurrence, but this Markov head is {self.head_type!r}")
        prev_embeddings = self.markov_w1(prev_token_ids)
        return self._recur(prev_embeddings, draft_hidden.to(prev_embeddings.dtype), None)[1]

    def _recur(
        self, prev_embeddings: torch.Tensor, draft_hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``rnn`` step: ``[*, r]`` output logits ``a_o`` (from ``s_{k-1}``) and ``[*, r]`` state ``s_k``."""
        if state is None:
            state = torch.zeros_like(prev_embeddings)
        joint = self.joint_proj(torch.cat([state, prev_embeddings, draft_hidden], dim=-1))
        gate_logits, candidate_logits, output_logits = joint.chunk(3, dim=-1)
        gate = torch.sigmoid(gate_logits)
        return output_logits, gate * state + (1 - gate) * torch.tanh(candidate_logits)

    def teacher_forced(
        self, prev_token_ids: torch.Tensor, draft_hidden: torch.Tensor, state: torch.Tensor | None = None
    ) -> MarkovStep:
        """Computes the biases of all draft tokens of a block from ground-truth predecessors.

        Args:
            prev_token_ids: ``[*, S]`` target ids of the predecessors of the ``S`` draft tokens.
            draft_hidden: ``[*, S, H]``.
            state: ``[*, r]`` state the first draft token starts from (``rnn``; None means zero).

        Returns:
            ``bias [*, S, V_d]``, ``prev_embeddings [*, S, r]`` and the final state (``rnn``) or None.
        """
        if self.head_type != "rnn":
            return self.step(prev_token_ids, draft_hidden, None)
        biases, embeddings = [], []
        for slot in range(prev_token_ids.shape[-1]):
            markov = self.step(prev_token_ids[..., slot], draft_hidden[..., slot, :], state)
            state = markov.state
            biases.append(markov.bias)
            embeddings.append(markov.prev_embeddings)
        return MarkovStep(torch.stack(biases, dim=-2), torch.stack(embeddings, dim=-2), state)
