"""The target-feature cache on a tiny random Llama target: exact round trip, training, refusals, resumable builds.

* Round trip: a cached value is the in-process value of the same forward, cast to bfloat16, bit
  for bit.
* Training: with a batch's states read from the cache, ``teacher_forced_step`` gives exactly the
  loss of in-process states rounded to bfloat16. Against the in-process float32 loss it differs by
  that rounding only (measured: relative 2.4e-5 here; asserted: 1e-3). The :class:`Trainer`
  fed from the cache lands within the same tolerance of in-process training.
  Trained from the cache for the learning test's 300 steps, a head improves as much as the
  learning test asks of in-process training (teacher-forced tau +0.3, every slot's acceptance +0.1).
* Refusals: another target, other taps, another tokenizer, other documents, an unfinished build,
  a truncated or corrupt shard.
* Builds: a build that fails part-way leaves only whole shards that the manifest lists; the next
  call removes the leftovers and resumes. A ``max_minutes`` budget stops a build between batches.
  The resumed cache equals an uninterrupted one.
* Reuse: a new selection of documents cached before in other parts is copied from them, the
  target running only on the documents found nowhere (batched among themselves), into the very
  bytes a build from scratch writes; a source of other taps or autocast setting, or with a corrupt
  shard (opened without checksums), is refused.

The taps are fixed at ``[0, 2]``: one row holds 2·32 feature and 32 final-hidden values (192 bytes).
"""

import json
import shutil

import pytest
import torch
from test_training import VOCAB, dataset, settings, tiny_head, tiny_target
from test_training_learning import documents, fitted_target, stdlib_chunks
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

import spark_generate.training.feature_cache as feature_cache_module
from spark_generate.heads import DSparkHead
from spark_generate.training import (
    FeatureCache,
    FeatureCacheError,
    LossWeights,
    TargetStates,
    TokenDataset,
    Trainer,
    TrainingConfig,
    build_feature_cache,
    cache_bytes,
    sample_anchors,
    teacher_forced_step,
)
from spark_generate.training.evaluation import evaluate_teacher_forced
from spark_generate.training.feature_cache import data_fingerprint, target_states
from spark_generate.training.trainer import BlockModel

TAPS = [0, 2]
ROW_BYTES = (len(TAPS) + 1) * 32 * 2
CPU = torch.device("cpu")
LOSS_RTOL = 1e-3  # bfloat16 states against float32 ones (measured: 3e-5)


def tokenizer(size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``size`` tokens; only its vocabulary matters to the cache."""
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(size)}, "t0")))


def build(path, target=None, data=None, **options):
    target = tiny_target() if target is None else target
    data = dataset() if data is None else data
    return build_feature_cache(path, target, tokenizer(), data, TAPS, progress=False, **options)


def open_cache(path, target=None, data=None, layer_ids=TAPS, vocab=VOCAB, **options) -> FeatureCache:
    target = tiny_target() if target is None else target
    data = dataset() if data is None else data
    return FeatureCache.open(
        path, target=target, tokenizer=tokenizer(vocab), dataset=data, layer_ids=layer_ids, **options
    )


def bf16_states(states: TargetStates, dtype: torch.dtype = torch.bfloat16) -> TargetStates:
    return TargetStates(states.features.to(torch.bfloat16).to(dtype), states.final_hidden.to(torch.bfloat16).to(dtype))


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.int16), expected.view(torch.int16))


def shard_files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != "manifest.json")


# ----------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("batch_size", [1, 3])
def test_cached_values_are_the_in_process_states_cast_to_bfloat16_bit_for_bit(tmp_path, batch_size):
    target, data = tiny_target(), dataset()
    result = build(tmp_path, target, data, batch_size=batch_size, shard_mib=40 * ROW_BYTES / 2**20)
    assert result.complete and result.num_documents == result.new_documents == len(data)
    assert len(shard_files(tmp_path)) > 1, "the test must read across shards"
    cache = open_cache(tmp_path, target, data)
    for start in range(0, len(data), batch_size):
        indices = list(range(start, min(start + batch_size, len(data))))
        batch = data.batch(indices)
        live = target_states(target, TAPS, batch.input_ids, batch.attention_mask, CPU)
        for row, index in enumerate(indices):
            cached = cache.states([index], CPU, torch.bfloat16)
            length = len(data.sequences[index])
            assert_same_bits(cached.features[0], live.features[row, :length].to(torch.bfloat16))
            assert_same_bits(cached.final_hidden[0], live.final_hidden[row, :length].to(torch.bfloat16))


def test_a_cache_built_under_bfloat16_autocast_holds_that_forward_and_says_so(tmp_path):
    target, data = tiny_target(), dataset()
    build(tmp_path / "float32", target, data)
    build(tmp_path / "autocast", target, data, autocast_dtype=torch.bfloat16)
    assert json.loads((tmp_path / "autocast" / "manifest.json").read_text())["autocast"] == "bfloat16"
    assert json.loads((tmp_path / "float32" / "manifest.json").read_text())["autocast"] is None
    autocast, float32 = open_cache(tmp_path / "autocast", target, data), open_cache(tmp_path / "float32", target, data)
    assert autocast.autocast == ("bfloat16",) and float32.autocast == (None,)
    batch = data.batch([2])
    with torch.autocast("cpu", torch.bfloat16):
        live = target_states(target, TAPS, batch.input_ids, batch.attention_mask, CPU)
    cached = autocast.states([2], CPU, torch.bfloat16)
    assert_same_bits(cached.features[0], live.features[0].to(torch.bfloat16))
    assert_same_bits(cached.final_hidden[0], live.final_hidden[0].to(torch.bfloat16))
    reference = float32.states([2], CPU, torch.float32).features
    assert not torch.equal(cached.features.float(), reference), "autocast must change the forward here"
    assert (cached.features.float() - reference).norm() / reference.norm() < 0.05
    with pytest.raises(FeatureCacheError, match=r"autocast dtype of the target's forward: the cache has None"):
        build(tmp_path / "float32", target, data, autocast_dtype=torch.bfloat16)  # no resuming across settings


def test_a_batch_is_right_padded_with_zeros_in_the_requested_dtype(tmp_path):
    data = dataset()
    build(tmp_path, data=data)
    states = open_cache(tmp_path, data=data).states([4, 0], CPU, torch.float32)
    assert states.features.shape == (2, 24, 64) and states.final_hidden.shape == (2, 24, 32)
    assert states.features.dtype == states.final_hidden.dtype == torch.float32
    assert (states.features[1, 12:] == 0).all() and (states.final_hidden[1, 12:] == 0).all()
    assert (states.final_hidden[1, :12] != 0).any(dim=-1).all()


def test_the_manifest_records_what_the_cache_is_of(tmp_path):
    target = tiny_target()
    build(tmp_path, target)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and manifest["target_layer_ids"] == TAPS and manifest["dtype"] == "bfloat16"
    assert manifest["feature_width"] == 64 and manifest["hidden_size"] == 32
    assert len(manifest["target"]["weights_sha256"]) == len(manifest["tokenizer"]["vocab_sha256"]) == 64
    assert manifest["data"]["num_documents"] == 6 and manifest["data"]["description"] == "random test documents"
    shard = manifest["shards"][0]
    assert shard["first_document"] == 0 and shard["num_rows"] == sum(12 + 3 * i for i in range(6))
    assert len(shard["sha256"]) == 64


# ----------------------------------------------------------------------------------------------- in parts


def test_a_cache_in_parts_reads_as_the_whole_cache_bit_for_bit(tmp_path):
    target, data = tiny_target(), dataset()
    first, second = data.subset(0, 4), data.subset(4, len(data))
    build(tmp_path / "first", target, first, shard_mib=40 * ROW_BYTES / 2**20)
    build(tmp_path / "second", target, second)
    build(tmp_path / "whole", target, data)
    parts = open_cache([tmp_path / "first", tmp_path / "second"], target, data)
    whole = open_cache(tmp_path / "whole", target, data)
    assert parts.data_sha256 == whole.data_sha256 == data_fingerprint(data)
    for indices in ([0], [3, 4], [5, 1, 2], list(range(len(data)))):
        in_parts, at_once = parts.states(indices, CPU, torch.bfloat16), whole.states(indices, CPU, torch.bfloat16)
        assert_same_bits(in_parts.features, at_once.features)
        assert_same_bits(in_parts.final_hidden, at_once.final_hidden)
    joined = TokenDataset.concatenate([first, second])
    assert joined.sequences == data.sequences and joined.loss_masks == data.loss_masks


def test_cache_parts_out_of_order_or_not_covering_the_documents_are_refused(tmp_path):
    target, data = tiny_target(), dataset()
    build(tmp_path / "first", target, data.subset(0, 4))
    build(tmp_path / "second", target, data.subset(4, len(data)))
    with pytest.raises(FeatureCacheError, match=r"documents' token ids \(SHA-256\)"):
        open_cache([tmp_path / "second", tmp_path / "first"], target, data)
    with pytest.raises(FeatureCacheError, match=r"documents' token ids \(SHA-256\)"):
        open_cache([tmp_path / "first", tmp_path / "first"], target, data)
    with pytest.raises(FeatureCacheError, match="follows caches that already hold all 6 documents"):
        open_cache([tmp_path / "first", tmp_path / "second", tmp_path / "second"], target, data)
    with pytest.raises(FeatureCacheError, match="hold 4 documents, random test documents has 6"):
        open_cache([tmp_path / "first"], target, data)
    with pytest.raises(ValueError, match="no feature cache folder given"):
        open_cache([], target, data)


# ----------------------------------------------------------------------------------------------- training


@pytest.fixture
def trained_setup(tmp_path):
    """A target, a head tapping TAPS, the documents and their finished cache."""
    target = tiny_target()
    head = tiny_head(target, target_layer_ids=TAPS)
    data = dataset()
    build(tmp_path / "cache", target, data)
    return target, head, data, open_cache(tmp_path / "cache", target, data)


def test_a_step_from_the_cache_is_the_in_process_step_on_bfloat16_states(trained_setup):
    target, head, data, cache = trained_setup
    head.attach(target)
    model = BlockModel(head)
    indices = [0, 1]  # built by one forward each, so the in-process reference runs them alone too
    batch = data.batch(indices)
    anchors = sample_anchors(batch.loss_mask, 6, torch.Generator().manual_seed(0))
    cached_terms, cached_metrics = teacher_forced_step(
        model, target, head, batch, anchors, LossWeights(), cache.states(indices, CPU, torch.float32)
    )
    padded = cache.states(indices, CPU, torch.float32)  # the same zero padding; values overwritten below
    for row, index in enumerate(indices):
        alone = data.batch([index])
        live = bf16_states(target_states(target, TAPS, alone.input_ids, alone.attention_mask, CPU), torch.float32)
        padded.features[row, : alone.input_ids.shape[1]] = live.features[0]
        padded.final_hidden[row, : alone.input_ids.shape[1]] = live.final_hidden[0]
    rounded_terms, rounded_metrics = teacher_forced_step(model, target, head, batch, anchors, LossWeights(), padded)
    for name in ("total", "ce", "l1", "confidence"):
        assert torch.equal(getattr(cached_terms, name), getattr(rounded_terms, name)), name
    assert cached_metrics.as_dict() == rounded_metrics.as_dict()

    live_terms, live_metrics = teacher_forced_step(model, target, head, batch, anchors, LossWeights())
    live_loss, cached_loss = float(live_terms.total.detach()), float(cached_terms.total.detach())
    print(f"loss in process {live_loss:.6f}, from the cache {cached_loss:.6f} ({cached_loss / live_loss - 1:+.1e})")
    for name in ("total", "ce", "l1", "confidence"):
        torch.testing.assert_close(getattr(cached_terms, name), getattr(live_terms, name), rtol=LOSS_RTOL, atol=0)
    assert cached_metrics.slot_count.tolist() == live_metrics.slot_count.tolist()
    torch.testing.assert_close(cached_metrics.acceptance, live_metrics.acceptance, rtol=LOSS_RTOL, atol=0)


def test_the_trainer_trains_from_the_cache_as_it_trains_in_process(trained_setup, tmp_path):
    target, head, data, cache = trained_setup
    live_head = tiny_head(target, target_layer_ids=TAPS)
    live = Trainer(live_head, target, data, settings(tmp_path / "live", num_steps=2)).train()
    cached = Trainer(head, target, data, settings(tmp_path / "cached", num_steps=2), feature_cache=cache).train()
    print(f"loss after 2 steps: in process {live.loss:.6f}, from the cache {cached.loss:.6f}")
    assert cached.loss == pytest.approx(live.loss, rel=LOSS_RTOL)
    torch.testing.assert_close(cached.metrics.acceptance, live.metrics.acceptance, rtol=LOSS_RTOL, atol=0)
    provenance = json.loads((cached.checkpoint / "provenance.json").read_text())
    paths = [str(path) for path in cache.paths]
    assert provenance["feature_cache"] == {"paths": paths, "dtype": "bfloat16", "autocast": [None]}


def test_the_trainer_refuses_a_cache_of_other_taps_or_documents(trained_setup, tmp_path):
    target, _, data, cache = trained_setup
    other_taps = tiny_head(target, target_layer_ids=[1, 2])
    with pytest.raises(FeatureCacheError, match=r"tap layer ids \[0, 2\], the head reads \[1, 2\]"):
        Trainer(other_taps, target, data, settings(tmp_path / "a"), feature_cache=cache)
    fewer = TokenDataset(data.sequences[:3], data.loss_masks[:3], "three documents")
    with pytest.raises(FeatureCacheError, match="not those of three documents"):
        Trainer(tiny_head(target, target_layer_ids=TAPS), target, fewer, settings(tmp_path / "b"), feature_cache=cache)


@pytest.mark.slow
def test_training_from_the_cache_learns_as_the_learning_test_asks(tmp_path):
    chunks, vocab_size = stdlib_chunks()
    train_chunks, held_out = chunks[:-16], chunks[-16:]
    target = fitted_target(train_chunks, vocab_size)
    torch.manual_seed(1)
    head = DSparkHead.from_target(target, num_draft_layers=1, markov_rank=16, block_size=4)
    train, held_out_data = documents(train_chunks, "stdlib chunks"), documents(held_out, "held-out stdlib chunks")
    taps = list(head.config.target_layer_ids)
    build_feature_cache(tmp_path / "cache", target, tokenizer(vocab_size), train, taps, progress=False)
    cache = FeatureCache.open(
        tmp_path / "cache", target=target, tokenizer=tokenizer(vocab_size), dataset=train, layer_ids=taps
    )
    before = evaluate_teacher_forced(head, target, held_out_data)
    settings = TrainingConfig(
        str(tmp_path / "run"), num_steps=300, batch_size=4, num_anchors=32, learning_rate=3e-3, progress=False
    )
    Trainer(head, target, train, settings, feature_cache=cache).train()
    after = evaluate_teacher_forced(head, target, held_out_data)
    print(
        f"teacher-forced tau {before.tau:.3f} -> {after.tau:.3f}, acceptance {before.acceptance} -> {after.acceptance}"
    )
    assert after.tau > before.tau + 0.3
    assert (after.acceptance > before.acceptance + 0.1).all()
    assert after.confidence_error < before.confidence_error


# ----------------------------------------------------------------------------------------------- refusals


def test_opening_refuses_another_target_taps_tokenizer_or_documents(tmp_path):
    build(tmp_path)
    with pytest.raises(FeatureCacheError, match=r"target weights \(SHA-256\): the cache has '[0-9a-f]{64}'"):
        open_cache(tmp_path, target=tiny_target(seed=1))
    with pytest.raises(FeatureCacheError, match=r"tap layer ids: the cache has \[0, 2\], this run has \[1, 2\]"):
        open_cache(tmp_path, layer_ids=[1, 2])
    with pytest.raises(FeatureCacheError, match=r"tokenizer vocabulary \(SHA-256\): the cache has '[0-9a-f]{64}'"):
        open_cache(tmp_path, vocab=VOCAB + 1)
    with pytest.raises(FeatureCacheError, match=r"(?s)documents' token ids .*build a cache for this run"):
        open_cache(tmp_path, data=dataset(num_sequences=5))
    with pytest.raises(FeatureCacheError, match="missing or unreadable"):
        open_cache(tmp_path / "nowhere")


def test_opening_refuses_a_corrupt_or_truncated_shard(tmp_path):
    build(tmp_path, shard_mib=40 * ROW_BYTES / 2**20)
    shard = tmp_path / "shard-000001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(FeatureCacheError, match=r"shard-000001\.bin is corrupt: its SHA-256 is [0-9a-f]{64}, the"):
        open_cache(tmp_path)
    open_cache(tmp_path, verify_checksums=False)  # sizes only: the flipped bit goes unseen
    shard.write_bytes(bytes(data[:-ROW_BYTES]))
    with pytest.raises(
        FeatureCacheError, match=r"shard-000001\.bin has 8448 bytes; expected 8640 bytes \(45 rows of 96"
    ):
        open_cache(tmp_path, verify_checksums=False)
    shard.unlink()
    with pytest.raises(FeatureCacheError, match=r"shard-000001\.bin is missing; .*documents 3 to 4\)"):
        open_cache(tmp_path)


def test_building_refuses_a_folder_of_other_files_or_another_cache(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FeatureCacheError, match=r"holds \['notes.txt'\] but no manifest.json"):
        build(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    build(tmp_path / "cache")
    with pytest.raises(FeatureCacheError, match=r"(?s)target weights .*cache in another folder, or delete"):
        build(tmp_path / "cache", target=tiny_target(seed=1))
    with pytest.raises(ValueError, match="batch_size=0"):
        build(tmp_path / "other", batch_size=0)


# ----------------------------------------------------------------------------------------------- resuming


def test_a_failed_build_leaves_whole_listed_shards_and_resumes_to_the_same_cache(tmp_path, monkeypatch):
    target, data = tiny_target(), dataset()
    shard_mib = 40 * ROW_BYTES / 2**20  # documents of 12, 15, 18 | 21, 24 | 27 rows
    build(tmp_path / "straight", target, data, shard_mib=shard_mib)
    live = feature_cache_module.target_states
    calls = []

    def fails_on_the_fifth_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # document 4, with document 3 already in the unfinished second shard
            raise RuntimeError("out of memory")
        return live(*args, **kwargs)

    monkeypatch.setattr(feature_cache_module, "target_states", fails_on_the_fifth_forward)
    with pytest.raises(RuntimeError, match="out of memory"):
        build(tmp_path / "resumed", target, data, shard_mib=shard_mib)
    assert shard_files(tmp_path / "resumed") == ["shard-000000.bin"]
    manifest = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert not manifest["complete"] and [s["num_documents"] for s in manifest["shards"]] == [3]
    with pytest.raises(FeatureCacheError, match="holds 3 of 6 documents: its build did not finish"):
        open_cache(tmp_path / "resumed", target, data)

    # What a killed process leaves: a temporary shard, a shard renamed before the manifest listed it.
    (tmp_path / "resumed" / ".shard-000001.bin.tmp-99999").write_bytes(b"partial")
    (tmp_path / "resumed" / "shard-000001.bin").write_bytes(b"unlisted")
    (tmp_path / "resumed" / ".manifest.json.tmp-99999").write_text("{")
    monkeypatch.setattr(feature_cache_module, "target_states", live)
    result = build(tmp_path / "resumed", target, data, shard_mib=shard_mib)
    assert result.complete and result.new_documents == 3 and result.num_documents == 6
    assert shard_files(tmp_path / "resumed") == shard_files(tmp_path / "straight")
    for name in shard_files(tmp_path / "straight"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "straight" / name).read_bytes()
    open_cache(tmp_path / "resumed", target, data)


def test_max_minutes_stops_between_batches_and_the_next_call_goes_on(tmp_path):
    target, data = tiny_target(), dataset()
    results = [build(tmp_path, target, data, batch_size=2, max_minutes=0) for _ in range(3)]
    assert [(r.complete, r.num_documents, r.new_documents) for r in results] == [
        (False, 2, 2), (False, 4, 2), (True, 6, 2),
    ]  # fmt: skip
    assert shard_files(tmp_path) == ["shard-000000.bin", "shard-000001.bin", "shard-000002.bin"]
    again = build(tmp_path, target, data)
    assert (again.complete, again.new_documents) == (True, 0)
    cache = open_cache(tmp_path, target, data)
    batch = data.batch([4, 5])
    live = target_states(target, TAPS, batch.input_ids, batch.attention_mask, CPU)
    assert_same_bits(cache.states([5], CPU, torch.bfloat16).features[0], live.features[1].to(torch.bfloat16))


def test_opening_refuses_a_shard_corrupt_past_its_first_hash_chunk(tmp_path, monkeypatch):
    """A 19 MiB shard (more than one 16 MiB read of the hash) with its very last byte flipped is refused.

    Only the bytes matter here, so the target's states are stubbed out with a cheap pattern.
    """

    def patterned_states(target, layer_ids, input_ids, attention_mask, device):
        values = (input_ids[..., None] + torch.arange(3 * 32)).float() / VOCAB
        return TargetStates(values[..., :64], values[..., 64:])

    monkeypatch.setattr(feature_cache_module, "target_states", patterned_states)
    target = tiny_target()
    ids = tuple(torch.randint(2, VOCAB, (25_000,), generator=torch.Generator().manual_seed(0)).tolist())
    data = TokenDataset((ids,) * 4, ((1,) * len(ids),) * 4, "four long documents")
    build(tmp_path, target, data)
    shard = tmp_path / "shard-000000.bin"
    assert shard.stat().st_size == 4 * 25_000 * ROW_BYTES > 16 * 2**20
    open_cache(tmp_path, target, data)
    with shard.open("r+b") as file:
        file.seek(-1, 2)
        last = file.read(1)
        file.seek(-1, 2)
        file.write(bytes([last[0] ^ 0x01]))
    with pytest.raises(FeatureCacheError, match=r"shard-000000\.bin is corrupt"):
        open_cache(tmp_path, target, data)


def test_opening_refuses_a_cache_marked_complete_that_lists_too_few_documents(tmp_path):
    target, data = tiny_target(), dataset()
    build(tmp_path, target, data, shard_mib=40 * ROW_BYTES / 2**20)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 3
    manifest["shards"] = manifest["shards"][:2]  # the last shard's entry lost, the flag kept
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureCacheError, match="holds 5 of 6 documents: its build did not finish"):
        open_cache(tmp_path, target, data)


def test_resuming_removes_a_stray_shard_the_manifest_does_not_list(tmp_path):
    """A shard file past those the build will write (a copy, a killed build of other settings) does not survive."""
    target, data = tiny_target(), dataset()
    build(tmp_path, target, data, batch_size=2, max_minutes=0)
    (tmp_path / "shard-000009.bin").write_bytes(b"stray")
    result = build(tmp_path, target, data)
    assert result.complete
    listed = [shard["file"] for shard in json.loads((tmp_path / "manifest.json").read_text())["shards"]]
    assert shard_files(tmp_path) == sorted(listed) == ["shard-000000.bin", "shard-000001.bin"]


def test_a_build_that_would_not_fit_on_its_disk_is_refused_before_writing_and_resumes_once_it_fits(
    tmp_path, monkeypatch
):
    """The documents left (4 of 6, 90 tokens of 192 bytes) are checked against the disk's free space first."""
    target, data = tiny_target(), dataset()
    build(tmp_path / "straight", target, data)
    build(tmp_path / "cache", target, data, batch_size=2, max_minutes=0)
    left = cache_bytes(target, data, TAPS, start=2)
    assert left == 90 * ROW_BYTES
    assert cache_bytes(target, data, TAPS) == sum(p.stat().st_size for p in (tmp_path / "straight").glob("shard-*"))
    disk = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(feature_cache_module.shutil, "disk_usage", lambda path: disk._replace(free=left - 1))
    with pytest.raises(FeatureCacheError, match=r"the 4 documents left to cache take 16.88 KiB, but its disk has "
                                                r"16.87 KiB free\. Free that much"):  # fmt: skip
        build(tmp_path / "cache", target, data)
    assert shard_files(tmp_path / "cache") == ["shard-000000.bin"]
    monkeypatch.setattr(feature_cache_module.shutil, "disk_usage", lambda path: disk._replace(free=left))
    result = build(tmp_path / "cache", target, data)
    assert (result.complete, result.new_documents) == (True, 4)
    built = torch.cat([open_cache(tmp_path / "cache", target, data)._rows(i) for i in range(len(data))])
    straight = torch.cat([open_cache(tmp_path / "straight", target, data)._rows(i) for i in range(len(data))])
    assert_same_bits(built, straight)


# ----------------------------------------------------------------------------------------------- reuse


def selection(data: TokenDataset, indices: list[int]) -> TokenDataset:
    return TokenDataset(tuple(data.sequences[i] for i in indices), tuple(data.loss_masks[i] for i in indices),
                        f"documents {indices}")  # fmt: skip


def counted_forwards(monkeypatch) -> list[int]:
    """Patches the cache's target forward to record the batch size of every call."""
    live, sizes = feature_cache_module.target_states, []

    def counted(target, layer_ids, input_ids, *args):
        sizes.append(input_ids.shape[0])
        return live(target, layer_ids, input_ids, *args)

    monkeypatch.setattr(feature_cache_module, "target_states", counted)
    return sizes


def test_a_selection_cached_before_in_parts_is_copied_into_the_bytes_of_a_build_from_scratch(tmp_path, monkeypatch):
    target, data = tiny_target(), dataset(num_sequences=9)
    halves = [selection(data, list(range(0, 4))), selection(data, list(range(4, 8)))]
    for number, half in enumerate(halves):
        build(tmp_path / f"half{number}", target, half, shard_mib=40 * ROW_BYTES / 2**20)
    sources = [open_cache(tmp_path / f"half{number}", target, half, verify_checksums=False)
               for number, half in enumerate(halves)]  # fmt: skip
    every_second = selection(data, [0, 2, 4, 6, 8])  # document 8 was never cached
    build(tmp_path / "scratch", target, every_second)
    sizes = counted_forwards(monkeypatch)
    result = build(tmp_path / "reused", target, every_second, reuse=sources)
    assert (result.complete, result.new_documents, result.copied_documents) == (True, 5, 4)
    assert sizes == [1], "only the document found in no source runs the target"
    assert shard_files(tmp_path / "reused") == shard_files(tmp_path / "scratch") == ["shard-000000.bin"]
    for name in ("shard-000000.bin", "manifest.json"):
        assert (tmp_path / "reused" / name).read_bytes() == (tmp_path / "scratch" / name).read_bytes()
    open_cache(tmp_path / "reused", target, every_second)


def test_with_reuse_the_target_runs_on_batches_of_the_documents_found_nowhere(tmp_path, monkeypatch):
    target, data = tiny_target(), dataset(num_sequences=9)
    build(tmp_path / "even", target, selection(data, [0, 2, 4, 6, 8]))
    even = open_cache(tmp_path / "even", target, selection(data, [0, 2, 4, 6, 8]))
    sizes = counted_forwards(monkeypatch)
    result = build(tmp_path / "all", target, data, batch_size=2, reuse=[even])
    assert (result.copied_documents, sizes) == (5, [2, 2])
    cache = open_cache(tmp_path / "all", target, data)
    for index in (0, 4, 8):
        assert_same_bits(cache.states([index], CPU, torch.bfloat16).features[0],
                         even.states([index // 2], CPU, torch.bfloat16).features[0])  # fmt: skip
    batch = data.batch([5, 7])
    live = target_states(target, TAPS, batch.input_ids, batch.attention_mask, CPU)
    assert_same_bits(cache.states([7], CPU, torch.bfloat16).final_hidden[0], live.final_hidden[1].to(torch.bfloat16))


def test_reuse_refuses_a_cache_of_other_taps_or_autocast_and_a_corrupt_source_shard(tmp_path):
    target, data = tiny_target(), dataset()
    build(tmp_path / "source", target, data, shard_mib=40 * ROW_BYTES / 2**20)
    build_feature_cache(tmp_path / "taps", target, tokenizer(), data, [1, 2], progress=False)
    other_taps = open_cache(tmp_path / "taps", target, data, layer_ids=[1, 2])
    with pytest.raises(FeatureCacheError, match=r"(?s)tap layer ids: the cache has \[1, 2\].*Pass as reuse only"):
        build(tmp_path / "a", target, data, reuse=[other_taps])
    source = open_cache(tmp_path / "source", target, data)
    with pytest.raises(FeatureCacheError, match="autocast dtype of the target's forward: the cache has None"):
        build(tmp_path / "b", target, data, reuse=[source], autocast_dtype=torch.bfloat16)
    shard = tmp_path / "source" / "shard-000001.bin"
    damaged = bytearray(shard.read_bytes())
    damaged[100] ^= 0x01
    shard.write_bytes(bytes(damaged))
    unchecked = open_cache(tmp_path / "source", target, data, verify_checksums=False)
    with pytest.raises(FeatureCacheError, match=r"shard-000001\.bin is corrupt"):
        build(tmp_path / "c", target, data, reuse=[unchecked])
    assert not any(path.name.startswith("shard-") for path in (tmp_path / "c").iterdir())
