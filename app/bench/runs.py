"""Driving a kvforge engine in the benches: building it, warming it up, and a timed batch of requests
submitted at once and stepped to the end."""

from __future__ import annotations

import time

SMALL_KV_BYTES = 256 << 20  # enough for the single-request benches' short prompts


# EngineConfig fields that name the model and how it loads -> their ModelSpec names
SPEC_FIELDS = {"model": "model", "dtype": "dtype", "quant": "quant", "quant_options": "quant_options",
               "decoding": "decoding", "decoding_options": "decoding_options", "tp_size": "tp", "pp_size": "pp"}


def bench_engine(**config):
    """An LLMEngine for a bench, through the app's one engine factory: `config` is EngineConfig's fields;
    no progress bar (it would mix into the tables)."""
    from kvforge.app.models.factory import build_engine
    from kvforge.app.models.spec import ModelSpec

    spec = ModelSpec(**{SPEC_FIELDS[name]: config.pop(name) for name in list(config) if name in SPEC_FIELDS})
    return build_engine(spec, progress=False, **config)


def generate_one(engine, ids: list[int], params):
    """One request on an idle engine, stepped to the end: its final RequestOutput (token ids, finish reason,
    the request's metrics)."""
    request_id = engine.add_request(ids, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def warm_up(engine, ids: list[int], ignore_eos: bool = False) -> None:
    """One 2-token greedy request, outside the measurement (first launches, allocations); the caller picks
    `ids` short enough that nothing lands in the prefix cache."""
    from kvforge.core import SamplingParams

    generate_one(engine, ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=ignore_eos))


def run_batch(engine, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None,
              ignore_eos: bool = True, constraint=None) -> dict:
    """Submit the prompts at once (greedy; each held to `constraint` when given) and step until all finish.
    Output tok/s over the whole run; decode tok/s from when every sequence has its first token (prefill
    excluded)."""
    from kvforge.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=logprobs,
                            constraint=constraint)
    ids = []
    try:
        for prompt in prompts:
            ids.append(engine.add_request(prompt, params))
        counts: dict[str, int] = {}
        finals: dict[str, list[int]] = {}
        tops: dict[str, list] = {rid: [] for rid in ids}
        start = time.perf_counter()
        decode_start, first_tokens = None, 0
        while engine.has_unfinished():
            for out in engine.step():
                counts[out.request_id] = len(out.token_ids)
                tops[out.request_id].extend(out.delta_logprobs or [])
                if out.finished:
                    finals[out.request_id] = list(out.token_ids)
            if decode_start is None and len(counts) == len(prompts):
                decode_start, first_tokens = time.perf_counter(), sum(counts.values())
        end = time.perf_counter()
    except BaseException:
        for rid in ids:  # leave the engine empty for the next step
            try:
                engine.abort(rid)
            except Exception:
                pass
        raise
    if len(finals) != len(ids):
        raise RuntimeError(f"{len(ids) - len(finals)} of {len(ids)} requests did not finish")
    short = [len(finals[rid]) for rid in ids if len(finals[rid]) != max_tokens]
    if ignore_eos and short:
        raise RuntimeError(f"{len(short)} of {len(ids)} requests ended early (e.g. after {short[0]} of "
                           f"{max_tokens} tokens)")
    generated = sum(len(t) for t in finals.values())
    decoded = generated - first_tokens
    return {"wall_s": end - start, "generated_tokens": generated, "output_tok_s": generated / (end - start),
            "decode_tok_s": decoded / (end - decode_start) if decode_start is not None and decoded > 0 else None,
            "token_ids": [finals[rid] for rid in ids], "logprobs": [tops[rid] for rid in ids]}


def decode_ready(engine, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Submit the prompts (greedy, EOS ignored) and step until each has its first token: from here every step is
    a decode step. Long prompts prefill over many steps while the first ones already decode: `max_tokens` must
    outlast that, or they finish before the rest start."""
    from kvforge.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.token_ids)
    engine.step()  # the step after the last prefill: decode only
    return ids


def lasting_max_tokens(engine, prompts: list[list[int]]) -> int:
    """The most tokens a request for each prompt may ask for (its sequence within the context and the KV pool):
    enough that none finishes while the others still prefill."""
    window = min(engine.max_model_len, engine.stats().kv_blocks_total * engine.config.block_size)
    return window - max(len(p) for p in prompts)


class SteadyBatch:
    """An engine's batch of prompts prefilled and decoding (none finished, none waiting or preempted): each `step()`
    runs and times one decode step with every sequence in it; `close()` aborts them."""

    def __init__(self, engine, prompts: list[list[int]]) -> None:
        self.engine, self.size = engine, len(prompts)
        self.ids = decode_ready(engine, prompts, max_tokens=lasting_max_tokens(engine, prompts))

    def step(self) -> float:
        """One decode step's seconds."""
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        if len(outputs) != self.size or self.engine.stats().running != self.size:
            raise RuntimeError(f"{len(outputs)} of {self.size} sequences decoded in a step: the KV budget is too small "
                               "for the batch (preempted) or a sequence ended")
        return elapsed

    def close(self) -> None:
        for rid in self.ids:
            self.engine.abort(rid)
