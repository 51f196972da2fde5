"""Which kernels the layers being built use: the torch ones (CPU, any device) or the Triton ones
(core/kernels: CUDA, or CPU under TRITON_INTERPRET=1 in tests).

Like the tensor-parallel layout, layers read it when they are built (`with kernel_backend("triton"):
build the model`) and keep it, so two models in one process may use different kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_building = threading.local()  # per thread: a server may build one model while another is being built


@contextmanager
def kernel_backend(name: str) -> Iterator[None]:
    if name not in ("torch", "triton"):
        raise ValueError(f"kernel backend must be 'torch' or 'triton', got {name!r}")
    previous, _building.backend = getattr(_building, "backend", "torch"), name
    try:
        yield
    finally:
        _building.backend = previous


def use_triton() -> bool:
    return getattr(_building, "backend", "torch") == "triton"
