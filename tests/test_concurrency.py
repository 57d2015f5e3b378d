"""One model, many callers: threads generating on one target and head get exactly their solo results.

A threaded server (Gradio, a WSGI pool) shares one model between requests, as plain ``generate()``
allows. Everything a generation changes belongs to its call: the feature tap's hooks record only
their own thread's forwards, the packed linears route only the forwards of the calls that asked
for packing, and a cost table is profiled once even when several first calls race for it.

Each caller's result is computed alone first (greedy, and seeded sampling under ``FixedLength``,
where a row's tokens depend only on its seed), then again by several threads at once, started
together by a barrier and repeated so that their rounds interleave; packing on and off are mixed
among the threads. Solo and threaded runs execute the same float32 operations on the same shapes,
so the tokens are compared exactly.
"""

import threading

import pytest
import torch
from conftest import tiny_head, tiny_target
from test_generation import prompts

import spark_generate.packing as packing
import spark_generate.profiling as profiling
from spark_generate import DSparkForCausalLM, FixedLength, decode

NUM_THREADS = 4
REPEATS = 3


def caller_settings(index: int) -> dict:
    """The ``generate`` keywords of caller ``index``: greedy or sampled, batch 1 or 2, packing on or off."""
    settings = {"max_new_tokens": 12 + 3 * index, "pack_linears": index % 2 == 0 and packing.packing_supported()}
    if index % 2:
        settings.update(do_sample=True, temperature=0.9, top_p=0.95, seed=100 + index, schedule=FixedLength())
    else:
        settings.update(do_sample=False)
    return settings


def run_threads(work, num_threads: int) -> list:
    """Runs ``work(index)`` in ``num_threads`` threads started together; returns results or raises the first error."""
    barrier = threading.Barrier(num_threads)
    results: list = [None] * num_threads
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = [work(index) for _ in range(REPEATS)]
        except BaseException as error:  # reported to the main thread below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def shared_model():
    target = tiny_target(vocab_size=128, max_position_embeddings=256, lm_head_scale=4.0)
    return DSparkForCausalLM(target, tiny_head(target, block_size=5))


def test_threads_sharing_one_wrapper_get_their_solo_results(shared_model):
    inputs = [prompts(1 + index % 2, seed=index) for index in range(NUM_THREADS)]

    def work(index: int) -> torch.Tensor:
        input_ids, attention_mask = inputs[index]
        return shared_model.generate(input_ids, attention_mask=attention_mask, **caller_settings(index))

    solo = [work(index) for index in range(NUM_THREADS)]
    for index, repeats in enumerate(run_threads(work, NUM_THREADS)):
        for threaded in repeats:
            assert torch.equal(threaded, solo[index]), f"caller {index} ({caller_settings(index)}) differs"
    assert not [layer for layer in shared_model.modules() if "forward" in vars(layer)]  # nothing left patched
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in shared_model.modules())


def test_threads_sharing_one_target_through_custom_generate(shared_model):
    target, head = shared_model.model, shared_model.head
    input_ids, attention_mask = prompts(2, seed=7)

    def work(index: int) -> torch.Tensor:
        return target.generate(
            input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=10 + index,
            custom_generate=decode, dspark_head=head, dspark_pack_linears=index % 2 == 0,
        )  # fmt: skip

    solo = [work(index) for index in range(NUM_THREADS)]
    for index, repeats in enumerate(run_threads(work, NUM_THREADS)):
        assert all(torch.equal(threaded, solo[index]) for threaded in repeats)


def test_racing_first_calls_measure_a_cost_table_once(shared_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path))
    measured = []
    profile_costs = profiling.profile_costs

    def counting_profile(*args, **kwargs):
        measured.append(threading.get_ident())
        return profile_costs(*args, **kwargs, context_length=8, repeats=1)

    monkeypatch.setattr(profiling, "profile_costs", counting_profile)
    target, head = shared_model.model, shared_model.head
    tables = run_threads(lambda index: profiling.cost_table_for(target, head, 3, greedy=True), NUM_THREADS)
    assert len(measured) == 1
    assert all(table.to_dict() == tables[0][0].to_dict() for repeats in tables for table in repeats)
