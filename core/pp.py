"""Pipeline parallelism across processes: each stage holds consecutive decoder layers and their KV (the first also
the embedding, the last the final norm and LM head), split further by tensor parallelism within a stage when
tp_size > 1. Rank r is stage r // tp_size, tensor-parallel rank r % tp_size; rank 0 (the engine's process) is stage
0's first rank.

Every command travels down the pipeline as a message, in order: rank 0 runs its part and sends (name, arguments,
carried) to the next stage, which runs its part on what was carried -- a forward's hidden states, the layers' shares
of a KV block, the load errors so far -- and passes it on; the last stage's ranks reply to rank 0. Each rank runs its
messages in the order rank 0 sent them, so a command never overtakes a step in flight (a block copied or written
lands between the same two steps on every stage).

Rank 0 does not wait for a forward's logits before launching the next step (`submit` returns once its own stage has
run and sent the hidden states on; `collect` waits for the reply): the engine keeps up to one step per stage in
flight (core/engine.py), each on other sequences, so while the last stage computes one micro-batch the first computes
the next. A thread on rank 0 reads the replies as they come.

Messages are pickled objects (`send_object_list`) between our own processes, on gloo groups with no practical timeout
(workers wait while the server is idle); hidden states on a GPU travel through the host (no NCCL send yet).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvforge.core.config import EngineConfig
from kvforge.core.distributed import pipeline_stage, stage_layers, tensor_parallel
from kvforge.core.models.causal_lm import StageCarry
from kvforge.core.ranks import COMMAND_TIMEOUT, LeadRunner, RankProcesses, WorkerLost
from kvforge.core.runner import ModelRunner, StagePlacement, StepInputs, StepOutput
from kvforge.core.step import ScheduledSeq
from kvforge.core.tp import load_rank_runner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Who is who: `stages` x `tp` ranks, rank r = stage r // tp, tensor-parallel rank r % tp."""

    stages: int
    tp: int

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def previous(self, rank: int) -> int:
        """Where a rank's messages come from: the same tensor-parallel rank of the stage before (stage 0's other
        ranks: rank 0)."""
        return 0 if rank < self.tp else rank - self.tp

    def next(self, rank: int) -> int | None:
        """Where it passes them on (None: the last stage, which replies to rank 0)."""
        return rank + self.tp if self.stage_of(rank) < self.stages - 1 else None

    def last_stage_ranks(self) -> list[int]:
        return [(self.stages - 1) * self.tp + t for t in range(self.tp)]


def _groups(layout: PipelineLayout, rank: int) -> tuple[Any, Any, Any]:
    """The message group, the reply group and this rank's stage's tensor-parallel group; every rank creates every
    group in the same order (torch.distributed's rule)."""
    messages = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    replies = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    own = None
    if layout.tp > 1:
        for stage in range(layout.stages):
            group = dist.new_group([stage * layout.tp + t for t in range(layout.tp)])
            if stage == layout.stage_of(rank):
                own = group
    return messages, replies, own


def _to_host(value: Any) -> Any:
    """What travels between processes lives on the host (a rank may have no device of the sender's index)."""
    if isinstance(value, StageCarry):
        return StageCarry(value.hidden.cpu(), None if value.residual is None else value.residual.cpu())
    if isinstance(value, torch.Tensor):
        return value.cpu()
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, StageCarry):
        return StageCarry(value.hidden.to(device), None if value.residual is None else value.residual.to(device))
    return value


def _run(runner: ModelRunner, name: str, args: tuple, carried: Any, replies_whole: bool) -> Any:
    """One rank's part of a command: what it passes on (or, on the last stage, replies: a forward's final hidden
    states, which rank 0 turns into the step's output). `replies_whole`: this rank's reply to a forward is the one
    rank 0 reads (the other ranks of the last stage send None)."""
    if name == "forward":
        out = runner.forward(args[0], _to_device(carried, runner.device))
        return out if isinstance(out, StageCarry) or replies_whole else None
    if name == "read_block":  # each stage adds its layers' share
        return [*(carried or []), runner.read_block(*args).cpu()]
    if name == "weight_bytes":
        return (carried or 0) + runner.weight_bytes()
    if name == "placement":  # each stage adds its own
        return [*(carried or []), *runner.placement()]
    getattr(runner, name)(*args)  # allocate_kv, copy_blocks, write_block: nothing to carry
    return None


class Pending:
    """A command rank 0 sent down the pipeline: its replies, from each rank of the last stage, once they came (and a
    forward's inputs, to make its output of the final hidden states)."""

    def __init__(self) -> None:
        self.inputs: StepInputs | None = None
        self._done = threading.Event()
        self._replies: list[Any] | None = None
        self._error: BaseException | None = None

    def resolve(self, replies: list[Any] | None, error: BaseException | None = None) -> None:
        self._replies, self._error = replies, error
        self._done.set()

    def wait(self) -> list[Any]:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._replies


class PipelineRunner(LeadRunner):
    """Rank 0's handle on every stage, with ModelRunner's interface plus `submit` / `collect` (one step in flight per
    stage). Sizes and the model are rank 0's own (stage 0's layers; the KV budget is per rank, as under TP)."""

    def __init__(self, config: EngineConfig, model_path: Path, hf_config, progress: bool = True) -> None:
        self.pipeline = PipelineLayout(config.pp_size, config.tp_size)
        self.size = self.pipeline.stages * self.pipeline.tp
        self.max_in_flight = self.pipeline.stages
        stage_layers(hf_config, self.pipeline.stages, 0)  # a split that cannot be made: refused here
        if config.decoding != "none":
            raise ValueError("speculative decoding is not supported with pipeline parallelism (pp_size > 1)")
        config = self._share_machine(config, self.size, hf_config)
        self._pending: queue.Queue[Pending | None] = queue.Queue()  # sent, in order, awaiting their replies
        self._reader: threading.Thread | None = None
        try:
            self.ranks = RankProcesses(self.size, __name__, "pipeline")
            dist.broadcast_object_list([self.pipeline], src=0)
            self._messages, self._replies, stage_group = _groups(self.pipeline, 0)
            self.ranks.watch()
            self._reader = threading.Thread(target=self._read_replies, name="kvforge-pp-replies", daemon=True)
            self._reader.start()
            loading = self._send("load", (config,))
            error = None
            try:
                with tensor_parallel(self.pipeline.tp, 0, stage_group), pipeline_stage(self.pipeline.stages, 0):
                    self.local = ModelRunner(config, model_path, hf_config, progress)
            except Exception as exc:
                error = f"rank 0: {type(exc).__name__}: {exc}"
                raise
            finally:  # the other ranks answer whether this one loaded or not: the pipeline stays in step
                self._pass_on("load", (config,), [error])
                errors = [e for reply in loading.wait() for e in reply if e]
            if errors:
                raise ValueError(f"a pipeline rank could not load the model: {errors[0]}")
        except BaseException:
            self.close()
            raise

    # --- the Runner interface (core/runner_api.py): sizes and the model are rank 0's own (LeadRunner) -----

    def submit(self, batch: list[ScheduledSeq]) -> Pending:
        """Launch a step: this stage's layers run now, the rest of the pipeline after; `collect` gives its output."""
        return self._launch(self.local.layout(batch))

    @torch.inference_mode()
    def collect(self, pending: Pending) -> StepOutput:
        """The step's output: logits, pooled states and prompt logprobs made here from the final hidden states (by
        every rank of the first stage, whose LM head they split)."""
        hidden = pending.wait()[0]
        for rank in range(1, self.pipeline.tp):
            self._send_to(rank, ("output", (pending.inputs,), hidden))
        return self.local.output(hidden.to(self.local.device), pending.inputs)

    def forward(self, inputs: StepInputs) -> StepOutput:
        return self.collect(self._launch(inputs))

    def _launch(self, inputs: StepInputs) -> Pending:
        pending = self._command("forward", inputs)
        pending.inputs = inputs
        return pending

    def execute(self, batch: list[ScheduledSeq]) -> StepOutput:
        return self.collect(self.submit(batch))

    def allocate_kv(self, num_blocks: int) -> None:
        self._command("allocate_kv", num_blocks).wait()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:  # in order with the steps: no need to wait
            self._command("copy_blocks", pairs)

    def write_block(self, block: int, data: torch.Tensor) -> None:
        self._command("write_block", block, data.cpu())

    def read_block(self, block: int) -> torch.Tensor:
        """The whole block: each tensor-parallel rank's heads with every stage's layers; a replicated head once."""
        chains = self._command("read_block", block).wait()  # per tensor-parallel rank: its shares, stage by stage
        return self._whole_block([torch.cat(chain, dim=0) for chain in chains])

    def weight_bytes(self) -> int:
        return sum(self._command("weight_bytes").wait())

    def placement(self) -> list[StagePlacement]:
        """Each stage's part: its ranks' weights and KV pools summed."""
        chains = self._command("placement").wait()  # per tensor-parallel rank: its stages in order
        return [dataclasses.replace(parts[0], processes=len(parts),
                                    weights_bytes=sum(p.weights_bytes for p in parts),
                                    kv_cache_bytes=sum(p.kv_cache_bytes for p in parts),
                                    experts_bytes=sum(p.experts_bytes for p in parts))
                for parts in zip(*chains)]

    # --- messages -----------------------------------------------------------------------------

    def _command(self, name: str, *args: Any) -> Pending:
        """Send a command to stage 0's other ranks, run this rank's part, pass the result on."""
        pending = self._send(name, args)
        try:
            carried = _run(self.local, name, args, None, replies_whole=True)
        except Exception as exc:  # mid-step: the other ranks are out of step with this one now
            raise self._lost(f"pipeline {name!r} failed on rank 0: {type(exc).__name__}: {exc}") from exc
        self._pass_on(name, args, carried)
        return pending

    def _send(self, name: str, args: tuple) -> Pending:
        """Register the command's reply, then send it to stage 0's other ranks (they run it beside this one)."""
        if self.failure:
            raise WorkerLost(self.failure)
        pending = Pending()
        self._pending.put(pending)  # before any rank can reply
        for rank in range(1, self.pipeline.tp):
            self._send_to(rank, (name, args, None))
        return pending

    def _pass_on(self, name: str, args: tuple, carried: Any) -> None:
        self._send_to(self.pipeline.next(0), (name, args, _to_host(carried)))

    def _send_to(self, rank: int, message: tuple) -> None:
        try:
            dist.send_object_list([message], dst=rank, group=self._messages)
        except Exception as exc:
            raise self._lost(f"sending {message[0]!r} to pipeline rank {rank} failed: {exc}") from exc

    def _read_replies(self) -> None:
        """Rank 0's reply reader: each command's replies from the last stage's ranks, in the order sent."""
        sources = self.pipeline.last_stage_ranks()
        while (pending := self._pending.get()) is not None:
            if self.failure:
                pending.resolve(None, WorkerLost(self.failure))
                continue
            try:
                replies = []
                for rank in sources:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=rank, group=self._replies)
                    replies.append(box[0])
                pending.resolve(replies)
            except Exception as exc:
                pending.resolve(None, self._lost(f"a pipeline rank did not reply: {exc}"))

    def close(self) -> None:
        """Stop the workers (each passes the stop on, then exits; stragglers are killed) and leave the group."""
        def stop() -> None:
            for rank in range(1, self.pipeline.tp):
                dist.send_object_list([("stop", (), None)], dst=rank, group=self._messages)
            dist.send_object_list([("stop", (), None)], dst=self.pipeline.next(0), group=self._messages)

        self._pending.put(None)  # the reply reader ends (or is left blocked on a dead rank: a daemon thread)
        self._close_ranks(stop)


def serve_rank(rank: int, size: int) -> None:
    """A pipeline rank > 0 (joined by core/ranks.py worker_main): take rank 0's layout, load this rank's layers, then
    run each message from the rank before and pass it on (the last stage: reply to rank 0) until stop."""
    logging.basicConfig(level=logging.INFO, format=f"kvforge pp rank {rank}: %(message)s")
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    layout: PipelineLayout = box[0]
    messages, replies, stage_group = _groups(layout, rank)
    source, target = layout.previous(rank), layout.next(rank)
    whole = rank == layout.last_stage_ranks()[0]
    runner = None
    while True:
        dist.recv_object_list(box, src=source, group=messages)
        name, args, carried = box[0]
        if name == "stop":
            if target is not None:
                dist.send_object_list([box[0]], dst=target, group=messages)
            break
        if name == "output":  # a first-stage rank's share of the LM head (rank 0 makes the step's output)
            with torch.inference_mode():
                runner.output(carried.to(runner.device), args[0])
            continue
        if name == "load":
            error = None
            try:
                runner = load_rank_runner(args[0], rank, lambda: _rank_layout(layout, rank, stage_group))
            except Exception as exc:
                log.exception("loading the model failed")
                error = f"rank {rank}: {type(exc).__name__}: {exc}"
            out = [*(carried or []), error]  # after a failed load rank 0 closes the pipeline: the next is stop
        else:
            out = _to_host(_run(runner, name, args, carried, whole))  # an exception ends this process
        if target is not None:
            dist.send_object_list([(name, args, out)], dst=target, group=messages)
        else:
            dist.send_object_list([out], dst=0, group=replies)


@contextmanager
def _rank_layout(layout: PipelineLayout, rank: int, stage_group: Any) -> Iterator[None]:
    """The parallel layout a worker builds its share in: its stage's layers, its heads within the stage."""
    with tensor_parallel(layout.tp, rank % layout.tp, stage_group), pipeline_stage(layout.stages,
                                                                                    layout.stage_of(rank)):
        yield
