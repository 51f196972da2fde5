"""Which kernels the layers being built use: the torch ones (CPU, any device) or the Triton ones
(core/kernels: CUDA, or CPU under TRITON_INTERPRET=1 in tests); and whether an fp32 model's SiLU and RMSNorm may
take the fused C kernels (core/cpu_kernels/elementwise.c), which differ from torch's ops in the last bits: only
where the linears are not exact anyway (`exact_fp32=False`: a quant method whose matmuls are not the dense fp32
model's, QuantMethod.exact_fp32), so the dense fp32 path stays bit for bit the reference's.

Like the tensor-parallel layout, layers read it when they are built (`with kernel_backend("triton"):
build the model`) and keep it, so two models in one process may use different kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_building = threading.local()  # per thread: a server may build one model while another is being built


@contextmanager
def kernel_backend(name: str, exact_fp32: bool = True) -> Iterator[None]:
    if name not in ("torch", "triton"):
        raise ValueError(f"kernel backend must be 'torch' or 'triton', got {name!r}")
    previous = getattr(_building, "backend", "torch"), getattr(_building, "exact_fp32", True)
    _building.backend, _building.exact_fp32 = name, exact_fp32
    try:
        yield
    finally:
        _building.backend, _building.exact_fp32 = previous


def use_triton() -> bool:
    return getattr(_building, "backend", "torch") == "triton"


def fused_fp32_elementwise() -> bool:
    """Whether the layers being built may run SiLU and RMSNorm in fp32 through the fused C kernels."""
    return not getattr(_building, "exact_fp32", True)
