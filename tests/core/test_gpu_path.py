"""The GPU fast path's engine logic that runs on CPU: kernel selection, the profiling step that sizes the KV
pool from gpu_memory_utilization, and an out-of-memory error that stops one request, not the engine.

A real CUDA out-of-memory error needs a GPU: here a forward hook raises torch.OutOfMemoryError (what the CUDA
allocator raises) when a step holds more than a given number of tokens, and everything around it is real."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.engine import RequestsFailed
from kvforge.core.gpu_memory import kv_cache_budget, profile_inputs
from kvforge.core.kernels.runtime import resolve_kernels

GIB = 1 << 30


def test_kernels_auto_is_torch_on_cpu_and_triton_needs_a_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert resolve_kernels("auto", cpu) == "torch"
    assert resolve_kernels("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="kernels='triton' needs triton and a CUDA device"):
        resolve_kernels("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels("triton", cpu) == "triton"
    assert resolve_kernels("auto", cpu) == "torch"  # auto never picks the interpreter


def test_config_rejects_bad_gpu_knobs():
    from kvforge.core.config import EngineConfig

    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="kernels"):
        EngineConfig(kernels="cuda")


def test_kv_budget_is_what_utilization_leaves():
    total = 80 * GIB
    assert kv_cache_budget(total, 0.9, 20 * GIB, GIB) == int(total * 0.9) - 21 * GIB
    with pytest.raises(ValueError, match="no room is left for the KV cache"):
        kv_cache_budget(total, 0.25, 20 * GIB, GIB)


@pytest.mark.parametrize("max_tokens, max_seqs, max_model_len, block_size", [
    (2048, 64, 4096, 16), (100, 8, 30, 16), (37, 64, 2048, 5)])
def test_profile_inputs_cover_the_largest_step(max_tokens, max_seqs, max_model_len, block_size):
    inputs, blocks = profile_inputs(max_tokens, max_seqs, max_model_len, block_size)
    assert len(inputs.input_ids) == len(inputs.positions) == len(inputs.slots) == max_tokens
    assert len(inputs.logits_rows) == min(max_seqs, max_tokens)
    assert all(last - first <= max_model_len for first, last, _, _ in inputs.prefills)
    assert len(set(inputs.slots)) == max_tokens and max(inputs.slots) < blocks * block_size
    for first, last, length, table in inputs.prefills:  # each chunk's slots are its own table's
        assert length == last - first and len(table) == -(-length // block_size)
        assert inputs.slots[first:last] == [table[p // block_size] * block_size + p % block_size
                                            for p in range(length)]


def test_profiling_forward_runs_on_the_model(embedded_llm):
    """The profiling step is a well-formed batch: the real model runs it (on CPU here) into a pool of the
    reported size."""
    from kvforge.core.runner import ModelRunner

    engine = embedded_llm.engine
    runner = ModelRunner(engine.config, engine.model_path, engine.hf_config, progress=False)
    inputs, blocks = profile_inputs(96, 4, 40, 16)
    runner.allocate_kv(blocks)
    logits = runner.forward(inputs).logits
    assert logits.shape == (4, engine.hf_config.vocab_size) and bool(torch.isfinite(logits).all())
    assert int((runner.kv_cache != 0).flatten(3).any(-1).sum()) > 0


class _OutOfMemoryAbove:
    """A forward pre-hook that raises what the CUDA allocator raises when a step holds more than `limit`
    tokens (the long prompt's step), and counts the steps it refused."""

    def __init__(self, model: torch.nn.Module, limit: int) -> None:
        self.limit, self.refused = limit, 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if args[0].shape[0] > self.limit:
            self.refused += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_stops_that_request_and_the_others_go_on(embedded_llm):
    engine = embedded_llm.engine
    params = SamplingParams(temperature=0, max_tokens=8)
    alone = embedded_llm.generate("Once upon a time", params)[0].token_ids
    oom = _OutOfMemoryAbove(engine.runner.model, limit=60)
    try:
        short = engine.add_request("Once upon a time", params)
        engine.step()  # the short prompt runs alone first: its prefill fits
        long = engine.add_request("hello " * 200, params)
        outputs = []
        with pytest.raises(RequestsFailed, match="out of device memory") as failed:
            while engine.has_unfinished():
                outputs += engine.step()
        assert failed.value.request_ids == [long]
        assert not engine.has_request(long)
        while engine.has_unfinished():
            outputs += engine.step()
    finally:
        oom.handle.remove()
    assert oom.refused == 1
    final = [o for o in outputs if o.finished]
    assert [o.request_id for o in final] == [short] and final[0].token_ids == alone
    assert engine.block_pool.num_used == 0


def test_async_engine_fails_only_the_request_that_ran_out_of_memory(embedded_path):
    llm = LLM(str(embedded_path), progress=False, kv_cache_bytes=64 << 20)
    oom = _OutOfMemoryAbove(llm.engine.runner.model, limit=60)
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=6)

    async def collect(prompt):
        text = ""
        async for out in engine.add_request(prompt, params):
            text = out.text
        return text

    async def both():
        return await asyncio.gather(collect("Once upon a time"), collect("hello " * 200), return_exceptions=True)

    try:
        short, long = asyncio.run(both())
        again = asyncio.run(collect("Once upon a time"))  # the engine keeps serving
    finally:
        engine.close()
    assert oom.refused >= 1
    assert isinstance(long, RequestsFailed) and "out of device memory" in str(long)
    assert isinstance(short, str) and short and again == short
    assert llm.engine.block_pool.num_used == 0
