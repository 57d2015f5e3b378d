"""`DSparkForCausalLM`: behaves like the wrapped model, and `generate(..., assistant=...)` is exact.

Covers the wrapper's delegation (config, device, dtype, forward, saving), plain ``generate()``
without a head, heads given as objects or folders (every way of passing one head drafts the same:
same dtype, same calibration), ``stop_strings`` with a tokenizer (built in memory, nothing from
the Hub), streaming text and the errors users hit first.
"""

import json

import pytest
import torch
from conftest import tiny_target as float32_target
from test_generation import PAD, VOCAB, oracle, prompts, tiny_head, tiny_target
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextStreamer

from spark_generate import AdaptiveSchedule, ConfidenceThreshold, DSparkForCausalLM, DSparkHead, FixedLength, decode
from spark_generate.heads import DSparkCheckpointError


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


def wrapper_keywords(keywords: dict) -> dict:
    """``oracle()``'s ``generate()`` keywords as the wrapper takes them (``schedule=``)."""
    return {"schedule" if name == "dspark_schedule" else name: value for name, value in keywords.items()}


@pytest.fixture(scope="module")
def tokenizer():
    # StopStringCriteria tokenizes the probe "abcdef" while reading the vocabulary: give it a token.
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"abcdef": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t1")


def test_behaves_like_the_wrapped_model(llama, tmp_path):
    model = DSparkForCausalLM(llama, tiny_head(llama))
    assert model.config is llama.config and model.generation_config is llama.generation_config
    assert model.device == llama.device and model.dtype == torch.float64
    input_ids, attention_mask = prompts(2)
    expected = llama(input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(model(input_ids, attention_mask=attention_mask).logits, expected)
    model.save_pretrained(tmp_path)  # the target, untouched: no head weights
    reloaded = DSparkForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert set(reloaded.model.state_dict()) == set(llama.state_dict())
    plain = llama.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8)
    assert torch.equal(
        reloaded.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8), plain
    )


def test_without_a_head_or_suffix_drafting_it_is_plain_generate(llama):
    input_ids, attention_mask = prompts(2)
    torch.manual_seed(5)
    plain = llama.generate(input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=8)
    torch.manual_seed(5)
    wrapped = DSparkForCausalLM(llama).generate(
        input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=8, suffix=False
    )
    assert torch.equal(plain, wrapped)


def test_without_a_head_it_drafts_from_the_suffix_index_unless_the_mode_needs_plain_generate(llama):
    input_ids, attention_mask = prompts(2)
    kwargs = {"attention_mask": attention_mask, "max_new_tokens": 8}
    model = DSparkForCausalLM(llama)
    out = model.generate(input_ids, do_sample=False, return_dict_in_generate=True, **kwargs)
    assert out.dspark_stats is not None  # decoded by the DSpark loop, with the suffix drafter alone
    assert torch.equal(out.sequences, llama.generate(input_ids, do_sample=False, **kwargs))
    beams = model.generate(input_ids, num_beams=2, do_sample=False, **kwargs)  # beam search: plain generate()
    assert torch.equal(beams, llama.generate(input_ids, num_beams=2, do_sample=False, **kwargs))


def test_assistant_as_object_or_folder(llama, tmp_path):
    head = tiny_head(llama)
    head.save_pretrained(tmp_path / "head")
    input_ids, attention_mask = prompts(3)
    kwargs = {"attention_mask": attention_mask, "do_sample": False, "max_new_tokens": 15}
    plain = llama.generate(input_ids, **kwargs)
    model = DSparkForCausalLM(llama)
    assert torch.equal(model.generate(input_ids, assistant=head, **kwargs), plain)
    assert torch.equal(model.generate(input_ids, assistant=str(tmp_path / "head"), **kwargs), plain)
    default = DSparkForCausalLM(llama, head=tmp_path / "head")
    assert torch.equal(default.generate(input_ids, **kwargs), plain)


def test_stop_strings_inside_an_accepted_block(llama, tokenizer):
    input_ids, attention_mask = prompts(3)
    free = llama.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20)
    stop = tokenizer.convert_ids_to_tokens(int(free[0, input_ids.shape[1] + 6]))
    kwargs = {"attention_mask": attention_mask, "do_sample": False, "max_new_tokens": 20}
    plain = llama.generate(input_ids, stop_strings=[stop], tokenizer=tokenizer, **kwargs)
    assert plain.shape[1] < free.shape[1] or (plain == PAD).any()
    model = DSparkForCausalLM(llama, tiny_head(llama, block_size=5))
    spec = model.generate(
        input_ids, stop_strings=[stop], tokenizer=tokenizer, return_dict_in_generate=True, **kwargs,
        **wrapper_keywords(oracle(plain)),
    )  # fmt: skip
    assert torch.equal(plain, spec.sequences)
    assert spec.dspark_stats.num_accepted.sum() > 0
    with pytest.raises(ValueError, match="needs the tokenizer"):
        model.generate(input_ids, stop_strings=[stop], **kwargs)


class CollectingStreamer(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True)
        self.text = ""

    def on_finalized_text(self, text, stream_end=False):
        self.text += text


def test_streamed_text_equals_final_text(llama, tokenizer):
    input_ids, _ = prompts(1)
    plain = llama.generate(input_ids, do_sample=False, max_new_tokens=16)
    streamer = CollectingStreamer(tokenizer)
    out = DSparkForCausalLM(llama, tiny_head(llama)).generate(
        input_ids, do_sample=False, max_new_tokens=16, streamer=streamer, **wrapper_keywords(oracle(plain, 3))
    )
    assert torch.equal(out, plain)
    assert streamer.text == tokenizer.decode(out[0, input_ids.shape[1] :])


def test_sampling_is_reproducible(llama):
    model = DSparkForCausalLM(llama, tiny_head(llama))
    input_ids, attention_mask = prompts(3)
    kwargs = {"attention_mask": attention_mask, "do_sample": True, "temperature": 0.8, "max_new_tokens": 12}
    assert torch.equal(model.generate(input_ids, seed=11, **kwargs), model.generate(input_ids, seed=11, **kwargs))
    torch.manual_seed(4)
    first = model.generate(input_ids, **kwargs)
    torch.manual_seed(4)
    assert torch.equal(first, model.generate(input_ids, **kwargs))


def test_row_output_is_independent_of_batch_composition(llama):
    """With per-row seeds, a row's tokens depend only on its own prompt and seed."""
    model = DSparkForCausalLM(llama, tiny_head(llama))
    input_ids = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(8))
    seeds = torch.tensor([101, 202, 303])
    # A per-row schedule: the adaptive default plans the batch as a whole, so rows share its plan.
    kwargs = {"do_sample": True, "top_k": 20, "max_new_tokens": 10, "schedule": FixedLength()}
    batched = model.generate(input_ids, seed=seeds, **kwargs)
    for row in range(3):
        alone = model.generate(input_ids[row : row + 1], seed=seeds[row : row + 1], **kwargs)
        assert torch.equal(alone[0], batched[row, : alone.shape[1]])


def test_left_padded_row_samples_like_the_row_alone(llama):
    """Philox draws are keyed by each row's seed and real positions, so left padding changes nothing."""
    model = DSparkForCausalLM(llama, tiny_head(llama))
    input_ids, attention_mask = prompts(3)
    seeds = torch.tensor([7, 8, 9])
    kwargs = {"do_sample": True, "temperature": 0.9, "max_new_tokens": 10, "schedule": FixedLength()}
    batched = model.generate(input_ids, attention_mask=attention_mask, seed=seeds, **kwargs)
    prompt_length = input_ids.shape[1]
    for row in range(3):
        real = input_ids[row : row + 1, attention_mask[row].bool()]
        new = model.generate(real, seed=seeds[row : row + 1], **kwargs)[0, real.shape[1] :]
        assert torch.equal(new, batched[row, prompt_length : prompt_length + len(new)])  # then padding, if EOS


def test_errors(llama):
    model = DSparkForCausalLM(llama, tiny_head(llama))
    input_ids, _ = prompts(1)
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(input_ids, num_beams=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(input_ids, max_new_tokens=0)  # generate()'s own check, before any decoding
    with pytest.raises(ValueError, match="causal LM"):
        DSparkForCausalLM(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a drafter"):
        llama.generate(input_ids, max_new_tokens=4, custom_generate=decode, dspark_suffix=False)
    with pytest.raises(ValueError, match="suffix='yes'; expected None"):
        model.generate(input_ids, max_new_tokens=4, suffix="yes")


def test_rough_edges_a_transformers_user_hits(llama):
    """Transformers' keyword, a list of ids, and a schedule given by name behave as a user expects."""
    model = DSparkForCausalLM(llama)
    head = tiny_head(llama)
    input_ids, _ = prompts(1)
    kwargs = {"do_sample": False, "max_new_tokens": 6}
    plain = llama.generate(input_ids, **kwargs)
    assert torch.equal(model.generate(input_ids, assistant_model=head, **kwargs), plain)
    assert torch.equal(model.generate(input_ids[0].tolist(), assistant=head, **kwargs), plain)
    assert torch.equal(model.generate(input_ids.tolist(), assistant=head, **kwargs), plain)
    with pytest.raises(ValueError, match="lengths"):
        model.generate([[3, 4, 5], [6, 7]], assistant=head, **kwargs)
    with pytest.raises(ValueError, match=r"schedule='confidence' is not a schedule.*ConfidenceThreshold"):
        model.generate(input_ids, assistant=head, schedule="confidence", **kwargs)
    with pytest.raises(ValueError, match="both assistant= and assistant_model="):
        model.generate(input_ids, assistant=head, assistant_model=head, **kwargs)


def test_summary_says_n_a_for_slots_never_verified(llama):
    """A threshold that verifies nothing reports n/a per slot, not an acceptance of 0.00."""
    model = DSparkForCausalLM(llama, tiny_head(llama, enable_confidence_head=True))
    input_ids, _ = prompts(1)
    out = model.generate(
        input_ids, do_sample=False, max_new_tokens=6, schedule=ConfidenceThreshold(1.0), return_dict_in_generate=True
    )
    assert int(out.dspark_stats.num_drafted.sum()) == 0
    assert "acceptance by draft position: n/a n/a n/a n/a" in out.dspark_stats.summary()


def test_default_schedule_uses_the_calibration_of_a_head_folder(llama, tmp_path):
    head = tiny_head(llama, enable_confidence_head=True)
    head.save_pretrained(tmp_path)
    (tmp_path / "calibration.json").write_text('{"temperatures": [1.0, 2.0, 3.0, 4.0]}')
    model = DSparkForCausalLM(llama, tmp_path)
    assert model.head.sts_temperatures.tolist() == [1.0, 2.0, 3.0, 4.0]
    input_ids, _ = prompts(1)
    assert torch.equal(model.generate(input_ids, max_new_tokens=6), llama.generate(input_ids, max_new_tokens=6))


def test_transformers_assistant_model_says_what_to_call_instead(llama):
    input_ids, _ = prompts(1)
    with pytest.raises(AttributeError) as error:
        llama.generate(input_ids, assistant_model=tiny_head(llama), max_new_tokens=4)
    message = str(error.value)
    assert "assistant_model=...) got a DSpark head" in message  # what was given
    assert "expects a smaller causal LM" in message  # what was expected
    assert "DSparkForCausalLM(target).generate(..., assistant=head)" in message and "dspark_head=head" in message
    assert "vocab" not in message  # nothing about vocabulary sizes, which the user did not ask about


# The calibration of the head folder below: temperatures this small make the confidences nearly 0 or 1,
# so the default schedule verifies far fewer drafts than with the raw confidences (4 against 13 here).
SHARP_TEMPERATURES = [0.05, 0.05, 0.05, 0.05]


@pytest.fixture
def calibrated_bfloat16_folder(tmp_path):
    """A float32 target and its head saved in bfloat16 with a calibration.json, as the shipped head is."""
    target = float32_target("llama", lm_head_scale=8.0)
    tiny_head(target, enable_confidence_head=True).to(torch.bfloat16).save_pretrained(tmp_path / "head")
    (tmp_path / "head" / "calibration.json").write_text(json.dumps({"temperatures": SHARP_TEMPERATURES}))
    return target, tmp_path / "head"


def test_every_way_of_passing_a_head_drafts_the_same(calibrated_bfloat16_folder, monkeypatch):
    """A folder, a loaded head, a default head and decode() all draft in float32 with the folder's calibration."""
    monkeypatch.setenv("SPARK_GENERATE_PROFILE", "0")  # the built-in cost table: the same plan on any machine
    target, folder = calibrated_bfloat16_folder
    input_ids = torch.randint(2, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    kwargs = {"do_sample": False, "max_new_tokens": 40, "return_dict_in_generate": True}
    loaded = DSparkHead.from_pretrained(folder)
    assert loaded.fc.weight.dtype == torch.bfloat16 and torch.equal(
        loaded.sts_temperatures, torch.tensor(SHARP_TEMPERATURES)
    )
    outputs = {
        "folder": DSparkForCausalLM(target).generate(input_ids, assistant=str(folder), **kwargs),
        "from_pretrained": DSparkForCausalLM(target).generate(input_ids, assistant=loaded, **kwargs),
        "default head": DSparkForCausalLM(target, folder).generate(input_ids, **kwargs),
        "decode": target.generate(input_ids, custom_generate=decode, dspark_head=loaded, **kwargs),
        "float32, explicit calibration": DSparkForCausalLM(target).generate(
            input_ids, assistant=DSparkHead.from_pretrained(folder, dtype=torch.float32),
            schedule=AdaptiveSchedule(temperatures=torch.tensor(SHARP_TEMPERATURES)), **kwargs,
        ),
    }  # fmt: skip
    assert loaded.fc.weight.dtype == torch.bfloat16, "generation must not cast the user's head"
    plain = target.generate(input_ids, do_sample=False, max_new_tokens=40)

    def drafted(out) -> tuple:
        stats = out.dspark_stats
        return tuple(int(counts.sum()) for counts in (stats.num_drafted, stats.num_accepted, stats.num_plain_steps))

    expected = drafted(outputs["folder"])
    for way, out in outputs.items():
        assert torch.equal(out.sequences, plain), way
        assert drafted(out) == expected, way
        assert torch.equal(out.dspark_stats.verified_by_position, outputs["folder"].dspark_stats.verified_by_position)
    sampled = {"do_sample": True, "temperature": 0.8, "max_new_tokens": 12}  # seeds from torch's generator
    torch.manual_seed(3)
    from_folder = DSparkForCausalLM(target).generate(input_ids, assistant=str(folder), **sampled)
    torch.manual_seed(3)
    assert torch.equal(DSparkForCausalLM(target).generate(input_ids, assistant=loaded, **sampled), from_folder)
    uncalibrated = (
        DSparkForCausalLM(target)
        .generate(input_ids, assistant=loaded, schedule=AdaptiveSchedule(), **kwargs)
        .dspark_stats
    )
    assert int(uncalibrated.num_drafted.sum()) != expected[0], (
        "the calibration must change the plan (else: a weak test)"
    )


def test_a_mistyped_head_folder_is_one_line_and_never_a_hub_id(llama, tmp_path, monkeypatch):
    tiny_head(llama).save_pretrained(tmp_path / "heads" / "my-head")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DSparkCheckpointError) as error:
        DSparkForCausalLM(llama).generate(prompts(1)[0], assistant="heads/my-haed", max_new_tokens=4)
    assert error.value.__cause__ is None and error.value.__suppress_context__  # no chain of Hub errors
    assert f"no folder {tmp_path / 'heads' / 'my-haed'}" in str(error.value)
    assert f"the current directory is {tmp_path}" in str(error.value) and "did you mean 'heads/my-head'" in str(
        error.value
    )
