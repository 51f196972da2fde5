"""Whether Triton kernels can run here, and jitting that follows the interpreter setting.

triton 3.9 decides interpreted vs compiled when a function is jitted, not when it is called. A
`Kernel` jits its function on first launch, once per interpreter setting, so setting
`TRITON_INTERPRET=1` after importing triton (as the tests do) still interprets.

`record_launches()` records every `Kernel` launch made inside it (kernel, grid, arguments), so a test can
compile exactly the launches the code makes ahead of time for a GPU it does not have (see aot.py). With
`dry_run=True` nothing runs and the host code takes the compiled-GPU path even on a CPU machine.

triton itself is imported at first need (`triton` / `tl` of this module, a kernel's first launch): a CPU engine
that runs none of these kernels does not carry it (71 MiB of resident memory, measured on the embedded model).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# CPU machines without triton still import the layers; kernels report it instead
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _triton():
    """The triton package, imported on first use."""
    import triton
    import triton.language  # noqa: F401  (tl)

    return triton


def __getattr__(name: str):
    """`triton` and `tl` for the kernel modules (None where triton is not installed), imported when first asked."""
    if name in ("triton", "tl"):
        if not TRITON_INSTALLED:
            return None
        return _triton() if name == "triton" else _triton().language
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Set only inside `record_launches`: the normal launch path pays one global check for them.
_recording: list[Launch] | None = None
_dry_run = False


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1 is in force: kernels run on CPU tensors through the interpreter.
    False inside `record_launches(dry_run=True)`, so host code picks what a compiled launch would."""
    if not TRITON_INSTALLED or _dry_run:
        return False
    if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
        return False  # neither the environment nor an imported triton's knobs ask for it: no import needed
    return bool(_triton().knobs.runtime.interpret)


def triton_available() -> bool:
    """Whether Triton kernels can run here: triton importable and a CUDA device (or TRITON_INTERPRET=1)."""
    if not TRITON_INSTALLED:
        return False
    return interpreting() or torch.cuda.is_available()


def check_runnable(*tensors: torch.Tensor, name: str) -> None:
    """ValueError unless the tensors share one device the kernel `name` can run on."""
    if not TRITON_INSTALLED:
        raise RuntimeError(f"{name} needs the `triton` package")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not interpreting() and not _dry_run:
        raise ValueError(f"{name} runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got {device}")


class Kernel:
    """A Triton kernel function, jitted lazily per interpreter setting: `Kernel(fn)[grid](*args)`. `helpers`: the
    device functions it calls, jitted with it in the same setting and seen by it under their names (a function
    jitted at import would stay in the mode of that moment)."""

    def __init__(self, fn: Callable, helpers: tuple[Callable, ...] = ()) -> None:
        self.fn, self.helpers = fn, helpers
        self._jitted: dict[bool, object] = {}

    def __getitem__(self, grid):
        if _recording is not None:
            return functools.partial(self._record, _recording, _dry_run, grid)
        return self._jit()[grid]

    def _jit(self):
        interpret = interpreting()
        if interpret not in self._jitted:
            self._jitted[interpret] = _triton().jit(self.with_helpers(_triton().jit))
        return self._jitted[interpret]

    def with_helpers(self, jit: Callable) -> Callable:
        """The kernel function to jit: itself, or a copy over its module's names plus its helpers jitted by `jit`
        (triton.jit here; aot.py's compiler takes JITFunction)."""
        if not self.helpers:
            return self.fn
        fn = self.fn
        names = {**fn.__globals__, **{helper.__name__: jit(helper) for helper in self.helpers}}
        copy = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__annotations__, copy.__qualname__, copy.__module__ = fn.__annotations__, fn.__qualname__, fn.__module__
        return copy

    def _record(self, into: list[Launch], dry_run: bool, grid, *args, **kwargs) -> None:
        into.append(Launch(self, grid, args, kwargs))
        if not dry_run:
            self._jit()[grid](*args, **kwargs)


@dataclass(frozen=True)
class Launch:
    """One recorded launch `kernel[grid](*args, **kwargs)`; kwargs hold constexprs and launch options
    (num_warps, num_stages, ...) exactly as passed."""

    kernel: Kernel
    grid: Any
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@contextlib.contextmanager
def record_launches(dry_run: bool = False) -> Iterator[list[Launch]]:
    """Collect every `Kernel` launch made inside the block, in order, into the list it yields.

    Launches still run unless `dry_run`: then nothing runs (outputs stay unwritten) and the host code takes
    the compiled-GPU path on any machine: `interpreting()` is False and `check_runnable` accepts tensors on
    any device, so the recorded constexprs are those a GPU launch gets (e.g. no interpreter workarounds).
    For tests, not thread-safe; blocks may nest (the inner one records alone).
    """
    global _recording, _dry_run
    saved = _recording, _dry_run
    _recording, _dry_run = [], dry_run
    try:
        yield _recording
    finally:
        _recording, _dry_run = saved


def fp32_dots(dtype: torch.dtype) -> bool:
    """Whether a kernel's tl.dot must take fp32 operands (IEEE products): for fp32 inputs, and whenever
    interpreting -- the interpreter multiplies bf16 / fp16 dot operands as raw bits. Compiled 16-bit inputs
    dot in their own dtype on tensor cores."""
    return dtype == torch.float32 or interpreting()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """The kernel backend a model on `device` uses: EngineConfig.kernels with "auto" decided ("triton" on
    CUDA when triton is installed, else "torch"); "triton" where it cannot run is a ValueError."""
    if kernels == "torch":
        return "torch"
    runnable = TRITON_INSTALLED and (device.type == "cuda" or interpreting())
    if kernels == "auto":
        return "triton" if device.type == "cuda" and runnable else "torch"
    if not runnable:
        why = "the `triton` package is not installed" if not TRITON_INSTALLED else f"the model runs on {device.type}"
        raise ValueError(f"kernels='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU): {why}")
    return "triton"
