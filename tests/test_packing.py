"""Packed CPU linears: the same function as ``nn.Linear``, restored on exit, and lossless in generation.

The packed path changes only the order of float32 additions, so its outputs are compared with
``F.linear`` to a float32 tolerance, and generations with it to plain ``generate()`` token for token
(greedy, float32 targets of three architectures, batch with left padding, an oracle drafter so
that whole blocks are accepted, and the adaptive schedule's plain steps).
"""

import json
import threading
import time

import pytest
import torch
from conftest import tiny_head
from conftest import tiny_target as shared_tiny_target
from test_config import fake_load
from test_generation import oracle, prompts
from torch import nn

import spark_generate.packing as packing
from spark_generate import DSparkForCausalLM, decode, packed_linears
from spark_generate.profiling import cache_folder, cost_table_for, profile_costs

pytestmark = pytest.mark.skipif(not packing.packing_supported(), reason="this PyTorch build has no oneDNN linear")


@pytest.fixture(autouse=True)
def every_row_packed(monkeypatch):
    """Packed layers run their packed kernels at every row count, whatever this machine measures.

    So that these tests exercise the packed path everywhere; the crossover tests measure (mocked).
    """
    monkeypatch.setenv("SPARK_GENERATE_PROFILE", "0")


def tiny_target(architecture: str = "llama"):
    """A random float32 target (vocabulary 128, pad 0, EOS 1), like test_generation's but packable."""
    return shared_tiny_target(architecture, vocab_size=128, max_position_embeddings=256, dtype=torch.float32)


class ScaledLinear(nn.Linear):
    """A subclass with its own forward: never packed."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(inputs)


def layers_with_own_forward(model: nn.Module) -> list[nn.Module]:
    return [layer for layer in model.modules() if "forward" in vars(layer)]


def test_packed_linear_computes_the_same_function_and_is_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 96), nn.GELU(), nn.Linear(96, 24, bias=False), ScaledLinear(24, 8))
    inputs = torch.randn(3, 5, 40)
    with torch.no_grad():
        expected = model(inputs)
        with packed_linears(model) as num_packed:
            assert num_packed == 2  # the two plain nn.Linear layers, not the subclass
            assert len(layers_with_own_forward(model)) == 2
            packed = model(inputs)
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
    assert not layers_with_own_forward(model)


def test_packing_is_restored_after_an_error_and_reentrant():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(RuntimeError, match="inside"), packed_linears(model):
        raise RuntimeError("inside")
    assert not layers_with_own_forward(model)
    with packed_linears(model) as outer:
        with packed_linears(model) as inner:
            assert (outer, inner) == (2, 0)
        assert len(layers_with_own_forward(model)) == 2  # the outer block still packs them
    assert not layers_with_own_forward(model)
    with packed_linears(model, enabled=False) as num_packed:
        assert num_packed == 0 and not layers_with_own_forward(model)


def test_gradients_changed_weights_and_float64_take_the_right_path():
    torch.manual_seed(0)
    layer, inputs = nn.Linear(16, 12), torch.randn(4, 16)
    with packed_linears(layer):
        output = layer(inputs)  # gradients on: F.linear, so backward works
        output.sum().backward()
        assert layer.weight.grad is not None
    with torch.no_grad():
        layer.weight.mul_(-3)  # changed in place: packed again at the next block
        with packed_linears(layer):
            torch.testing.assert_close(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))
    layer.double()
    with packed_linears(layer) as num_packed:
        assert num_packed == 0  # float64 weights are not packed


def packed_differs_from_linear() -> tuple[nn.Linear, torch.Tensor]:
    """A layer and inputs on which oneDNN's packed sum and ``F.linear`` round differently (checked)."""
    torch.manual_seed(0)
    layer, inputs = nn.Linear(1536, 64), torch.randn(3, 1536)
    with torch.no_grad(), packed_linears(layer):
        assert not torch.equal(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))
    return layer, inputs


@pytest.mark.parametrize("write", ["data_copy", "data_mul", "replace_same_shape", "swap_rows", "one_element"])
def test_a_weight_changed_any_way_is_packed_again(write):
    torch.manual_seed(0)
    layer, inputs = nn.Linear(32, 24), torch.randn(5, 32)
    with torch.no_grad(), packed_linears(layer):
        layer(inputs)  # packed and cached
    version = layer.weight._version
    new_weight = torch.randn(24, 32)
    if write == "data_copy":  # EMA and weight-loading code: bumps neither the version nor the data pointer
        layer.weight.data.copy_(new_weight)
    elif write == "data_mul":
        layer.weight.data.mul_(-2)
    elif write == "replace_same_shape":  # a new tensor: version 0 again, like the old one's
        layer.weight = nn.Parameter(new_weight)
    elif write == "swap_rows":
        layer.weight.data.copy_(layer.weight.data.flip(0))
    else:
        layer.weight.data[7, 3] += 1.0
    assert write == "replace_same_shape" or layer.weight._version == version
    with torch.no_grad(), packed_linears(layer):
        torch.testing.assert_close(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))


def test_packing_belongs_to_the_call_not_the_layer():
    """Threads share the layer: one packing it changes neither what nor how long another computes."""
    layer, inputs = packed_differs_from_linear()
    with torch.no_grad():
        plain = nn.functional.linear(inputs, layer.weight, layer.bias)
        with packed_linears(layer):
            packed = layer(inputs)
    entered, leave, left = threading.Event(), threading.Event(), threading.Event()

    def other_call() -> None:
        with torch.no_grad(), packed_linears(layer):
            entered.set()
            leave.wait(timeout=60)
        left.set()

    thread = threading.Thread(target=other_call, daemon=True)
    thread.start()
    try:
        assert entered.wait(timeout=60)
        with torch.no_grad():
            assert torch.equal(layer(inputs), plain)  # another thread packs it; this call did not ask to
            with packed_linears(layer) as num_packed:
                assert num_packed == 1
                leave.set()
                assert left.wait(timeout=60)  # the other call left first: this one still packs
                assert torch.equal(layer(inputs), packed)
    finally:
        leave.set()
        thread.join()
    assert not layers_with_own_forward(layer)


FROM_FOUR = (False, False, True, True, True, True, True)  # packed wins from 4 rows on (CROSSOVER_ROWS)
AT_TWO_ENDS = (True, True, False, False, False, False, True)  # ... at 1 and 2 rows, and from 64


@pytest.fixture
def crossover(monkeypatch, tmp_path):
    """The row counts that ran packed and the shapes timed (packed winning ``FROM_FOUR``), from a fresh cache."""
    monkeypatch.delenv("SPARK_GENERATE_PROFILE")
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    monkeypatch.setattr(packing, "_PACKED_WINS", {})
    packed_calls, timed = [], []
    packed_linear = packing._packed_linear
    monkeypatch.setattr(
        packing, "_packed_linear", lambda inputs, *args: packed_calls.append(inputs.numel() // inputs.shape[-1])
        or packed_linear(inputs, *args),
    )  # fmt: skip
    monkeypatch.setattr(
        packing, "_time_passes", lambda weights: timed.append([tuple(w.shape) for w, _ in weights]) or FROM_FOUR
    )
    return packed_calls, timed


def test_each_module_runs_packed_at_the_row_counts_where_it_measured_faster(crossover, monkeypatch):
    packed_calls, timed = crossover
    torch.manual_seed(0)
    model, head = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 24)), nn.Linear(24, 8)
    with torch.no_grad(), packed_linears(model, head):
        for shape in [(1, 40), (3, 40), (1, 3, 40), (4, 40), (2, 3, 40), (200, 40)]:
            inputs = torch.randn(shape)
            output = model[0](inputs)
            torch.testing.assert_close(output, nn.functional.linear(inputs, model[0].weight, model[0].bias))
            if shape[0] * (shape[1] if len(shape) == 3 else 1) < 4:
                assert torch.equal(output, nn.functional.linear(inputs, model[0].weight, model[0].bias))  # sgemm
    assert packed_calls == [4, 6, 200]  # rows (batch × tokens) of the counts where packed won, and above
    assert timed == [[(24, 40), (24, 24)], [(8, 24)]]  # once per module, over its layers in order
    [path] = (cache_folder() / "packing").glob("*.json")
    saved = json.loads(path.read_text())
    assert list(saved["packed_from"].values()) == [[4, 8, 16, 32, 64]] * 2
    assert saved["key"]["threads"] == torch.get_num_threads()
    packing._PACKED_WINS.clear()  # a new process: reads the file, measures nothing
    with torch.no_grad(), packed_linears(model, head):
        pass
    assert len(timed) == 2
    path.write_text("{damaged")  # measured again and replaced
    packing._PACKED_WINS.clear()
    monkeypatch.setattr(packing, "_time_passes", lambda weights: timed.append(len(weights)) or AT_TWO_ENDS)
    with torch.no_grad(), packed_linears(model):
        packed_calls.clear()
        for rows in (1, 2, 3, 4, 16, 63, 64, 1000):  # now packed at 1-3 (the counts 1 and 2) and from 64 rows
            model[0](torch.randn(rows, 40))
    assert timed[2:] == [2] and list(json.loads(path.read_text())["packed_from"].values()) == [[1, 2, 64]]
    assert packed_calls == [1, 2, 3, 64, 1000]
    monkeypatch.setenv("SPARK_GENERATE_PROFILE", "0")  # nothing measured: packed at every row count
    packed_calls.clear()
    with torch.no_grad(), packed_linears(model):
        model[0](torch.randn(5, 40))
    assert packed_calls == [5] and len(timed) == 3


def test_a_call_reads_and_packs_a_weight_only_when_a_forward_runs_it_packed(crossover, monkeypatch):
    packed_calls, _ = crossover
    model = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 24))
    with torch.no_grad(), packed_linears(model):  # measured (packed from 4 rows): every weight packed once to time it
        pass
    packing.clear_packed_linears()
    checked = []
    checksum = packing._checksum
    monkeypatch.setattr(packing, "_checksum", lambda weight: checked.append(tuple(weight.shape)) or checksum(weight))
    with torch.no_grad(), packed_linears(model):
        for _ in range(3):
            model(torch.randn(1, 40))  # one row: sgemm, the weights are neither read nor packed
        assert not checked and len(packing._PACKED) == 0
        model[0](torch.randn(4, 40))  # four rows: the first layer runs packed, checked once in this call
        model[0](torch.randn(8, 40))
    assert checked == [(24, 40)] and packed_calls == [4, 8] and len(packing._PACKED) == 1
    with torch.no_grad(), packed_linears(model):  # the next call checks it again before its first packed use
        model(torch.randn(4, 40))
    assert checked == [(24, 40), (24, 40), (24, 24)]


def test_a_crossover_timed_on_a_busy_machine_serves_the_process_but_is_not_saved(crossover, monkeypatch):
    packed_calls, timed = crossover
    monkeypatch.setenv("SPARK_GENERATE_MAX_OTHER_CORES", "0.25")
    fake_load(monkeypatch, 10**9)  # other processes held every core while it was timed
    model = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 24))
    busy = pytest.warns(RuntimeWarning, match="crossover for 2 linear layers was measured while other processes")
    with busy, torch.no_grad(), packed_linears(model):
        model(torch.randn(4, 40))
    assert packed_calls == [4, 4] and len(timed) == 1  # used as timed
    assert not (cache_folder() / "packing").exists()
    with torch.no_grad(), packed_linears(model):  # the same process: not timed again
        pass
    assert len(timed) == 1
    packing._PACKED_WINS.clear()  # a new process, on a quiet machine now: timed again, and saved
    fake_load(monkeypatch, 0)
    with torch.no_grad(), packed_linears(model):
        pass
    assert len(timed) == 2 and len(list((cache_folder() / "packing").glob("*.json"))) == 1


def test_a_module_whose_packed_kernels_never_win_is_not_routed_and_keeps_no_copies(crossover, monkeypatch):
    packed_calls, timed = crossover
    monkeypatch.setattr(packing, "_time_passes", lambda weights: timed.append(len(weights)) or (False,) * 7)
    packing.clear_packed_linears()
    model, head = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 24)), nn.Linear(24, 8)
    with torch.no_grad(), packed_linears(model, head) as num_packed:
        assert num_packed == 0 and not layers_with_own_forward(model) and not layers_with_own_forward(head)
        model(torch.randn(64, 40))
    assert timed == [2, 1] and not packed_calls and len(packing._PACKED) == 0
    with torch.no_grad(), packed_linears(model, head) as num_packed:  # known now: nothing timed or packed
        assert num_packed == 0
    assert timed == [2, 1] and len(packing._PACKED) == 0


@pytest.mark.parametrize("slow_below", [0, 8, 65])
def test_the_passes_are_timed_at_every_row_count(monkeypatch, slow_below):
    """Against packed kernels that sleep 20 ms below ``slow_below`` rows and return at once from it.

    (20 ms, not less: on a 2-core VM the first ``sgemm`` after such a sleep can take 7 ms to wake its threads.)
    """
    layers = [nn.Linear(256, 256), nn.Linear(256, 128)]
    weights = [
        (layer.weight.detach(), torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None))
        for layer in layers
    ]
    fake = torch.zeros(64, 256)

    def packed_linear(inputs, packed, bias):
        if len(inputs) < slow_below:
            time.sleep(0.02)
        return fake

    monkeypatch.setattr(packing, "_packed_linear", packed_linear)
    assert packing._time_passes(weights) == tuple(rows >= slow_below for rows in packing.CROSSOVER_ROWS)


def test_the_memory_guard_counts_half_of_the_free_memory_and_only_unpacked_layers(monkeypatch):
    target = tiny_target()
    packing.clear_packed_linears()
    needed = sum(layer.weight.numel() * 4 for layer in target.modules() if type(layer) is nn.Linear)

    def free_bytes(amount: int):
        monkeypatch.setattr(packing.os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else amount)

    free_bytes(int(needed * 1.5))
    assert not packing.resolve_pack_linears(target, None)  # fits in the free memory, not in half of it
    free_bytes(int(needed * 2.5))
    assert packing.resolve_pack_linears(target, None)
    with torch.no_grad(), packed_linears(target):
        target(torch.ones(1, 4, dtype=torch.long))  # every copy made at its first use: nothing more is needed
    free_bytes(int(needed * 0.1))
    assert packing.resolve_pack_linears(target, None)
    packing.clear_packed_linears()
    assert not packing.resolve_pack_linears(target, None)


def test_resolve_pack_linears(monkeypatch):
    target = tiny_target()
    assert packing.resolve_pack_linears(target, None)
    assert not packing.resolve_pack_linears(target, False)
    assert not packing.resolve_pack_linears(target.double(), None)
    assert packing.resolve_pack_linears(target, True)
    monkeypatch.setenv("SPARK_GENERATE_PACK_LINEARS", "0")
    assert not packing.resolve_pack_linears(target.float(), None)
    monkeypatch.delenv("SPARK_GENERATE_PACK_LINEARS")
    packing.clear_packed_linears()
    monkeypatch.setattr(packing.os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else 1000)
    assert not packing.resolve_pack_linears(target, None)  # copies larger than half of 1,000 free bytes
    assert packing.resolve_pack_linears(target, True)  # forced


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_packed_generation_matches_plain_greedy(architecture, batch_size):
    target = tiny_target(architecture)
    head = tiny_head(target, block_size=5)
    input_ids, attention_mask = prompts(batch_size)
    plain = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=23)
    for extra in ({}, oracle(plain, corrupt_seed=batch_size)):  # the default schedule; ragged accepted blocks
        spec = target.generate(
            input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=23, custom_generate=decode,
            dspark_head=head, dspark_pack_linears=True, **extra,
        )  # fmt: skip
        assert torch.equal(plain, spec)
    assert not layers_with_own_forward(target) and not layers_with_own_forward(head)


def test_the_model_api_and_cost_tables_know_the_packing(monkeypatch, tmp_path):
    monkeypatch.delenv("SPARK_GENERATE_PROFILE")  # cost tables measured, in a cache of this test's own
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    target = tiny_target()
    head = tiny_head(target)
    model = DSparkForCausalLM(target)
    input_ids, attention_mask = prompts(2)
    outputs = [
        model.generate(input_ids, attention_mask=attention_mask, assistant=head, max_new_tokens=9, pack_linears=pack)
        for pack in (True, False)
    ]
    assert torch.equal(*outputs)
    tables = {pack: cost_table_for(target, head, 2, greedy=True, pack_linears=pack) for pack in (True, False)}
    keys = [json.loads(path.read_text())["key"] for path in (cache_folder() / "costs").glob("*.json")]
    assert {key["packed_linears"] for key in keys if key["batch_size"] == 2} == {True, False}
    packed_from = [key["packed_from"] for key in keys if key["packed_linears"]]
    assert packed_from and all(counts == packing.packed_row_counts(target, head) for counts in packed_from)
    assert all(table.num_tokens == tables[True].num_tokens for table in tables.values())


def test_profile_costs_measures_the_packing_it_is_given(monkeypatch):
    target = tiny_target()
    head = tiny_head(target)
    calls = []
    dispatch_forward = packing._dispatch_forward
    monkeypatch.setattr(packing, "_dispatch_forward", lambda *args: calls.append(1) or dispatch_forward(*args))
    for pack in (False, True):
        calls.clear()
        profile_costs(target, head, batch_size=2, context_length=8, repeats=1, pack_linears=pack)
        assert bool(calls) == pack
        assert not layers_with_own_forward(target) and not layers_with_own_forward(head)
