"""LLM: the offline Python API over one LLMEngine, `LLM().generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge.core.config import EngineConfig
from kvforge.core.engine import LLMEngine
from kvforge.core.images import ImagePrompt
from kvforge.core.output import RequestOutput, TokenLogprob
from kvforge.core.pooling import PoolingParams
from kvforge.core.sampling import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    index: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprob] | None = None  # params.prompt_logprobs: prompt token i + 1's at [i]


class LLM:
    """Offline API: `LLM().generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, progress: bool = True, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config), progress=progress)
        self.tokenizer = self.engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """What generate / chat use without params: the model's sampling defaults (core/generation_defaults.py)."""
        return self.engine.generation_defaults.params()

    def generate(self, prompts: str | list[str] | list[list[int]] | ImagePrompt | list[ImagePrompt],
                 params: SamplingParams | list[SamplingParams] | None = None):
        """One CompletionOutput per prompt; a list of n of them for requests with n > 1. An ImagePrompt carries its
        images (a vision-language model: core/images.py)."""
        if isinstance(prompts, (str, ImagePrompt)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or self.default_sampling_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for request_id in ids:  # all or nothing: do not leave half a batch queued
                self.engine.abort(request_id)
            raise
        final: dict[tuple[str, int], RequestOutput] = {}
        logprobs: dict[tuple[str, int], list[TokenLogprob]] = {}
        prompt_logprobs: dict[tuple[str, int], list[TokenLogprob]] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.prompt_logprobs is not None:
                    prompt_logprobs[(out.request_id, out.index)] = out.prompt_logprobs
                if out.delta_logprobs:
                    logprobs.setdefault((out.request_id, out.index), []).extend(out.delta_logprobs)
                if out.finished:
                    final[(out.request_id, out.index)] = out
        results = []
        for request_id, p in zip(ids, params_list):
            samples = [_completion(final[(request_id, i)], logprobs.get((request_id, i)), p,
                                   prompt_logprobs.get((request_id, i))) for i in range(p.n)]
            results.append(samples[0] if p.n == 1 else samples)
        return results

    def embed(self, prompts: str | list[str] | list[list[int]], normalize: bool | None = None) -> list[list[float]]:
        """One embedding per prompt (core/pooling.py: pooled as the model says, by default the mean of its last hidden
        states, L2-normalised; `normalize` overrides), batched through the engine like generation."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = []
        try:
            for prompt in prompts:
                ids.append(self.engine.add_request(prompt, PoolingParams(normalize)))
        except Exception:
            for request_id in ids:  # all or nothing, as generate()
                self.engine.abort(request_id)
            raise
        embeddings: dict[str, list[float]] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.embedding is not None:
                    embeddings[out.request_id] = out.embedding
        return [embeddings[request_id] for request_id in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None):
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, params)


def _completion(out: RequestOutput, logprobs: list[TokenLogprob] | None, params: SamplingParams,
                prompt_logprobs: list[TokenLogprob] | None) -> CompletionOutput:
    return CompletionOutput(out.prompt_token_ids, out.token_ids, out.text, out.finish_reason, out.index,
                            out.num_cached_tokens, (logprobs or []) if params.logprobs is not None else None,
                            out.metrics or {}, prompt_logprobs)
