"""The rows of a batch as every step of the loop sees them: prefixes, sampling mode, processing.

Drafting, scheduling, verification and the loop all speak about the same rows: the committed
tokens of each row (:class:`RowPrefixes`), how tokens are chosen (:class:`Sampling`), and the
target's logits processors applied to one position per row with that row's exact prefix
(:func:`apply_processors`).

Processors see real prefixes, so rows of different lengths are processed in groups of equal
length (:func:`rows_by_length`): length-dependent processors (``min_new_tokens``, no-repeat
n-grams) then behave exactly as in plain ``generate()``. Processors must treat rows
independently; the standard processors' per-row state is sliced to the rows of each call by
:func:`spark_generate.hf.processors_for_rows`. Custom processors that index rows
(``prefix_allowed_tokens_fn`` reads ``batch_id``) see the rows of a group renumbered from 0, so
they are only exact with batch size 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from spark_generate.hf import processors_for_rows

__all__ = ["UNSEEN_POSITION", "RowPrefixes", "Sampling", "apply_processors", "rows_by_length"]

# Context rows with this position are never attended to (the draft's mask shows a block only the
# context rows before its anchor): left padding of the prompt, and holes left by rejected tokens.
UNSEEN_POSITION = 2**40


@dataclass(frozen=True)
class RowPrefixes:
    """The committed tokens of every row, as the logits processors and stopping criteria see them.

    Attributes:
        token_ids: ``[B, C]`` left-padded prompt, then the generated tokens; columns at and after
            ``lengths[b]`` are unused.
        lengths: ``[B]`` int64 number of used columns per row.
        rows: ``[B]`` int64 index of each row in the batch ``generate()`` was called with (rows
            leave the batch as they finish; per-row processor state is indexed by these).
    """

    token_ids: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedily, or by sampling with per-row Philox seeds.

    Attributes:
        greedy: Take argmaxes (``do_sample=False``).
        seeds: ``[B]`` int64 Philox seeds; a row's draws depend only on its seed and positions.
    """

    greedy: bool
    seeds: torch.Tensor

    def select_rows(self, keep: torch.Tensor) -> Sampling:
        """The sampling of the batch rows ``keep``."""
        return Sampling(self.greedy, self.seeds[keep])


def rows_by_length(lengths: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Groups rows of equal length: ``[(length, row indices)]``, one group when all are equal."""
    values = lengths.tolist()
    if len(set(values)) == 1:
        return [(values[0], torch.arange(len(values), device=lengths.device))]
    return [(length, (lengths == length).nonzero()[:, 0]) for length in sorted(set(values))]


def apply_processors(
    logits_processor: LogitsProcessorList,
    prefixes: RowPrefixes,
    extra_token_ids: torch.Tensor,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Applies the logits processors to one position per row, with each row's exact prefix.

    Args:
        logits_processor: The processors ``generate()`` built (warpers included when sampling).
        prefixes: The committed tokens.
        extra_token_ids: ``[B, j]`` tokens after the committed ones (drafts so far; ``j`` may be 0).
        logits: ``[B, V]`` logits of the token after them.

    Returns:
        ``[B, V]`` processed logits.
    """
    if not logits_processor:
        return logits
    processed = torch.empty_like(logits)
    for length, rows in rows_by_length(prefixes.lengths):
        input_ids = torch.cat([prefixes.token_ids[rows, :length], extra_token_ids[rows]], dim=1)
        processed[rows] = processors_for_rows(logits_processor, prefixes.rows[rows])(input_ids, logits[rows])
    return processed
