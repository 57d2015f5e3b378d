"""The target-feature cache: the frozen target runs once per document, and training reads its states from disk.

A training step needs two things from the frozen target for every document of its batch: the
tapped features the head reads (``[T, m·H]``, the raw outputs of the ``target_layer_ids`` layers)
and what supervises the slots, the target's distribution at the positions the slots predict. The
second is stored as the target's final (normed) hidden state ``[T, H]``, and the trainer applies the
frozen LM head only at the positions a batch supervises (the DSpark paper, §5.1). Storing ``V``
logits per token would take far more space. Without the cache the target runs again on every
document in every epoch; from the cache a step runs only the head and that LM head.

A cache is a folder::

    manifest.json        what the cache was built from and what it holds, replaced atomically
    shard-000000.bin     bfloat16 bit patterns (little-endian 16-bit words), one row per token of
    shard-000001.bin     consecutive documents: [tapped features (m·H) | final hidden state (H)]
    ...

The manifest records the target (the SHA-256 of its weights), the tap ids, the tokenizer (a
SHA-256 of its vocabulary), the documents (a SHA-256 of their token ids), the dtype and row widths.
For every finished shard it records the documents it holds, its row count and its SHA-256.
:meth:`FeatureCache.open` checks all of these against what the caller trains with. It refuses a
mismatch, an unfinished build, a missing or truncated shard and a corrupt one (by checksum), and the
error says what differs.

Building is resumable and atomic. Documents are processed in order. Rows are written to a
temporary file (``.shard-NNNNNN.bin.tmp-<pid>``), which is renamed into place once the shard is
full; then the manifest is replaced by one that lists the shard. An interrupted build therefore
leaves only whole shards named in the manifest, plus at most one temporary file, which the next
build removes. That next build resumes at the first document not yet in a shard. ``max_minutes``
stops a build between two batches, after its last shard is written. Only one build may write to a
folder at a time. A build that would not fit on its disk is refused before it writes anything
(:func:`cache_bytes`: a cache of SmolLM2-135M with five taps takes 6.75 KiB a token).

A corpus may be cached in parts, one folder each (a second corpus added after the first was
cached): :meth:`FeatureCache.open` takes the folders in order and reads them as one cache of the
documents end to end, each folder checked against its own share of them. A new selection of
documents already cached elsewhere (every second answer of a corpus whose every answer, or whose
first half and second half, were cached before) need not run the target again: ``reuse`` passes
:func:`build_feature_cache` those caches, and every document it finds there by its token ids is
copied (each source shard's checksum verified the first time it is read) instead of computed.

Reading memory-maps the shards. A batch copies only its own documents' rows, so memory does not
grow with the corpus. The stored values are the target's states rounded to bfloat16 (round to
nearest even, exactly ``tensor.to(torch.bfloat16)``), which keeps about 3 significant digits. The
features of a document are those of the forward that built it: one document per forward by
default, so the cache does not depend on how documents are batched.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from spark_generate.cache import FeatureTap
from spark_generate.training.data import TokenDataset
from spark_generate.training.provenance import target_identity

__all__ = [
    "CacheBuildResult",
    "FeatureCache",
    "FeatureCacheError",
    "TargetStates",
    "build_feature_cache",
    "cache_bytes",
    "data_fingerprint",
    "target_states",
    "tokenizer_identity",
]

FORMAT = "spark_generate.feature_cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORED_DTYPE = "bfloat16"
DEFAULT_SHARD_MIB = 256
"""A shard is closed once it holds at least this many MiB (at a document boundary)."""

_COPY_WINDOW = 256  # documents a build with ``reuse`` copies or computes between two shard checks
_WORD = np.dtype("<i2")  # one bfloat16 bit pattern; int16, since torch views int16 as bfloat16
_MAX_OPEN_SHARDS = 64  # memory maps kept open by a reader (each holds a file descriptor)
_HASH_CHUNK = 1 << 24


class FeatureCacheError(ValueError):
    """A feature cache that cannot be used: built from something else, unfinished, or damaged."""


@dataclass(frozen=True)
class TargetStates:
    """What training reads from the frozen target for a batch of right-padded documents.

    Attributes:
        features: ``[B, T, m·H]`` raw outputs of the tapped layers, in tap order.
        final_hidden: ``[B, T, H]`` final-normed hidden states (what the LM head reads).
    """

    features: torch.Tensor
    final_hidden: torch.Tensor


def target_states(
    target: PreTrainedModel,
    layer_ids: list[int],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    device: torch.device,
) -> TargetStates:
    """One frozen forward of the target's decoder, tapped (the trainer's and the cache's shared source).

    Args:
        target: The target.
        layer_ids: Tap ids, as :class:`~spark_generate.cache.FeatureTap` reads them.
        input_ids: ``[B, T]`` right-padded documents.
        attention_mask: ``[B, T]``, 1 on real tokens.
        device: Where the states go.
    """
    with torch.no_grad(), FeatureTap(target, list(layer_ids), device) as tap:
        hidden = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
        features = tap.take()
    return TargetStates(features, hidden.last_hidden_state.to(device))


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The tokenizer's class, name and vocabulary size, and a SHA-256 of its token-to-id map (which is compared)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return {
        "class": type(tokenizer).__name__,
        "name_or_path": getattr(tokenizer, "name_or_path", None) or None,
        "vocab_size": len(vocab),
        "vocab_sha256": hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest(),
    }


def data_fingerprint(dataset: TokenDataset) -> str:
    """SHA-256 over the documents' token ids, in order; a document's length is hashed before its ids."""
    digest = hashlib.sha256()
    for ids in dataset.sequences:
        digest.update(np.int64(len(ids)).tobytes())
        digest.update(np.asarray(ids, dtype="<i8").tobytes())
    return digest.hexdigest()


def _identity(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: TokenDataset,
    layer_ids: list[int],
    autocast: str | None = None,
) -> dict[str, Any]:
    """The manifest's fixed part: what the cache is of, how it was computed, and how its rows are laid out."""
    hidden_size = target.config.get_text_config().hidden_size
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "target": target_identity(target),
        "target_layer_ids": [int(layer_id) for layer_id in layer_ids],
        "tokenizer": tokenizer_identity(tokenizer),
        "data": {
            "description": dataset.description,
            "sha256": data_fingerprint(dataset),
            "num_documents": len(dataset),
        },
        "autocast": autocast,
        "dtype": STORED_DTYPE,
        "storage": "bfloat16 bit patterns as little-endian 16-bit words, one row per token",
        "feature_width": len(layer_ids) * hidden_size,
        "hidden_size": hidden_size,
    }


# What must agree for a cache to serve a run: (label, path into the manifest).
_CHECKS = (
    ("format", ("format",)),
    ("format version", ("version",)),
    ("target weights (SHA-256)", ("target", "weights_sha256")),
    ("tap layer ids", ("target_layer_ids",)),
    ("tokenizer vocabulary (SHA-256)", ("tokenizer", "vocab_sha256")),
    ("documents' token ids (SHA-256)", ("data", "sha256")),
    ("stored dtype", ("dtype",)),
    ("feature width", ("feature_width",)),
    ("autocast dtype of the target's forward", ("autocast",)),
)


def _lookup(record: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        record = record.get(key) if isinstance(record, dict) else None
    return record


def _check_identity(folder: Path, found: dict[str, Any], expected: dict[str, Any], remedy: str) -> None:
    """Raises FeatureCacheError naming every field in which ``found`` differs from ``expected``, then ``remedy``."""
    problems = [
        f"{label}: the cache has {_lookup(found, keys)!r}, this run has {_lookup(expected, keys)!r}"
        for label, keys in _CHECKS
        if _lookup(found, keys) != _lookup(expected, keys)
    ]
    if problems:
        raise FeatureCacheError(
            f"the feature cache in {folder} was built from something else than this run:\n  "
            + "\n  ".join(problems)
            + f"\n{remedy}"
        )


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Replaces ``manifest.json`` atomically: a synced temporary file renamed over it."""
    temporary = folder / f".{MANIFEST}.tmp-{os.getpid()}"
    with temporary.open("w") as file:
        file.write(json.dumps(manifest, indent=1) + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, folder / MANIFEST)
    _fsync_folder(folder)


def _read_manifest(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise FeatureCacheError(
            f"{folder / MANIFEST} is missing or unreadable ({error}); expected the manifest of a feature cache "
            "written by build_feature_cache. Build the cache there, or point at another folder."
        ) from error


def _shard_name(number: int) -> str:
    return f"shard-{number:06d}.bin"


class _ShardWriter:
    """One shard being written: rows go to a temporary file (and its hash) until :meth:`finish` renames it."""

    def __init__(self, folder: Path, number: int, first_document: int):
        self.final = folder / _shard_name(number)
        self.temporary = folder / f".{self.final.name}.tmp-{os.getpid()}"
        self.first_document = first_document
        self.num_documents = 0
        self.num_rows = 0
        self.num_bytes = 0
        self._digest = hashlib.sha256()
        self._file = self.temporary.open("wb")

    def write(self, rows: torch.Tensor) -> None:
        """Appends one document's ``[T, m·H + H]`` bfloat16 rows."""
        words = np.ascontiguousarray(rows.view(torch.int16).numpy(), dtype=_WORD)
        self._file.write(words.data)
        self._digest.update(words.data)
        self.num_documents += 1
        self.num_rows += rows.shape[0]
        self.num_bytes += words.nbytes

    def finish(self) -> dict[str, Any]:
        """Syncs, renames into place and returns the shard's manifest entry."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.temporary, self.final)
        return {
            "file": self.final.name,
            "first_document": self.first_document,
            "num_documents": self.num_documents,
            "num_rows": self.num_rows,
            "sha256": self._digest.hexdigest(),
        }

    def discard(self) -> None:
        """Closes and removes the temporary file (a build that stops with an error)."""
        self._file.close()
        self.temporary.unlink(missing_ok=True)


@dataclass(frozen=True)
class CacheBuildResult:
    """What :func:`build_feature_cache` returns.

    Attributes:
        path: The cache folder.
        complete: Whether every document is cached (False when ``max_minutes`` ran out).
        num_documents: Documents cached so far, this call's included.
        new_documents: Documents this call cached.
        copied_documents: Those of them copied from the ``reuse`` caches instead of computed.
    """

    path: Path
    complete: bool
    num_documents: int
    new_documents: int
    copied_documents: int = 0


def cache_bytes(target: PreTrainedModel, dataset: TokenDataset, layer_ids: list[int], start: int = 0) -> int:
    """Bytes the shards of a cache of ``dataset``'s documents from ``start`` take: 2 a value, ``(m + 1)·H`` a token."""
    hidden_size = target.config.get_text_config().hidden_size
    return _WORD.itemsize * (len(layer_ids) + 1) * hidden_size * sum(len(ids) for ids in dataset.sequences[start:])


def _check_disk_space(folder: Path, needed: int, num_documents: int) -> None:
    """Refuses a build whose shards would not fit on the folder's disk, before any of them is written."""
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise FeatureCacheError(
            f"{folder}: the {num_documents:,} documents left to cache take {_size(needed)}, but its disk has "
            f"{_size(free)} free. Free that much (feature caches no run needs any more are the largest files), "
            "or build the cache on another disk; what is cached so far stays and resumes."
        )


def _size(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit (of B, KiB, MiB, GiB) it reaches, e.g. ``"13.40 GiB"``."""
    exponent = min(3, max(0, (num_bytes.bit_length() - 1) // 10))
    return f"{num_bytes / 2 ** (10 * exponent):.2f} {('B', 'KiB', 'MiB', 'GiB')[exponent]}"


def _start_or_resume(folder: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The manifest to continue from: a new one, or the folder's own after checking it is the same cache.

    Leftovers of an interrupted build (temporary files, a shard renamed but not yet listed) are removed.
    """
    if folder.exists() and not folder.is_dir():
        raise FeatureCacheError(f"{folder} is a file; expected a folder for the feature cache. Choose another path.")
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / MANIFEST).exists():
        manifest = _read_manifest(folder)
        remedy = f"Build this run's cache in another folder, or delete {folder} to replace the cache there."
        _check_identity(folder, manifest, identity, remedy)
    else:
        foreign = [path.name for path in folder.iterdir() if not path.name.startswith(("shard-", "."))]
        if foreign:
            raise FeatureCacheError(
                f"{folder} holds {sorted(foreign)[:5]} but no {MANIFEST}; expected an empty folder or a feature "
                "cache to resume. Choose an empty or new folder."
            )
        manifest = {**identity, "complete": False, "shards": []}
        _write_manifest(folder, manifest)
    listed = {shard["file"] for shard in manifest["shards"]}
    for path in folder.iterdir():
        leftover = path.name.startswith(".") and ".tmp-" in path.name
        if leftover or (path.name.startswith("shard-") and path.name not in listed):
            path.unlink()
    return manifest


def build_feature_cache(
    path: str | os.PathLike,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: TokenDataset,
    layer_ids: list[int],
    *,
    batch_size: int = 1,
    shard_mib: float = DEFAULT_SHARD_MIB,
    max_minutes: float | None = None,
    progress: bool = True,
    autocast_dtype: torch.dtype | None = None,
    reuse: Sequence[FeatureCache] = (),
) -> CacheBuildResult:
    """Runs the frozen target over ``dataset`` and stores its tapped and final states, resuming a partial cache.

    Args:
        path: The cache folder (created; an unfinished cache of the same target, taps, tokenizer
            and documents is resumed).
        target: The target, put in eval mode; it runs where it is.
        tokenizer: The tokenizer ``dataset`` was tokenized with (recorded by its vocabulary).
        dataset: The documents, cached in order.
        layer_ids: Tap ids, usually ``head.config.target_layer_ids``.
        batch_size: Documents per target forward (right-padded; 1 keeps every document's states
            independent of the others).
        shard_mib: A shard is closed once it reaches this size.
        max_minutes: Stop after the batch during which this much time has passed; the next call
            resumes. None: run to the end.
        progress: Show a tqdm bar over documents.
        autocast_dtype: Run the target's forward under ``torch.autocast`` in this dtype (None: in
            the target's own). ``torch.bfloat16`` pays on a processor that multiplies it in
            hardware: SmolLM2-135M on a 2-core Xeon with AMX, 2,480 tokens/s against 840 in
            float32; the states then differ from float32's by about 0.3% (the storage's rounding
            alone: 0.16%). Recorded in the manifest; a cache resumes only under the same setting.
        reuse: Finished caches of the same target, taps, tokenizer and ``autocast_dtype`` that may
            hold some of the documents: each one found there (by its token ids; the first cache
            that holds it) is copied instead of computed, after its shard's checksum is verified
            on the first read. The target then runs on ``batch_size`` of the documents found
            nowhere at a time.

    Returns:
        Whether the cache is complete, and how many documents it holds (and copied).

    Raises:
        FeatureCacheError: ``path`` holds a cache of another target, taps, tokenizer or documents,
            or files that are not a cache; its disk lacks the space of the documents left to cache
            (:func:`cache_bytes`; checked before the first of them is written); a ``reuse`` cache of
            another target, taps, tokenizer or autocast setting, or with a corrupt shard.
        ValueError: A setting is out of range, or ``dataset`` holds ids outside the target's vocabulary.
    """
    if batch_size < 1 or shard_mib <= 0 or (max_minutes is not None and max_minutes < 0):
        raise ValueError(
            f"batch_size={batch_size}, shard_mib={shard_mib}, max_minutes={max_minutes}: expected a positive "
            "batch size and shard size, and a budget of at least 0 minutes (or None)."
        )
    started = time.monotonic()
    folder = Path(path)
    dataset.check_vocab(target.config.get_text_config().vocab_size)
    target.eval()
    autocast = None if autocast_dtype is None else str(autocast_dtype).removeprefix("torch.")
    identity = _identity(target, tokenizer, dataset, layer_ids, autocast)
    for source in reuse:
        for source_folder, source_manifest in zip(source.paths, source.manifests, strict=True):
            remedy = "Pass as reuse only caches of this target, taps, tokenizer and autocast setting."
            _check_identity(source_folder, source_manifest, {**identity, "data": source_manifest["data"]}, remedy)
    manifest = _start_or_resume(folder, identity)
    computing = (
        contextlib.nullcontext() if autocast_dtype is None else torch.autocast(target.device.type, autocast_dtype)
    )
    cached = sum(shard["num_documents"] for shard in manifest["shards"])
    _check_disk_space(folder, cache_bytes(target, dataset, layer_ids, start=cached), len(dataset) - cached)
    next_document, copied, device, writer = cached, 0, target.device, None
    bar = tqdm(total=len(dataset), initial=cached, unit="doc", desc="feature cache", disable=not progress)
    try:
        while next_document < len(dataset):
            indices, found = _next_window(dataset, next_document, batch_size, reuse)
            computed = [index for index in indices if index not in found]
            fresh = {}
            if computed:
                batch = dataset.batch(computed).to(device)
                with computing:
                    states = target_states(
                        target, layer_ids, batch.input_ids, batch.attention_mask, torch.device("cpu")
                    )
                rows = torch.cat([states.features.to(torch.bfloat16), states.final_hidden.to(torch.bfloat16)], -1)
                fresh = {index: rows[row, : len(dataset.sequences[index])] for row, index in enumerate(computed)}
            if writer is None:
                writer = _ShardWriter(folder, len(manifest["shards"]), next_document)
            for index in indices:
                writer.write(fresh[index] if index in fresh else found[index][0]._copied_rows(found[index][1]))
            next_document += len(indices)
            copied += len(found)
            bar.update(len(indices))
            out_of_time = max_minutes is not None and time.monotonic() - started >= 60 * max_minutes
            if writer.num_bytes >= shard_mib * 2**20 or next_document == len(dataset) or out_of_time:
                shard = writer.finish()
                writer = None
                manifest = {
                    **manifest,
                    "shards": [*manifest["shards"], shard],
                    "complete": next_document == len(dataset),
                }
                _write_manifest(folder, manifest)
            if out_of_time:
                break
    finally:
        if writer is not None:
            writer.discard()
        bar.close()
    return CacheBuildResult(folder, bool(manifest["complete"]), next_document, next_document - cached, copied)


def _next_window(
    dataset: TokenDataset, first: int, batch_size: int, reuse: Sequence[FeatureCache]
) -> tuple[list[int], dict[int, tuple[FeatureCache, int]]]:
    """The documents a build writes next, from ``first``: up to ``batch_size`` to compute, and those found in between.

    Returns:
        The window's document indices (``batch_size`` of them without ``reuse``; with it, up to
        ``batch_size`` found nowhere and at most ``_COPY_WINDOW`` in all), and for each found one
        the cache and index it is copied from.
    """
    if not reuse:
        return list(range(first, min(first + batch_size, len(dataset)))), {}
    indices, found = [], {}
    for index in range(first, min(first + _COPY_WINDOW, len(dataset))):
        ids = dataset.sequences[index]
        source = next(((cache, at) for cache in reuse if (at := cache.find(ids)) is not None), None)
        if source is None and len(indices) - len(found) == batch_size:
            break
        indices.append(index)
        if source is not None:
            found[index] = source
    return indices, found


class FeatureCache:
    """One or more finished feature caches, checked against a run and memory-mapped; use :meth:`open`.

    Attributes:
        paths: The cache folders, in the order of the documents they hold.
        manifests: Their manifests.
        data_sha256: :func:`data_fingerprint` of all the documents, end to end.
    """

    def __init__(self, paths: list[Path], manifests: list[dict[str, Any]], dataset: TokenDataset):
        self.paths = tuple(paths)
        self.manifests = tuple(manifests)
        self.data_sha256 = data_fingerprint(dataset)
        self._feature_width = int(manifests[0]["feature_width"])
        self._row_width = self._feature_width + int(manifests[0]["hidden_size"])
        lengths = np.fromiter((len(ids) for ids in dataset.sequences), dtype=np.int64, count=len(dataset))
        self._starts = np.concatenate([[0], np.cumsum(lengths)])  # global row of each document
        self._shards, offset = [], 0  # every folder's shards, numbered by document end to end
        for folder, manifest in zip(paths, manifests, strict=True):
            for shard in manifest["shards"]:
                self._shards.append({**shard, "path": folder / shard["file"],
                                     "first_document": offset + shard["first_document"]})  # fmt: skip
            offset += manifest["data"]["num_documents"]
        self._first_documents = np.array([shard["first_document"] for shard in self._shards], dtype=np.int64)
        self._maps: collections.OrderedDict[int, np.memmap] = collections.OrderedDict()
        self._sequences = dataset.sequences
        self._positions: dict[tuple[int, ...], int] | None = None  # token ids -> document index, once asked
        self._verified: set[int] = set()  # shards whose checksum was verified

    @classmethod
    def open(
        cls,
        path: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        dataset: TokenDataset,
        layer_ids: list[int],
        verify_checksums: bool = True,
    ) -> FeatureCache:
        """Opens a cache after checking it was built for exactly this run, and is whole.

        Args:
            path: The cache folder, or several in order: the first holds the first documents of
                ``dataset`` (as many as it was built from), the next the following ones, and so on.
            target: The target to train against (its weights are hashed).
            tokenizer: The tokenizer of ``dataset``.
            dataset: The documents, as cached.
            layer_ids: The head's ``target_layer_ids``.
            verify_checksums: Hash every shard (reads the whole cache once); sizes are always checked.

        Raises:
            FeatureCacheError: Another target, taps, tokenizer or documents; an unfinished build;
                a missing, truncated or corrupt shard; folders holding more or fewer documents than
                ``dataset``.
            ValueError: An empty list of folders.
        """
        folders = [Path(path)] if isinstance(path, (str, os.PathLike)) else [Path(folder) for folder in path]
        if not folders:
            raise ValueError("no feature cache folder given; expected one folder, or several in document order.")
        manifests, first = [], 0
        remedy = "Open it with what it was built from, or build a cache for this run with build_feature_cache."
        for folder in folders:
            manifest = _read_manifest(folder)
            count = _lookup(manifest, ("data", "num_documents"))
            stop = min(first + count, len(dataset)) if isinstance(count, int) and count > 0 else len(dataset)
            if stop <= first:
                raise FeatureCacheError(
                    f"the feature cache in {folder} follows caches that already hold all {len(dataset)} documents "
                    f"of {dataset.description}: open only the folders built from them, in document order."
                )
            part = dataset.subset(first, stop)  # the identity check below refuses a cache of other documents
            # Any autocast setting serves a run: it is recorded (FeatureCache.autocast), not required.
            expected = _identity(target, tokenizer, part, layer_ids, _lookup(manifest, ("autocast",)))
            _check_identity(folder, manifest, expected, remedy)
            cached = sum(shard["num_documents"] for shard in manifest["shards"])
            if not manifest["complete"] or cached != count:
                raise FeatureCacheError(
                    f"the feature cache in {folder} holds {cached} of {count} documents: its build did not "
                    "finish. Run build_feature_cache on the same folder again to resume it."
                )
            manifests.append(manifest)
            first += count
        if first != len(dataset):
            raise FeatureCacheError(
                f"the feature caches in {', '.join(map(str, folders))} hold {first} documents, {dataset.description} "
                f"has {len(dataset)}: open a cache for every part of the documents, in order."
            )
        cache = cls(folders, manifests, dataset)
        for shard in cache._shards:
            cache._check_shard(shard, verify_checksums)
        if verify_checksums:
            cache._verified.update(range(len(cache._shards)))
        return cache

    def _check_shard(self, shard: dict[str, Any], verify_checksum: bool) -> None:
        file = shard["path"]
        first, count = shard["first_document"], shard["num_documents"]
        rows = int(self._starts[first + count] - self._starts[first])
        expected = rows * self._row_width * _WORD.itemsize
        size = file.stat().st_size if file.is_file() else 0
        if rows != shard["num_rows"] or size != expected:
            state = f"has {size} bytes" if file.is_file() else "is missing"
            raise FeatureCacheError(
                f"{file} {state}; expected {expected} bytes ({rows} rows of {self._row_width} bfloat16 values, "
                f"documents {first} to {first + count - 1}). Delete {file.parent} and build the cache again."
            )
        if verify_checksum:
            digest = hashlib.sha256()
            with file.open("rb") as handle:
                while chunk := handle.read(_HASH_CHUNK):
                    digest.update(chunk)
            if digest.hexdigest() != shard["sha256"]:
                raise FeatureCacheError(
                    f"{file} is corrupt: its SHA-256 is {digest.hexdigest()}, the manifest records "
                    f"{shard['sha256']}. Delete {file.parent} and build the cache again."
                )

    @property
    def layer_ids(self) -> list[int]:
        """The tap ids the features were taken from."""
        return list(self.manifests[0]["target_layer_ids"])

    @property
    def target_sha256(self) -> str:
        """SHA-256 of the weights of the target the cache was built from."""
        return self.manifests[0]["target"]["weights_sha256"]

    @property
    def dtype(self) -> str:
        """The stored dtype (``"bfloat16"``)."""
        return self.manifests[0]["dtype"]

    @property
    def autocast(self) -> tuple[str | None, ...]:
        """Per folder, the autocast dtype its target forward ran under (None: the target's own dtype)."""
        return tuple(manifest.get("autocast") for manifest in self.manifests)

    def find(self, ids: Sequence[int]) -> int | None:
        """The index of a document whose token ids are ``ids``, or None when the cache holds none."""
        if self._positions is None:
            self._positions = {tuple(sequence): index for index, sequence in enumerate(self._sequences)}
        return self._positions.get(tuple(ids))

    def _shard_of(self, index: int) -> int:
        return int(np.searchsorted(self._first_documents, index, side="right")) - 1

    def _copied_rows(self, index: int) -> torch.Tensor:
        """:meth:`_rows`, after verifying the shard's checksum once (a copy must not carry damage on)."""
        number = self._shard_of(index)
        if number not in self._verified:
            self._check_shard(self._shards[number], verify_checksum=True)
            self._verified.add(number)
        return self._rows(index)

    def _rows(self, index: int) -> torch.Tensor:
        """``[T, m·H + H]`` bfloat16: a document's rows, a view on the memory-mapped shard (no copy)."""
        number = self._shard_of(index)
        shard = self._shards[number]
        if number in self._maps:
            self._maps.move_to_end(number)
        else:
            if len(self._maps) >= _MAX_OPEN_SHARDS:
                self._maps.popitem(last=False)
            # Copy-on-write: the array is writable for torch, the file is never written.
            self._maps[number] = np.memmap(
                shard["path"], dtype=_WORD, mode="c", shape=(shard["num_rows"], self._row_width)
            )
        base = self._starts[shard["first_document"]]
        start, stop = self._starts[index] - base, self._starts[index + 1] - base
        return torch.from_numpy(self._maps[number][start:stop]).view(torch.bfloat16)

    def states(self, indices: list[int], device: torch.device, dtype: torch.dtype) -> TargetStates:
        """The cached states of documents ``indices``, right-padded with zeros as :meth:`TokenDataset.batch` pads.

        Args:
            indices: Document indices of a batch.
            device: Where the states go.
            dtype: Their dtype (the target's, so the head sees what a live target would give it).

        Returns:
            ``[B, T, m·H]`` features and ``[B, T, H]`` final hidden states, ``T`` the longest document.
        """
        documents = [self._rows(index) for index in indices]
        length = max(len(rows) for rows in documents)
        width = self._feature_width
        features = torch.zeros(len(indices), length, width, dtype=dtype)
        final_hidden = torch.zeros(len(indices), length, self._row_width - width, dtype=dtype)
        for row, rows in enumerate(documents):
            features[row, : len(rows)] = rows[:, :width]
            final_hidden[row, : len(rows)] = rows[:, width:]
        return TargetStates(features.to(device), final_hidden.to(device))
