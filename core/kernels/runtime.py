"""Whether Triton kernels can run here, and jitting that follows the interpreter setting.

triton 3.9 decides interpreted vs compiled when a function is jitted, not when it is called. A
`Kernel` jits its function on first launch, once per interpreter setting, so setting
`TRITON_INTERPRET=1` after importing triton (as the tests do) still interprets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without triton still import the layers; kernels report it instead
    triton = None
    tl = None


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1 is in force: kernels run on CPU tensors through the interpreter."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def triton_available() -> bool:
    """Whether Triton kernels can run here: triton importable and a CUDA device (or TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return interpreting() or torch.cuda.is_available()


def check_runnable(*tensors: torch.Tensor, name: str) -> None:
    """ValueError unless the tensors share one device the kernel `name` can run on."""
    if triton is None:
        raise RuntimeError(f"{name} needs the `triton` package")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got {device}")


class Kernel:
    """A Triton kernel function, jitted lazily per interpreter setting: `Kernel(fn)[grid](*args)`."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._jitted: dict[bool, object] = {}

    def __getitem__(self, grid):
        interpret = interpreting()
        if interpret not in self._jitted:
            self._jitted[interpret] = triton.jit(self.fn)
        return self._jitted[interpret][grid]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """The kernel backend a model on `device` uses: EngineConfig.kernels with "auto" decided ("triton" on
    CUDA when triton is installed, else "torch"); "triton" where it cannot run is a ValueError."""
    if kernels == "torch":
        return "torch"
    runnable = triton is not None and (device.type == "cuda" or interpreting())
    if kernels == "auto":
        return "triton" if device.type == "cuda" and runnable else "torch"
    if not runnable:
        why = "the `triton` package is not installed" if triton is None else f"the model runs on {device.type}"
        raise ValueError(f"kernels='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU): {why}")
    return "triton"
