"""LLMEngine: the synchronous step loop (the offline API over it is core/llm.py).

One step: the scheduler plans it, the runner runs the plan and returns the logits of the sequences that
get tokens, the sampler turns them into tokens (verifying drafts), the scheduler applies them
(acceptance, forks, stop checks, finishing) and the engine turns the updates into text deltas.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kvforge.core.config import EngineConfig
from kvforge.core.constraint import Constraint, GrammarCompiler
from kvforge.core.draft_target import EngineDraftTarget
from kvforge.core.generation_defaults import GenerationDefaults, model_generation_defaults
from kvforge.core.images import ImageInput, ImagePrompt, cache_keys, check_images
from kvforge.core.kv.blocks import BlockPool
from kvforge.core.kv.index import KVIndex
from kvforge.core.kv.manager import KVCacheManager
from kvforge.core.kv.persist import PersistedKV
from kvforge.core.kv.pool_setup import kv_budget, model_fingerprint
from kvforge.core.loader import load_config, resolve_model
from kvforge.core.metrics import EngineStats, RateMeter, RuntimeInfo, request_metrics
from kvforge.core.output import OutputState, RequestOutput, TokenLogprob
from kvforge.core.plugins import resolve_quant
from kvforge.core.pooling import PoolingParams, model_pooling
from kvforge.core.request import Sequence
from kvforge.core.runner import ModelRunner
from kvforge.core.runner_api import Runner
from kvforge.core.sampler import SamplingBatch, StepTokens, sample_tokens
from kvforge.core.sampling import SamplingParams
from kvforge.core.scheduler import Scheduler
from kvforge.core.speculative import Speculator, spec_metrics
from kvforge.core.step import ScheduledSeq, SeqUpdate, StepPlan
from kvforge.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # decode batches up to this size replay CUDA graphs; larger ones run eagerly


class RequestsFailed(RuntimeError):
    """A step failed in a way that stops only these requests (the engine aborted them); the others go on."""

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True, *,
                 kv_index: KVIndex | None = None, **overrides: Any) -> None:
        """`kv_index`: the persisted tier's index, owned by the caller (the server shares its database with
        every engine it builds); without one, the engine opens config.db_url itself and closes it in close()."""
        self.config = config or EngineConfig(**overrides)
        self.model_path = resolve_model(self.config.model, native_gguf=self.config.native_gguf)
        self.hf_config = load_config(self.model_path)
        if getattr(self.hf_config, "vision_config", None) is not None and \
                self.config.tp_size * self.config.pp_size > 1:  # the ranks' step messages carry no pixels yet
            raise ValueError("a vision-language model runs in one process: tensor and pipeline parallelism take "
                             "text-only models")
        # a quantized checkpoint decides its method and layout options
        quant, quant_options = resolve_quant(self.config.quant, self.config.quant_options, self.hf_config,
                                             self.model_path)
        self.config = dataclasses.replace(self.config, quant=quant, quant_options=quant_options)
        self.tokenizer = Tokenizer(self.model_path)
        self.pooling = model_pooling(self.model_path)  # how embedding requests are pooled (core/pooling.py)
        # what a request leaving a sampling field out gets (core/generation_defaults.py); the user's over the model's
        self.generation_defaults = GenerationDefaults(self.config.sampling_defaults, "settings").over(
            model_generation_defaults(self.model_path, [self.config.model]))
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.hf_config.vocab_size, self.tokenizer.eos_token_ids)
        if self.config.num_threads:  # process-wide: set here, by the engine that owns the process, not per runner
            torch.set_num_threads(self.config.num_threads)
        if self.config.pp_size > 1:
            from kvforge.core.pp import PipelineRunner

            self.runner: Runner = PipelineRunner(self.config, self.model_path, self.hf_config, progress=progress)
        elif self.config.tp_size > 1:
            from kvforge.core.tp import ParallelRunner

            self.runner = ParallelRunner(self.config, self.model_path, self.hf_config, progress=progress)
        else:
            self.runner = ModelRunner(self.config, self.model_path, self.hf_config, progress=progress)
        self.persisted = self._opened_kv_index = None
        try:
            self.speculator = None
            if self.config.decoding != "none":
                self.speculator = Speculator(self.config.decoding, self.config.decoding_options, EngineDraftTarget(
                    self.config, self.hf_config, self.model_path, self.tokenizer, self.runner.model,
                    self.runner.kernels))
                self.config = dataclasses.replace(self.config, decoding_options=self.speculator.options)
            self.max_model_len = self.config.context_length(self.hf_config)
            # a drafter with KV of its own shares the budget: both pools hold the same number of tokens
            draft_bytes = self.speculator.proposer.kv_bytes_per_block(self.config.block_size) if self.speculator else 0
            num_blocks = self.config.num_kv_blocks or max(
                1, kv_budget(self.config, self.runner, self.max_model_len) // (
                    self.runner.kv_bytes_per_block + draft_bytes))
            self.runner.allocate_kv(num_blocks)
            # where each part of the model lives, stage by stage: fixed from here on (the model card, the dashboard)
            self.placement = [stage.as_dict() for stage in self.runner.placement()]
            if self.speculator:
                self.speculator.proposer.allocate_kv(num_blocks)
            self._capture_graphs()
            self.block_pool = BlockPool(num_blocks, enable_caching=self.config.enable_prefix_caching)
            self.fingerprint = model_fingerprint(self.config, self.model_path, self.tokenizer)
            if self.config.persist_kv and self.config.enable_prefix_caching:
                if kv_index is None:
                    from kvforge.core.kv.sql_index import SQLKVIndex  # SQLAlchemy only with the persisted tier

                    kv_index = self._opened_kv_index = SQLKVIndex.open(self.config.resolved_db_url())
                self.persisted = PersistedKV(kv_index, self.config.resolved_data_dir() / "kv", self.fingerprint,
                                             self.runner, self.config.kv_disk_budget_bytes, self.block_pool.holds)
            self.kv = KVCacheManager(self.block_pool, self.config.block_size, self.fingerprint, self.persisted)
            self.scheduler = Scheduler(self.kv, self.max_model_len, self.config.max_num_seqs,
                                       self.config.max_num_batched_tokens, self.tokenizer.eos_token_ids,
                                       self.speculator)
        except BaseException:
            self._close_parts()  # tensor-parallel ranks are processes, the index a database: do not leave them
            raise
        self._seed_rng = torch.Generator().manual_seed(self.config.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its samples
        self._generation_rate, self._prompt_rate = RateMeter(), RateMeter()
        self._totals = dict(requests_finished=0, prompt_tokens_total=0, cached_tokens_total=0,
                            generated_tokens_total=0)
        self._in_flight: deque[tuple[StepPlan, Any]] = deque()  # steps launched, not yet sampled (oldest first)
        self._busy: set[int] = set()  # ids of the sequences in those steps

    def _capture_graphs(self) -> None:
        """CUDA graphs for decode batches (CUDA, Triton kernels, one rank); a capture that fails leaves the
        eager path, with a warning."""
        runner = self.runner
        if not (self.config.cuda_graphs and self.config.tp_size == self.config.pp_size == 1
                and runner.device.type == "cuda" and runner.kernels == "triton"):
            return
        if not runner.cuda_graph_safe:  # e.g. bitsandbytes' int8 matmul finds outliers on the host
            log.info("the %s quant method is not CUDA-graph safe; decode runs eagerly", self.config.quant)
            return
        try:
            runner.enable_decode_graphs(self.max_model_len, min(self.config.max_num_seqs, MAX_GRAPH_BATCH))
        except Exception:
            log.warning("capturing CUDA graphs failed; decode runs eagerly", exc_info=True)
            runner.graphs = None

    # --- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int] | ImagePrompt, params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, group: str | None = None) -> str:
        """Queue a generation request, or with PoolingParams an embedding request (its one final output holds
        the embedding). `group`: the client request it is part of (an embeddings request's inputs): the scheduler
        shares the engine fairly between groups (core/scheduler.py); None: a group of its own. An ImagePrompt
        carries its images (core/images.py), for a model with a vision tower."""
        params = params or SamplingParams()
        images = prompt.images if isinstance(prompt, ImagePrompt) else []
        return self.add_validated(self.validate_prompt(prompt, params), params, request_id, group, images)

    def add_validated(self, prompt_ids: list[int], params: SamplingParams | PoolingParams,
                      request_id: str | None = None, group: str | None = None,
                      images: list[ImageInput] | None = None) -> str:
        """add_request for a prompt validate_prompt has checked (AsyncEngine checks before queueing it for the engine
        thread): the one admissibility check a request passes."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        images = images or []
        keys = cache_keys(prompt_ids, images) if images else None
        if isinstance(params, PoolingParams):
            seq = Sequence(request_id, prompt_ids, params, arrival=next(self._arrivals), group=group, images=images,
                           prompt_keys=keys)
            self.scheduler.add(seq)
            self._requests[request_id] = [seq]
            self._totals["prompt_tokens_total"] += len(prompt_ids)
            return request_id
        base_seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        arrival = next(self._arrivals)
        samples = []
        for index in range(params.n):
            # Sample i of a seeded request draws from its own stream; sample 0 equals the n = 1 stream.
            generator = None if params.greedy else torch.Generator().manual_seed(
                base_seed if index == 0 else hash((base_seed, index)) & (2**62 - 1))
            seq = Sequence(request_id, prompt_ids, params, generator, index=index, arrival=arrival, group=group,
                           images=images, prompt_keys=keys)
            if params.constraint is not None:  # compiled by validate_prompt: a cache hit
                seq.grammar = self.grammars.start(params.constraint)
            seq.output_state = OutputState(self.tokenizer, params)
            samples.append(seq)
        self.scheduler.add(samples[0], forks=samples[1:])  # the others fork off sample 0 at its prompt's end
        self._requests[request_id] = samples
        self._totals["prompt_tokens_total"] += len(prompt_ids)
        return request_id

    def in_vocabulary(self, token_ids: list[int]) -> bool:
        """Whether every id is an integer token of this model's vocabulary."""
        vocab = self.hf_config.vocab_size
        return all(isinstance(t, int) and 0 <= t < vocab for t in token_ids)

    def validate_prompt(self, prompt: str | list[int] | ImagePrompt, params: SamplingParams | PoolingParams
                        ) -> list[int]:
        """Token ids of the prompt, or ValueError (RequestRejected included) before anything is queued."""
        images = prompt.images if isinstance(prompt, ImagePrompt) else []
        if isinstance(prompt, ImagePrompt):
            prompt = prompt.token_ids
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.hf_config.vocab_size
        if not self.in_vocabulary(prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        check_images(prompt_ids, images, getattr(self.hf_config, "image_token_id", None))
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        self.scheduler.check_admissible(len(prompt_ids), params.max_tokens)
        if params.constraint is not None:
            self.compile_constraint(params.constraint)
        return prompt_ids

    def compile_constraint(self, constraint: Constraint) -> None:
        """Compile (and cache) a constraint; InvalidConstraint (a ValueError) if it cannot be. Thread-safe: the
        server calls it off the engine thread, so that add_request finds it compiled."""
        self.grammars.compile(constraint)

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int], chunk: int = 256) -> torch.Tensor:
        """Teacher-forced log-probability of each of token_ids[1:] given the tokens before it (float32, on the CPU):
        chunked prefills on the engine's own KV pool (what serving runs), borrowed while the engine is idle."""
        return self.prompt_predictions(token_ids, chunk)[0]

    def prompt_predictions(self, token_ids: list[int], chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """`prompt_logprobs`, and the model's own top-1 token after each of token_ids[:-1] (int64): what greedy
        decoding would pick there."""
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed the model's context of {self.max_model_len}")
        seq = Sequence("prompt-logprobs", list(token_ids), SamplingParams(max_tokens=1))
        targets = torch.tensor(token_ids[1:], dtype=torch.long).view(-1, 1)
        chunks, best = [], []
        try:
            for start in range(0, len(token_ids) - 1, chunk):
                n = min(chunk, len(token_ids) - 1 - start)
                if not self.kv.allocate(seq, n):
                    raise ValueError("the text does not fit in the free KV pool")
                logits = self.runner.forward(self.runner.layout([ScheduledSeq(seq, n)], all_logits=True)).logits
                chunks.append(torch.log_softmax(logits, -1).gather(1, targets[start:start + n].to(logits.device)))
                best.append(logits.argmax(-1))
                seq.num_computed_tokens += n
        finally:
            self.kv.free(seq)
        if not chunks:
            return torch.empty(0), torch.empty(0, dtype=torch.long)
        return torch.cat(chunks).view(-1).cpu(), torch.cat(best).cpu()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def persist_deferred(self) -> bool:
        """Idle time: hand the persisted tier's writer the blocks it deferred while the engine was busy (as its
        backlog allows). True while some remain (call again later); False without the tier."""
        return self.persisted is not None and self.persisted.save_deferred()

    def has_request(self, request_id: str) -> bool:
        """True while any sample of the request has not finished."""
        return request_id in self._requests

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> list[RequestOutput]:
        """Stop every sample of the request now (or only sample `index`) and free its blocks; returns their final
        outputs, finished for `reason` ("stop": the server read a complete reply before the model ended it)."""
        outputs = []
        for seq in self._requests.get(request_id, []):
            if not seq.is_finished and index in (None, seq.index):  # running, waiting, or a sample not yet forked
                self.scheduler.finish(seq, reason)
                outputs.append(self._final_output(seq, [], reason))
        self._forget_if_done(request_id)
        return outputs

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step while the runner has room for one more in flight (one: a step runs whole
        before the next is planned; a pipeline: one per stage, each on other sequences), then finish the oldest:
        sample, update. Returns the outputs of the requests that got tokens or finished."""
        depth = self.runner.max_in_flight
        if len(self._in_flight) < depth:
            plan = self.scheduler.schedule(busy=self._busy, max_seqs=self._micro_batch_seqs(depth))
            if plan.scheduled:
                try:
                    handle = self.runner.submit(plan.scheduled)
                except torch.OutOfMemoryError as exc:
                    raise self._out_of_memory(plan.scheduled, exc) from exc
                self._in_flight.append((plan, handle))
                self._busy.update(id(item.seq) for item in plan.scheduled)
                if len(self._in_flight) < depth:  # the next call launches another before this one is waited for
                    return []
        if not self._in_flight:
            return []
        plan, handle = self._in_flight.popleft()
        self._busy.difference_update(id(item.seq) for item in plan.scheduled)
        try:
            out = self.runner.collect(handle)
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(plan.scheduled, exc) from exc
        pooling = (item.seq for item in plan.scheduled if item.seq.pools)
        for seq, chunk in zip(pooling, out.pooled, strict=True):
            seq.pooled = chunk if seq.pooled is None else seq.pooled.then(chunk)
        asking = (item for item in plan.scheduled if item.prompt_logprob_span[1])  # the runner's prompt_rows order
        for item, run in zip(asking, out.prompt_logprobs, strict=True):
            item.seq.prompt_logprobs.extend(map(TokenLogprob, run.token_ids, run.chosen, run.top))
        sampled = self._sample(plan, out.logits) if plan.sampled else None
        updates, copies = self.scheduler.update_from_output(plan, sampled)
        self.runner.copy_blocks(copies)
        self._prompt_rate.add(plan.num_prompt_tokens)
        return self._outputs(updates, sampled)

    def _micro_batch_seqs(self, depth: int) -> int | None:
        """A pipeline's steps in flight share the sequences: each takes at most its share of those running and
        waiting (without the cap the first step would take them all and the other stages would wait)."""
        if depth == 1:
            return None
        scheduler = self.scheduler
        return -(-min(self.config.max_num_seqs, len(scheduler.running) + len(scheduler.waiting)) // depth)

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> StepTokens:
        entries = plan.sampling_rows
        rows = [row for _, seq_rows, _ in entries for row in seq_rows]
        if len(rows) != len(logits):  # a forked sample draws from its parent's row
            logits = logits[rows]
        seqs = [seq for seq, _, _ in entries]
        drafting = any(s.spec_token_ids for s in seqs)
        token_bitmask, masked_rows = self._token_masks(seqs)
        return sample_tokens(logits, SamplingBatch(
            [s.params for s in seqs], [s.generator for s in seqs], [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs], self.tokenizer.eos_token_ids,
            drafts=[s.spec_token_ids for s in seqs] if drafting else None,
            draft_probs=[s.spec_draft_probs for s in seqs] if drafting else None,
            token_bitmask=token_bitmask, masked_rows=masked_rows))

    def _token_masks(self, seqs: list[Sequence]) -> tuple[torch.Tensor | None, list[int] | None]:
        """The allowed tokens of each logits row of the constrained sequences (the sampler's row layout: 1 +
        drafts rows per sequence), and which rows those are."""
        if not any(s.grammar is not None for s in seqs):
            return None, None
        num_rows = sum(1 + len(s.spec_token_ids) for s in seqs)
        bitmask = torch.full((num_rows, self.grammars.mask_words()), -1, dtype=torch.int32)
        masked, entries, row = [], [], 0
        for seq in seqs:
            rows = 1 + len(seq.spec_token_ids)
            if seq.grammar is not None and (seq.grammar.active or seq.spec_token_ids):
                entries.append((seq.grammar, row, seq.output_token_ids, seq.spec_token_ids))
                masked.extend(range(row, row + rows))
            row += rows
        self.grammars.fill_masks(entries, bitmask)
        return bitmask, masked

    def _outputs(self, updates: list[SeqUpdate], sampled: StepTokens | None) -> list[RequestOutput]:
        """One output per sequence that got tokens (its final one when it finished)."""
        outputs, generated = [], 0
        for update in updates:
            seq, i = update.seq, update.entry
            if seq.pools:  # finished: its prompt is pooled
                outputs.append(self._final_output(seq, [], update.finish_reason))
                continue
            state = seq.output_state
            generated += update.num_new_tokens
            if seq.params.logprobs is not None:
                tokens = sampled.token_ids[i][:update.num_new_tokens]
                state.pending_logprobs.extend(TokenLogprob(t, lp, top) for t, lp, top in zip(
                    tokens, sampled.logprobs[i], sampled.top_logprobs[i]))
            if update.finish_reason is not None:
                outputs.append(self._final_output(seq, state.pending_tokens, update.finish_reason))
                continue
            outputs.append(state.output(seq))
        for request_id in {u.seq.request_id for u in updates if u.finish_reason is not None}:
            self._forget_if_done(request_id)
        self._generation_rate.add(generated)
        self._totals["generated_tokens_total"] += generated
        return outputs

    def _out_of_memory(self, scheduled: list, exc: BaseException) -> RequestsFailed:
        """The device ran out of memory in this step: stop the request with the most tokens in it (the
        likely cause: a long prefill chunk), free its blocks and memory; the others run again next step
        (nothing of this step was counted as computed)."""
        victim = max(scheduled, key=lambda item: (item.num_new_tokens, item.seq.num_computed_tokens)).seq
        tokens = sum(item.num_new_tokens for item in scheduled)
        log.warning("out of device memory in a step of %d tokens; stopping request %s", tokens, victim.request_id)
        self.abort(victim.request_id)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return RequestsFailed([victim.request_id], f"out of device memory while running this request (a step of "
                                                   f"{tokens} tokens); the request was stopped: {exc}")

    def _final_output(self, seq: Sequence, delta_tokens: list[int], reason: str | None) -> RequestOutput:
        if seq.pools:
            return self._embedding_output(seq, reason)
        metrics = request_metrics(seq)
        if self.speculator is not None:
            metrics |= spec_metrics(seq)
        out = seq.output_state.final_output(seq, delta_tokens, reason, metrics)
        if seq.index == 0:
            self._totals["cached_tokens_total"] += seq.num_cached_tokens or 0
        self._totals["requests_finished"] += seq.index == 0
        return out

    def _embedding_output(self, seq: Sequence, reason: str | None) -> RequestOutput:
        """An embedding request's one output: its embedding when its whole prompt was pooled (not when aborted)."""
        embedding = None
        if seq.finish_reason == "stop" and seq.params.score_token_ids:
            embedding = seq.pooled.scores
        elif seq.finish_reason == "stop":
            normalize = self.pooling.normalize if seq.params.normalize is None else seq.params.normalize
            embedding = seq.pooled.embedding(seq.num_tokens, self.pooling.mode, normalize)
        self._totals["requests_finished"] += 1
        return RequestOutput(seq.request_id, 0, seq.prompt_token_ids, [], "", "", [], finished=True,
                             finish_reason=seq.finish_reason or reason, metrics=request_metrics(seq),
                             embedding=embedding, num_cached_tokens=seq.num_cached_tokens or 0)

    def _forget_if_done(self, request_id: str) -> None:
        samples = self._requests.get(request_id, [])
        if samples and all(s.is_finished for s in samples):
            del self._requests[request_id]

    # --- stats --------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish writing queued KV blocks to disk; stop the tensor-parallel ranks."""
        if self.speculator is not None:
            self.speculator.proposer.close()
        self._close_parts()

    def _close_parts(self) -> None:
        """The persisted tier, the database it opened itself, and the runner (its ranks)."""
        if self.persisted is not None:
            self.persisted.close()
        if self._opened_kv_index is not None:
            self._opened_kv_index.close()
        self.runner.close()

    def runtime(self) -> RuntimeInfo:
        runner = self.runner
        return RuntimeInfo(str(runner.device), runner.kernels, list(runner.graphs.sizes) if runner.graphs else None,
                           runner.weight_bytes(), runner.model.model.embed_tokens.table_bytes, runner.kv_cache_bytes,
                           runner.kv_bytes_per_block / runner.block_size,
                           {c.key: c.choice for c in runner.kernel_choices},
                           self.placement, runner.gguf_weights)

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from any thread) when the engine fails while idle (a tensor-parallel rank died)."""
        self.runner.on_failure = callback

    def failure(self) -> str | None:
        """Why the engine can no longer run (a tensor-parallel rank died), or None while it can."""
        return self.runner.failure

    def stats(self) -> EngineStats:
        pool = self.block_pool
        cached = pool.num_cached_free
        return EngineStats(
            kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used, kv_blocks_cached=cached,
            kv_blocks_free=pool.num_free - cached, kv_cache_bytes=self.runner.kv_cache_bytes,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            generation_tokens_per_s=self._generation_rate.rate(), prompt_tokens_per_s=self._prompt_rate.rate(),
            preemptions_total=self.scheduler.num_preemptions, **self._totals, **self.disk_stats(),
            **(self.speculator.totals if self.speculator else {}),
            images_encoded_total=getattr(self.runner.model, "images_encoded", 0))

    def disk_stats(self) -> dict[str, int]:
        """The persisted tier's EngineStats fields (none when it is off)."""
        if self.persisted is None:
            return {}
        p = self.persisted.stats()
        return dict(kv_disk_blocks=p.blocks, kv_disk_bytes=p.bytes_total, kv_disk_pending=p.pending,
                    kv_disk_loaded_blocks_total=p.loaded_blocks, kv_disk_load_failures_total=p.load_failures)


