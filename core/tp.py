"""Tensor parallelism across processes: rank 0 (the engine's process) schedules and plans each step;
every rank runs the same forward on its share of the weights and KV heads.

Ranks are spawned (`tp_size` N on one machine: N - 1 worker processes), or started by torchrun (several machines):
there a process with RANK > 0 runs `worker_main` instead of the server (core/ranks.py: starting, watching, stopping).

Two process groups: the default one (gloo on CPU; NCCL for CUDA tensors) carries the layers'
collectives; a gloo group with no practical timeout carries rank 0's commands, because workers wait
on it for as long as the server is idle. Commands are (method name, arguments) of ModelRunner, sent
with `broadcast_object_list` (pickle between our own processes; checkpoints are never unpickled).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvforge.core.config import EngineConfig
from kvforge.core.distributed import tensor_parallel
from kvforge.core.ranks import COMMAND_TIMEOUT, LeadRunner, RankProcesses, WorkerLost
from kvforge.core.runner import ModelRunner, StagePlacement, StepInputs, StepOutput
from kvforge.core.step import ScheduledSeq

log = logging.getLogger(__name__)

GATHERED = ("read_block", "weight_bytes", "placement")  # commands whose result every rank sends back to rank 0
__all__ = ["ParallelRunner", "WorkerLost", "serve_rank"]


class ParallelRunner(LeadRunner):
    """Rank 0's handle on the model runners of all ranks, with ModelRunner's interface: each call is
    sent to the workers, then run here. Anything else (sizes, the model) is rank 0's own."""

    def __init__(self, config: EngineConfig, model_path: Path, hf_config, progress: bool = True) -> None:
        self.size = config.tp_size
        config = self._share_machine(config, self.size, hf_config)
        try:
            self.ranks = RankProcesses(self.size, "kvforge.core.tp", "tensor-parallel")
            self._commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
            self.ranks.watch()
            self._send("load", config)
            try:
                with tensor_parallel(self.size, 0):
                    self.local = ModelRunner(config, model_path, hf_config, progress)
            finally:  # the ranks answer whether this one loaded or not: the group stays in step
                errors = [e for e in self._gather(None) if e]
            if errors:
                raise ValueError(f"a tensor-parallel rank could not load the model: {errors[0]}")
        except BaseException:
            self.close()
            raise

    # --- the Runner interface (core/runner_api.py): sizes and the model are rank 0's own (LeadRunner) -----

    def forward(self, inputs: StepInputs) -> StepOutput:
        return self._call("forward", inputs)

    def execute(self, batch: list[ScheduledSeq]) -> StepOutput:
        return self.forward(self.layout(batch))

    max_in_flight = 1  # every rank runs the whole step: submit runs it, collect returns its output
    submit = execute
    collect = staticmethod(ModelRunner.collect)

    def allocate_kv(self, num_blocks: int) -> None:
        self._call("allocate_kv", num_blocks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._call("copy_blocks", pairs)

    def write_block(self, block: int, data: torch.Tensor) -> None:
        self._call("write_block", block, data)

    def read_block(self, block: int) -> torch.Tensor:
        """The whole block (every KV head) gathered from the ranks; a replicated head is taken once."""
        return self._whole_block(self._gather(self._call("read_block", block)))

    def weight_bytes(self) -> int:
        return sum(self._gather(self._call("weight_bytes")))

    def placement(self) -> list[StagePlacement]:
        """One stage: every layer, split across the ranks (their weights and KV pools summed)."""
        parts = [part for (part,) in self._gather(self._call("placement"))]
        return [dataclasses.replace(parts[0], processes=self.size, weights_bytes=sum(p.weights_bytes for p in parts),
                                    kv_cache_bytes=sum(p.kv_cache_bytes for p in parts),
                                    experts_bytes=sum(p.experts_bytes for p in parts))]

    # --- commands -----------------------------------------------------------------------------

    def _send(self, name: str, *args: Any) -> None:
        if self.failure:
            raise WorkerLost(self.failure)
        try:
            dist.broadcast_object_list([(name, args)], src=0, group=self._commands)
        except Exception as exc:
            raise self._lost(f"sending {name!r} to the tensor-parallel ranks failed: {exc}") from exc

    def _call(self, name: str, *args: Any) -> Any:
        self._send(name, *args)
        try:
            return getattr(self.local, name)(*args)
        except Exception as exc:  # mid-step: the other ranks are out of step with this one now
            raise self._lost(f"tensor-parallel {name!r} failed: {type(exc).__name__}: {exc}") from exc

    def _gather(self, mine: Any) -> list[Any]:
        results: list[Any] = [None] * self.size
        try:
            dist.gather_object(mine, results, dst=0, group=self._commands)
        except Exception as exc:
            raise self._lost(f"a tensor-parallel rank did not answer: {exc}") from exc
        return results

    def close(self) -> None:
        """Stop the workers (they exit on their own; stragglers are terminated) and leave the group."""
        self._close_ranks(lambda: dist.broadcast_object_list([("stop", ())], src=0, group=self._commands))


def serve_rank(rank: int, size: int) -> None:
    """A tensor-parallel rank > 0 (joined by core/ranks.py worker_main): load this rank's share of the model, then
    run rank 0's commands until it says stop."""
    logging.basicConfig(level=logging.INFO, format=f"kvforge tp rank {rank}: %(message)s")
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    runner = None
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=commands)
        name, args = message[0]
        if name == "stop":
            break
        if name == "load":
            error = None
            try:
                runner = _load(args[0], rank)
            except Exception as exc:
                log.exception("loading the model failed")
                error = f"rank {rank}: {type(exc).__name__}: {exc}"
            dist.gather_object(error, None, dst=0, group=commands)
            continue  # after a failed load rank 0 closes the group: the next command is stop
        result = getattr(runner, name)(*args)  # an exception ends this process: rank 0 sees the rank go
        if name in GATHERED:  # tensors travel through the CPU (rank 0 may have no device of this index)
            dist.gather_object(result.cpu() if isinstance(result, torch.Tensor) else result, None, dst=0,
                               group=commands)


def _load(config: EngineConfig, rank: int) -> ModelRunner:
    return load_rank_runner(config, rank, lambda: tensor_parallel(config.tp_size, rank))


def load_rank_runner(config: EngineConfig, rank: int, layout: Callable[[], Any]) -> ModelRunner:
    """A worker rank's ModelRunner, its model built inside `layout()` (the parallel layout of this rank's share)."""
    from kvforge.core.loader import load_config, resolve_model

    if config.device.startswith("cuda"):  # one GPU per rank on each machine
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        config = dataclasses.replace(config, device=f"cuda:{local_rank}")
        torch.cuda.set_device(local_rank)
    if config.num_threads:  # this rank's process, set once before its model loads
        torch.set_num_threads(config.num_threads)
    # converted by rank 0 already when on the same machine
    model_path = resolve_model(config.model, native_gguf=config.native_gguf)
    with layout():
        return ModelRunner(config, model_path, load_config(model_path), progress=False)
