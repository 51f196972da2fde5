"""Which implementation runs each linear layer, chosen by timing the candidates on this machine.

A quant method may offer several kernels for a layer (`QuantMethod.kernels`: the dense method has torch's
`F.linear` and oneDNN's prepacked linear on CPU). Which one is faster depends on the CPU: the prepacked
linear wins ~2.3x in fp32 on AMD Zen 4 and loses on an Intel Xeon with AMX (docs/MEASUREMENTS.md). So at
load each distinct (method, dtype, shape) is timed once per CPU signature (core/cpu.py: CPU model, ISA
flags, threads, torch version) with each candidate at TIMED_ROWS rows (a batch-1 decode step, a batch, a
prefill chunk), and the choice is cached in the cache dir: later loads on the same machine read it. A
candidate replaces the first (stock) one only when it is at least MIN_GAIN faster on the geometric mean of
the row counts, so noise never picks a slower kernel. `kvforge bench kernels` prints the table.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvforge.core.config import DECODE_ATTENTION, LINEAR_KERNELS, cache_dir
from kvforge.core.cpu import cpu_signature
from kvforge.core.kv.quant import KVFormat
from kvforge.core.plugins import LinearKernel

TIMED_ROWS = (1, 16, 128)  # linears: rows of a batch-1 decode step, of a batch, of a prefill chunk
TIMED_CONTEXTS = (128, 1024)  # decode attention: context lengths of a decode group
MIN_GAIN = 0.05  # a candidate must beat the stock kernel by this much (geometric mean) to replace it


@dataclass
class ShapeChoice:
    key: str  # "<method>:<dtype>:<out>x<in>" for a linear, "decode_attention:<dtype>:<heads>x<kv heads>x<head dim>"
    layers: int  # how many of the model's layers it covers
    choice: str
    us: dict[str, dict[int, float]]  # kernel -> rows (context tokens for attention) -> microseconds per call
    cached: bool  # read from the cache, not timed in this process


ROUNDS = 5  # timing rounds, the candidates interleaved in each; the best round of each counts
NOISY = 1.5  # a median round this much slower than the best: the machine is busy, the timing is not cached


@dataclass
class Timing:
    us: dict[str, dict[int, float]]  # kernel -> rows -> microseconds per call (the best round)
    steady: bool  # the rounds agreed: a choice worth caching


def calls_for(fn: Callable[[], Any], min_total: float) -> int:
    """How many calls last about `min_total` seconds (after one warm-up call)."""
    fn()
    start = time.perf_counter()
    fn()
    return max(1, min(1000, int(min_total / max(time.perf_counter() - start, 1e-7))))


def time_calls(calls: dict[str, dict[int, Callable[[], Any]]], min_total: float = 0.005) -> Timing:
    """Microseconds per call of each candidate at each size: ROUNDS rounds, each timing every candidate in
    turn (so a burst of load elsewhere hits them alike), the best round kept."""
    rounds: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name, sizes in calls.items()}
    with torch.inference_mode():
        for n in next(iter(calls.values())):
            fns = {name: sizes[n] for name, sizes in calls.items()}
            counts = {name: calls_for(fn, min_total) for name, fn in fns.items()}
            for _ in range(ROUNDS):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    for _ in range(counts[name]):
                        fn()
                    rounds[name][n].append(1e6 * (time.perf_counter() - start) / counts[name])
    steady = all(sorted(t)[len(t) // 2] <= NOISY * min(t) for per_size in rounds.values() for t in per_size.values())
    return Timing({name: {n: min(t) for n, t in per_size.items()} for name, per_size in rounds.items()}, steady)


def time_kernels(weight: torch.Tensor, bias: torch.Tensor | None, kernels: dict[str, LinearKernel],
                 rows: tuple[int, ...] = TIMED_ROWS) -> Timing:
    """Each linear kernel on `weight` [out, in] at each row count."""
    prepared = {name: kernel.prepare(weight) for name, kernel in kernels.items()}
    inputs = {n: torch.randn(n, weight.shape[1], dtype=weight.dtype, device=weight.device) for n in rows}
    return time_calls({name: {n: (lambda k=kernel, w=prepared[name], x=x: k.run(x, w, bias)) for n, x in inputs.items()}
                       for name, kernel in kernels.items()})


def time_decode_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, names: list[str],
                          contexts: tuple[int, ...] | None = None, softcap: float | None = None) -> Timing:
    """Each named decode-attention variant, run by an attention layer as a step runs it: a batch of
    DECODE_GROUP_SIZE sequences whose contexts end within the last block of `contexts` tokens, their blocks
    scattered over a paged cache (the gathering variants' gather is timed with them)."""
    from kvforge.core.context import DECODE_GROUP_SIZE, DecodeGroup, StepContext, block_tables_tensor, gather_rows
    from kvforge.core.layers.attention import Attention

    g, block, calls = DECODE_GROUP_SIZE, 16, {name: {} for name in names}
    contexts = contexts or TIMED_CONTEXTS
    layer = Attention(heads, kv_heads, head_dim, head_dim ** -0.5, softcap=softcap)
    planes = torch.arange(2 * kv_heads).view(2, 1, kv_heads, 1)
    for length in contexts:
        width = -(-length // block)
        cache = torch.randn(2, kv_heads, g * width, block, head_dim, dtype=dtype)
        tables = torch.randperm(g * width).view(g, width).tolist()
        lengths = torch.linspace(length - 15, length, g).long()
        tables_t, lens_t = block_tables_tensor(tables), lengths.int()
        group = DecodeGroup(0, g, gather_rows(planes * g * width, tables), width * block, lengths)
        ctx = StepContext(lengths - 1, cache[None], decode_groups=[group], block_tables=tables_t, row_lens=lens_t)
        q = torch.randn(g, heads, head_dim, dtype=dtype)

        def run(name: str, ctx=ctx, cache=cache, q=q) -> torch.Tensor:
            layer.use_decode_variant(name)
            ctx.masks.clear()  # built once per step, timed with it
            return layer.decode_rows(ctx, cache, q)

        for name in names:
            calls[name][length] = lambda name=name, run=run: run(name)
    return time_calls(calls)


def pick(us: dict[str, dict[int, float]]) -> str:
    """The first (stock) kernel unless another is MIN_GAIN faster on the geometric mean over row counts."""
    stock = next(iter(us))
    best, best_score = stock, math.log(1 - MIN_GAIN)
    for name, times in us.items():
        if name == stock:
            continue
        score = sum(math.log(times[n] / us[stock][n]) for n in times) / len(times)
        if score < best_score:
            best, best_score = name, score
    return best


class ChoiceCache:
    """The timings of one CPU signature, in one JSON file of the cache dir (written atomically, merged)."""

    def __init__(self, directory: Path, signature: dict[str, Any]) -> None:
        signature = {**signature, "rows": list(TIMED_ROWS), "contexts": list(TIMED_CONTEXTS), "min_gain": MIN_GAIN,
                     "rounds": ROUNDS}  # how the choice is made
        digest = hashlib.sha1(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]
        self.path = directory / "kernel_choice" / f"{digest}.json"
        self.signature = signature

    def read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data.get("choices", {}) if data.get("signature") == self.signature else {}

    def write(self, entries: dict[str, dict]) -> None:
        """Merge `entries` into the file (another process may have added shapes meanwhile)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            merged = {**self.read(), **entries}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"signature": self.signature, "choices": merged}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache dir: the choice is timed again next time


def cached_choice(key: str, measure: Callable[[], tuple[Any, Timing | None]]) -> Any:
    """A choice timed once per CPU signature: read from the cache dir where an earlier process timed it steadily,
    else `measure()` -> (choice, its timing; None: nothing was timed), kept when the timing was steady (a busy
    machine's answer serves this process only)."""
    cache = ChoiceCache(default_cache_dir(), cpu_signature())
    known = cache.read().get(key)
    if known is not None:
        return known["choice"]
    choice, timing = measure()
    if timing is not None and timing.steady:
        cache.write({key: {"choice": choice, "us": timing.us}})
    return choice


def linear_key(method: Any, weight: torch.Tensor) -> str:
    return f"{type(method).__name__}:{str(weight.dtype).removeprefix('torch.')}:{weight.shape[0]}x{weight.shape[1]}"


@dataclass
class OpClass:
    """Layers of one kind and shape that take one kernel: its candidates (the stock one first), how to time
    them (built only when timed) and how to switch the layers to the chosen one. `automatic`: the candidates
    auto may pick (None: all; the others are timed for the bench and run only when named)."""

    key: str
    layers: int
    candidates: list[str]
    timing: Callable[[], Timing]
    apply: Callable[[str], None]
    automatic: list[str] | None = None


def linear_classes(model: torch.nn.Module) -> list[OpClass]:
    """The linear shapes whose quant method offers several kernels, one class per (method, dtype, shape)."""
    groups: dict[str, list[torch.nn.Module]] = {}
    offered: dict[str, dict[str, LinearKernel]] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernels = method.kernels(module) if method is not None else {}
        if len(kernels) > 1:
            key = linear_key(method, module.weight)
            groups.setdefault(key, []).append(module)
            offered[key] = kernels

    def apply(layers: list[torch.nn.Module]) -> Callable[[str], None]:
        return lambda name: [layer.quant_method.use_kernel(layer, name) for layer in layers]

    return [OpClass(key, len(layers), list(offered[key]),
                    lambda first=layers[0], kernels=offered[key]: time_kernels(first.weight, first.bias, kernels),
                    apply(layers)) for key, layers in groups.items()]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are (CPU for a model without any)."""
    return next(model.parameters(), torch.empty(0)).device


def attention_classes(model: torch.nn.Module, dtype: torch.dtype, kv_format: KVFormat | None = None) -> list[OpClass]:
    """The torch path's decode attention, one class per head layout and soft-capping (layers built on Triton have
    none). Over a quantized KV pool (`kv_format`) auto takes the paged kernel where it runs, untimed: it dequantizes in
    registers, where the gathering variants dequantize each group's whole context per layer (the copy the format
    exists to avoid); "bmm" elsewhere."""
    from kvforge.core.layers.attention import Attention
    from kvforge.core.layers.decode_attention import automatic_variants, offered_variants

    groups: dict[tuple[int, int, int, float | None], list[Attention]] = {}
    for module in model.modules():
        if isinstance(module, Attention) and not module.triton:
            key = (module.num_heads, module.num_kv_heads, module.head_dim, module.softcap)
            groups.setdefault(key, []).append(module)
    device, dtype_name = model_device(model), str(dtype).removeprefix("torch.")
    classes = []
    for (h, kv, d, cap), layers in groups.items():
        offered = offered_variants(device, cap is not None)
        automatic = automatic_variants(dtype, device, cap is not None)
        if kv_format is not None:
            automatic = ["paged" if "paged" in offered else "bmm"]
        storage = dtype_name if kv_format is None else f"{dtype_name}:{kv_format.name}"
        classes.append(OpClass(
            f"decode_attention:{storage}:{h}x{kv}x{d}" + ("" if cap is None else ":softcap"), len(layers), offered,
            lambda h=h, kv=kv, d=d, cap=cap, offered=offered: time_decode_attention(h, kv, d, dtype, offered,
                                                                                    softcap=cap),
            lambda name, layers=layers: [layer.use_decode_variant(name, device) for layer in layers], automatic))
    return classes


def decide(classes: list[OpClass], mode: str, cache: ChoiceCache | None, retime: bool) -> list[ShapeChoice]:
    """`mode` (a candidate's name: that one where offered, the stock one elsewhere) or, with "auto", the
    cached or newly timed choice; each class's layers are switched to it. Steady timings go to the cache."""
    known = cache.read() if cache is not None and not retime else {}
    choices, timed = [], {}
    for op in classes:
        automatic = op.automatic or op.candidates
        if mode != "auto":
            choice = ShapeChoice(op.key, op.layers, mode if mode in op.candidates else op.candidates[0], {}, False)
        elif len(automatic) == 1 and not retime:  # nothing to choose between
            choice = ShapeChoice(op.key, op.layers, automatic[0], {}, False)
        elif op.key in known and known[op.key].get("choice") in automatic and set(known[op.key]["us"]) == set(
                op.candidates):  # timed among the same candidates (a kernel added since is timed too)
            us = {name: {int(n): t for n, t in sizes.items()} for name, sizes in known[op.key]["us"].items()}
            choice = ShapeChoice(op.key, op.layers, known[op.key]["choice"], us, True)
        else:
            timing = op.timing()
            choice = ShapeChoice(op.key, op.layers, pick({k: t for k, t in timing.us.items() if k in automatic}),
                                 timing.us, False)
            if timing.steady:  # a busy machine's choice serves this process only: timed again next load
                timed[op.key] = {"choice": choice.choice, "us": timing.us}
        op.apply(choice.choice)
        choices.append(choice)
    if cache is not None and timed:
        cache.write(timed)
    return choices


def choose_kernels(model: torch.nn.Module, dtype: torch.dtype, linear: str = "auto", attention: str = "auto",
                   cache_dir: Path | None = None, retime: bool = False,
                   kv_format: KVFormat | None = None) -> list[ShapeChoice]:
    """Give the model's linears (`linear_kernels`) and decode attention (`decode_attention`) the kernels those
    settings name, or (auto) the ones timed fastest on this machine; one ShapeChoice per op class and shape.
    `retime`: time again even what the cache has (the bench does)."""
    if linear not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernels must be one of {', '.join(LINEAR_KERNELS)}, got {linear!r}")
    if attention not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}, got {attention!r}")
    linears, attentions = linear_classes(model), attention_classes(model, dtype, kv_format)
    if linear not in ("auto", "torch") and not any(linear in op.candidates for op in linears):
        raise ValueError(f"linear_kernels={linear!r} is not available here: no layer offers it (oneDNN's prepacked "
                         "linear runs dense float32 / bfloat16 layers on CPU)")
    if attention != "auto" and any(attention not in op.candidates for op in attentions):
        from kvforge.core.layers.decode_attention import DECODE_VARIANTS

        reason = DECODE_VARIANTS[attention].unavailable(model_device(model)) or \
            "it has no attention-logit soft-capping, which this model's layers need"
        raise ValueError(f"decode_attention={attention!r} cannot run here: {reason}")
    timed_here = (linear == "auto" and linears) or (attention == "auto" and attentions)
    cache = ChoiceCache(cache_dir or default_cache_dir(), cpu_signature()) if timed_here else None
    return decide(linears, linear, cache, retime) + decide(attentions, attention, cache, retime)


def default_cache_dir() -> Path:

    return cache_dir()
