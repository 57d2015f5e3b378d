"""Tokenized training sequences: the JSONL format, loading with checks, and padded batches.

One JSONL line is one document (a prompt and the target's answer): ``{"input_ids": [...],
"loss_mask": [...]}``, the mask set on the tokens to learn (the assistant's answer). Documents are
never packed together: a batch row holds one document, right-padded, so blocks can never cross a
document (see :mod:`spark_generate.training.anchors`).

The order of batches is a pure function of ``(seed, epoch)``, which makes resuming exact: the
trainer needs only the step number to know which batch comes next. Under several processes each
takes every ``num_processes``-th sequence of the shuffled order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TokenBatch", "TokenDataset", "draft_vocab_from_data", "read_jsonl", "write_jsonl"]


@dataclass(frozen=True)
class TokenBatch:
    """A right-padded batch of documents.

    Attributes:
        input_ids: ``[B, T]`` int64 (padding is 0).
        attention_mask: ``[B, T]`` int64, 1 on real tokens.
        loss_mask: ``[B, T]`` bool, set on the tokens to learn (never on padding).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, device: torch.device) -> TokenBatch:
        """The batch on ``device``."""
        return TokenBatch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device))


@dataclass(frozen=True)
class TokenDataset:
    """Tokenized documents, checked against a vocabulary size.

    Attributes:
        sequences: Token ids of each document.
        loss_masks: 0/1 per token of each document.
        description: Where the data came from (a file path and hash, or a caller's words).
    """

    sequences: tuple[tuple[int, ...], ...]
    loss_masks: tuple[tuple[int, ...], ...]
    description: str

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError(f"{self.description} holds no sequences; expected at least one tokenized document.")
        for index, (ids, mask) in enumerate(zip(self.sequences, self.loss_masks, strict=True)):
            if len(ids) != len(mask) or len(ids) < 2:
                raise ValueError(
                    f"sequence {index} of {self.description} has {len(ids)} tokens and {len(mask)} mask "
                    "entries: expected equal lengths of at least 2."
                )

    def __len__(self) -> int:
        return len(self.sequences)

    def subset(self, start: int, stop: int) -> TokenDataset:
        """Documents ``start`` to ``stop - 1``, described as a part of this dataset."""
        return TokenDataset(
            self.sequences[start:stop],
            self.loss_masks[start:stop],
            f"documents {start}-{stop - 1} of {self.description}",
        )

    @classmethod
    def concatenate(cls, parts: list[TokenDataset]) -> TokenDataset:
        """The documents of ``parts`` end to end (e.g. two corpora trained on together)."""
        return cls(
            tuple(ids for part in parts for ids in part.sequences),
            tuple(mask for part in parts for mask in part.loss_masks),
            " + ".join(part.description for part in parts),
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError if a token id falls outside ``[0, vocab_size)`` (data of another tokenizer)."""
        for index, ids in enumerate(self.sequences):
            if min(ids) < 0 or max(ids) >= vocab_size:
                raise ValueError(
                    f"sequence {index} of {self.description} has token ids in [{min(ids)}, {max(ids)}], "
                    f"but the target's vocabulary has {vocab_size} tokens: the data was tokenized for "
                    "another model. Regenerate it with this target's tokenizer."
                )

    def batch(self, indices: list[int]) -> TokenBatch:
        """Right-pads the chosen documents into one batch."""
        length = max(len(self.sequences[i]) for i in indices)
        input_ids = torch.zeros(len(indices), length, dtype=torch.long)
        attention_mask = torch.zeros(len(indices), length, dtype=torch.long)
        loss_mask = torch.zeros(len(indices), length, dtype=torch.bool)
        for row, index in enumerate(indices):
            size = len(self.sequences[index])
            input_ids[row, :size] = torch.tensor(self.sequences[index])
            attention_mask[row, :size] = 1
            loss_mask[row, :size] = torch.tensor(self.loss_masks[index], dtype=torch.bool)
        return TokenBatch(input_ids, attention_mask, loss_mask)

    def batch_indices(
        self, micro_step: int, batch_size: int, seed: int, process_index: int = 0, num_processes: int = 1
    ) -> list[int]:
        """Indices of the ``micro_step``-th batch of this process (epochs reshuffle by ``(seed, epoch)``)."""
        shard = -(-len(self) // num_processes)
        batches_per_epoch = max(1, -(-shard // batch_size))
        epoch, position = divmod(micro_step, batches_per_epoch)
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        # Wrap around so every process has the same number of full shards.
        order = (order * (1 + num_processes))[: shard * num_processes]
        mine = order[process_index::num_processes]
        return mine[position * batch_size : (position + 1) * batch_size]


def draft_vocab_from_data(dataset: TokenDataset, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent loss-masked tokens (ties: lower id first), padded with the lowest unused ids.

    Returns:
        ``[size]`` sorted target ids, for :meth:`DSparkHead.set_draft_vocab` (``t2d``/``d2t``).
    """
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size}: expected 1 to {vocab_size} (the target's vocabulary).")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(dataset.sequences, dataset.loss_masks, strict=True):
        chosen = torch.tensor(ids)[torch.tensor(mask, dtype=torch.bool)]
        counts.index_add_(0, chosen, torch.ones_like(chosen))
    # Sort by count descending, then id ascending (a stable sort on ids already in order).
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


def read_jsonl(path: str | Path) -> TokenDataset:
    """Reads documents written by :func:`write_jsonl` (or ``regenerate``).

    Raises:
        ValueError: If the file is missing, empty or a line lacks ``input_ids``/``loss_mask``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist; expected a JSONL file of tokenized documents.")
    sequences, masks = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            sequences.append(tuple(int(t) for t in record["input_ids"]))
            masks.append(tuple(int(m) for m in record["loss_mask"]))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"{path}:{number} is not a tokenized document ({error!r}); expected a JSON object with "
                '"input_ids" and "loss_mask" lists.'
            ) from error
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return TokenDataset(tuple(sequences), tuple(masks), f"{path} (sha256 {digest})")


def write_jsonl(path: str | Path, sequences: list[list[int]], loss_masks: list[list[int]]) -> None:
    """Writes documents, one JSON object per line."""
    with Path(path).open("w") as file:
        for ids, mask in zip(sequences, loss_masks, strict=True):
            file.write(json.dumps({"input_ids": list(ids), "loss_mask": list(mask)}) + "\n")
