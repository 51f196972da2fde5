"""The processes of a multi-process runner (tensor parallelism, core/tp.py; pipeline parallelism, core/pp.py): rank 0
is the engine's process; the other ranks are spawned here (one machine: `python -m kvforge.core.ranks rank size
port`) or started by torchrun (several machines: a process with RANK > 0 runs `worker_main` instead of the command).
Once joined, rank 0 tells every worker which runner's loop to serve (the module's `serve_rank`).

Rank 0 joins them in the default process group (gloo on CPU; NCCL for CUDA tensors), watches each spawned one (a rank
that exits while the engine runs is fatal, even while the server is idle), and at close waits for them to stop
(stragglers are killed), so no process is left behind.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvforge.core.distributed import heads_of_rank

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = timedelta(days=365)  # workers wait for rank 0's commands while the server is idle
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one collective inside a forward (or rank start-up)


class WorkerLost(RuntimeError):
    """A rank died or failed mid-step: the ranks are out of step, the engine cannot go on."""


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


class RankProcesses:
    """Rank 0's view of the other ranks: started (or found under torchrun), joined in the default process group,
    watched. `kind` names them in errors ("tensor-parallel", "pipeline")."""

    def __init__(self, size: int, worker_module: str, kind: str) -> None:
        self.size, self.kind = size, kind
        self.failure: str | None = None  # why the ranks can no longer run, once they cannot
        self.on_failure: Callable[[], None] | None = None  # called from a monitor thread on a failure
        self.closing = False
        self._processes: dict[int, subprocess.Popen] = {}  # rank -> the worker process spawned for it
        if launched_by_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != size or int(os.environ["RANK"]) != 0:
                raise ValueError(f"torchrun started {world} ranks (this is rank {os.environ['RANK']}); the "
                                 f"{kind} ranks are {size}: they must match, and rank 0 runs the server")
            rendezvous: dict[str, Any] = {"init_method": "env://"}
        else:
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                                  wait_for_workers=False)
            # plain `python -m` processes: multiprocessing's spawn would re-import the caller's __main__
            for rank in range(1, size):
                self._processes[rank] = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(rank), str(size), str(store.port)])
            rendezvous = {"store": store}
        try:
            if self._processes:
                self._wait_for_workers(rendezvous["store"])
            dist.init_process_group(backend(), rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT, **rendezvous)
            dist.broadcast_object_list([worker_module], src=0)  # the loop each worker serves
        except BaseException:
            self.close()
            raise

    def _wait_for_workers(self, store: dist.TCPStore) -> None:
        """Each spawned rank checks in on the store before it joins the group: one that exits first is an
        error here, not a wait in the rendezvous until its timeout."""
        keys = [f"up/{rank}" for rank in self._processes]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not store.check(keys):
            for rank, process in self._processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{self.kind} rank {rank} exited while starting "
                                       f"(exit code {process.returncode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {self.kind} ranks did not start within {COLLECTIVE_TIMEOUT}")
            time.sleep(0.05)

    def watch(self) -> None:
        """Start watching the spawned ranks (once the runner can handle a failure)."""
        for rank in self._processes:
            threading.Thread(target=self._monitor, args=(rank,), name=f"kvforge-rank-monitor-{rank}",
                             daemon=True).start()

    def lost(self, why: str) -> WorkerLost:
        if self.failure is None:
            self.failure = why
        return WorkerLost(self.failure)

    def _monitor(self, rank: int) -> None:
        code = self._processes[rank].wait()
        if self.closing:
            return
        if self.failure is None:
            self.failure = f"{self.kind} rank {rank} exited (exit code {code})"
        log.error("%s", self.failure)
        if self.on_failure is not None:
            self.on_failure()

    def close(self, stop: Callable[[], None] | None = None) -> None:
        """`stop` (the runner's stop message, sent while no rank has failed), then wait for the spawned ranks to
        exit (stragglers are killed) and leave the group."""
        if self.closing:
            return
        self.closing = True
        if stop is not None and self.failure is None and dist.is_initialized():
            try:
                stop()
            except Exception:  # a rank is gone already: the ones left are killed below
                pass
        for process in self._processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(rank: int | None = None, size: int | None = None, port: int | None = None) -> None:
    """A rank > 0: join the default process group -- spawned by RankProcesses (rank 0's store on `port` of this
    machine), or under torchrun (rank, size and the rendezvous from the environment) -- then serve the loop of the
    runner rank 0 names (tensor or pipeline parallel) until it says stop."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    size = int(os.environ["WORLD_SIZE"]) if size is None else size
    rendezvous: dict[str, Any] = {"init_method": "env://"}
    if port is not None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        store.set(f"up/{rank}", "1")
        rendezvous = {"store": store}
    dist.init_process_group(backend(), rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **rendezvous)
    module: list[Any] = [None]
    dist.broadcast_object_list(module, src=0)
    if module[0] not in WORKER_MODULES:
        raise RuntimeError(f"rank 0 asked for an unknown worker loop {module[0]!r}")
    importlib.import_module(module[0]).serve_rank(rank, size)
    dist.destroy_process_group()


WORKER_MODULES = ("kvforge.core.tp", "kvforge.core.pp")


class LeadRunner:
    """What rank 0's handles on several processes share (core/tp.py ParallelRunner, core/pp.py PipelineRunner): the
    Runner interface's sizes and model are rank 0's own runner's (`self.local`), the ranks' failure is the engine's,
    the machine's threads are split between the processes, and a KV block is put together from the tensor-parallel
    ranks' heads."""

    local: Any  # this process's ModelRunner, once loaded
    ranks: RankProcesses | None = None
    cuda_graph_safe = False  # a step is collectives or messages across processes: never captured
    graphs = None

    def _share_machine(self, config: Any, processes: int, hf_config) -> Any:
        """The config each process runs: on CPU the threads split between the processes (restored at close: the
        thread count is process-wide); the tensor-parallel ranks of a layer would time kernels at once on shared
        cores, and must agree: the stock ones unless forced. Stops the ranks at exit if the caller never closes."""
        self._threads = torch.get_num_threads()
        if config.device == "cpu" and config.num_threads is None:
            config = dataclasses.replace(config, num_threads=max(1, self._threads // processes))
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.tp_size > 1:
            config = dataclasses.replace(config, linear_kernels="torch" if config.linear_kernels == "auto" else
                                         config.linear_kernels, decode_attention="bmm" if config.decode_attention ==
                                         "auto" else config.decode_attention)
        self._kv_firsts = [heads_of_rank(hf_config.num_attention_heads, hf_config.num_key_value_heads,
                                         config.tp_size, t).kv_first for t in range(config.tp_size)]
        atexit.register(self.close)
        return config

    device = property(lambda self: self.local.device)
    kernels = property(lambda self: self.local.kernels)
    block_size = property(lambda self: self.local.block_size)
    kv_bytes_per_block = property(lambda self: self.local.kv_bytes_per_block)
    kv_block_shape = property(lambda self: self.local.kv_block_shape)
    kv_dtype = property(lambda self: self.local.kv_dtype)
    kv_format = property(lambda self: self.local.kv_format)
    kv_cache_bytes = property(lambda self: self.local.kv_cache_bytes)
    model = property(lambda self: self.local.model)
    kernel_choices = property(lambda self: self.local.kernel_choices)
    gguf_weights = property(lambda self: self.local.gguf_weights)

    @property
    def failure(self) -> str | None:
        """Why the ranks can no longer run, once they cannot."""
        return self.ranks.failure if self.ranks is not None else None

    @property
    def on_failure(self) -> Callable[[], None] | None:
        return self.ranks.on_failure if self.ranks is not None else None

    @on_failure.setter
    def on_failure(self, callback: Callable[[], None] | None) -> None:
        self.ranks.on_failure = callback

    def enable_decode_graphs(self, max_model_len: int, max_batch: int, capture: bool = True) -> None:
        raise ValueError("CUDA graphs run on one process only (tp_size 1, pp_size 1)")

    def layout(self, batch: list, all_logits: bool = False) -> Any:
        return self.local.layout(batch, all_logits)

    def _whole_block(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """A KV block of every head from each tensor-parallel rank's shard (in rank order); a head replicated on
        several ranks is taken once."""
        firsts = self._kv_firsts
        unique = [shard for t, shard in enumerate(shards) if firsts.index(firsts[t]) == t]
        return torch.cat([shard.to(self.local.device) for shard in unique], dim=2)

    def _lost(self, why: str) -> WorkerLost:
        return self.ranks.lost(why)

    def _close_ranks(self, stop: Callable[[], None]) -> None:
        """Stop the ranks (`stop`: the runner's stop message) once, and give this process its threads back."""
        atexit.unregister(self.close)
        if self.ranks is not None and not self.ranks.closing:
            self.ranks.close(stop)
            torch.set_num_threads(self._threads)


if __name__ == "__main__":  # a rank spawned by RankProcesses: rank, size, rank 0's store port
    worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
