"""AsyncEngine: the engine loop in a background thread with per-request async streams."""

from __future__ import annotations

import asyncio

import pytest

from kvforge.core import AsyncEngine, RequestRejected, SamplingParams
from tests.helpers.engine_helpers import async_idle

PROMPTS = ["The three primary colours are", "def fibonacci(n):", "Paris is the capital of", "Once upon a time"]


@pytest.fixture(scope="module")
def async_engine(embedded_llm):
    engine = AsyncEngine(embedded_llm.engine)
    yield engine
    engine.close()


async def until_idle(engine: AsyncEngine, timeout: float = 10) -> bool:
    """Wait inside the running event loop, so the stream's final (abort) output is still delivered to it."""
    for _ in range(int(timeout / 0.05)):
        if async_idle(engine):
            return True
        await asyncio.sleep(0.05)
    return False


async def collect(stream) -> tuple[str, list[int], list, str]:
    text, tokens, deltas, reason = "", [], [], None
    async for out in stream:
        deltas.append(out.delta_text)
        text += out.delta_text
        tokens.extend(out.delta_token_ids)
        reason = out.finish_reason
        if out.finished:
            assert out.text == text and out.token_ids == tokens
    return text, tokens, deltas, reason


def test_concurrent_streams_equal_offline_results(async_engine, embedded_llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = [o.token_ids for o in embedded_llm.generate(PROMPTS, params)]

    async def main():
        streams = [async_engine.add_request(p, params) for p in PROMPTS]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(main())
    assert [r[1] for r in results] == offline
    assert all(r[3] == "length" for r in results)
    assert all(len(r[2]) > 1 for r in results)  # streamed in several deltas, not one final blob
    assert async_idle(async_engine)


def test_abort_mid_stream_frees_blocks_and_ends_with_abort(async_engine):
    async def main():
        stream = async_engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        outputs = []
        async for out in stream:
            outputs.append(out)
            if len(outputs) == 3:
                async_engine.abort(stream.request_id)
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs[-1].token_ids) < 200
    assert async_idle(async_engine)


def test_stopping_one_sample_ends_it_with_stop_and_the_others_go_on(async_engine):
    """What the server does when a reader has a sample's whole reply (a forced tool call repeated): that sample
    ends as "stop", its blocks freed; its siblings run to their own end."""
    async def main():
        params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=40, ignore_eos=True)
        stream = async_engine.add_request(PROMPTS[3], params)
        finals, seen = {}, {}
        async for out in stream:
            seen[out.index] = seen.get(out.index, 0) + 1
            if out.index == 1 and seen[1] == 2:
                stream.stop_sample(1)
            if out.finished:
                finals[out.index] = out
        return finals

    finals = asyncio.run(main())
    assert finals[1].finish_reason == "stop" and len(finals[1].token_ids) < 40
    assert [finals[i].finish_reason for i in (0, 2)] == ["length", "length"]
    assert async_idle(async_engine)


def test_leaving_the_stream_early_aborts_the_request(async_engine):
    async def main():
        stream = async_engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for _ in stream:
            break  # like a client that disconnects
        await stream.aclose()
        return await until_idle(async_engine)  # the abort is applied at the engine's next step

    assert asyncio.run(main())


def test_cancelled_consumer_aborts_the_request(async_engine):
    async def main():
        stream = async_engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        task = asyncio.create_task(collect(stream))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await until_idle(async_engine)

    assert asyncio.run(main())


def test_bad_requests_fail_at_once_and_queue_nothing(async_engine):
    async def main():
        with pytest.raises(RequestRejected, match="maximum context length"):
            async_engine.add_request("hi", SamplingParams(max_tokens=10**6))
        with pytest.raises(ValueError, match="prompt token ids"):
            async_engine.add_request([10**9], SamplingParams(max_tokens=4))

    asyncio.run(main())
    assert async_idle(async_engine)
    assert async_engine.stats().running == 0


def test_n_samples_stream_every_index(async_engine):
    async def main():
        stream = async_engine.add_request(PROMPTS[3], SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=6))
        finished = {}
        async for out in stream:
            if out.finished:
                finished[out.index] = out.token_ids
        return finished

    finished = asyncio.run(main())
    assert sorted(finished) == [0, 1, 2] and all(len(t) == 6 or t[-1] == 2 for t in finished.values())
    assert async_idle(async_engine)


def test_a_consumer_loop_that_closes_early_does_not_stop_the_engine(async_engine):
    async def abandon():
        async_engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))

    asyncio.run(abandon())  # its event loop is gone before any output can be delivered

    async def later():
        stream = async_engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        return (await collect(stream))[3], await until_idle(async_engine)

    assert asyncio.run(later()) == ("length", True)
