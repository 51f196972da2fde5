"""LLMEngine (the synchronous step loop) and LLM (the offline API).

This loop is deliberately small: add requests, step until done. Each step schedules a batch,
runs it, appends the sampled tokens, streams text deltas and frees the KV blocks of finished
sequences.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.core.config import EngineConfig
from kvforge.core.kv.blocks import BlockPool
from kvforge.core.loader import load_config, resolve_model
from kvforge.core.request import Sequence
from kvforge.core.runner import ModelRunner
from kvforge.core.sampling import SamplingParams
from kvforge.core.scheduler import Scheduler
from kvforge.core.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request; `text` / `token_ids` are the totals so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: dict[str, Any] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True, **overrides: Any) -> None:
        self.config = config or EngineConfig(**overrides)
        self.model_path = resolve_model(self.config.model)
        self.hf_config = load_config(self.model_path)
        self.tokenizer = Tokenizer(self.model_path)
        self.runner = ModelRunner(self.config, self.model_path, self.hf_config, progress=progress)
        self.block_pool = BlockPool(self.runner.num_blocks)
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        self.scheduler = Scheduler(self.block_pool, self.config.block_size, self.max_model_len,
                                   self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self._seed_rng = torch.Generator().manual_seed(self.config.seed)
        self._ids = itertools.count()
        self._sequences: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(
                torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            generator = torch.Generator().manual_seed(seed)
        seq = Sequence(request_id, prompt_ids, params, generator)
        self.scheduler.add(seq)  # raises RequestRejected before anything runs
        self._sequences[request_id] = seq
        self._detokenizers[request_id] = self.tokenizer.detokenizer(params.skip_special_tokens)
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> None:
        seq = self._sequences.get(request_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self._release(request_id)

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        tokens = self.runner.run(batch)
        outputs = []
        for item, token in zip(batch, tokens):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if token is None:
                continue
            seq.output_token_ids.append(token)
            detok = self._detokenizers[seq.request_id]
            reason = self._finish_reason(seq, token)
            delta = "" if reason == "stop" and self._is_stop_token(seq, token) else detok.step(token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(RequestOutput(
                seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), detok.text, delta, [token],
                finished=reason is not None, finish_reason=reason))
            if reason is not None:
                self._release(seq.request_id)
        return outputs

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in seq.params.stop_token_ids or (
            not seq.params.ignore_eos and token in self.tokenizer.eos_token_ids)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if self._is_stop_token(seq, token):
            return "stop"
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            return "length"
        return None

    def _release(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)
        self._detokenizers.pop(request_id, None)


class LLM:
    """Offline API: `LLM().generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, progress: bool = True, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config), progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
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
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [CompletionOutput(final[i].prompt_token_ids, final[i].token_ids, final[i].text,
                                 final[i].finish_reason) for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | None = None) -> list[CompletionOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, params)
