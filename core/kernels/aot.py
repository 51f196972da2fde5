"""Ahead-of-time compilation of recorded kernel launches, for a GPU this machine need not have.

`compile_launch(launch)` compiles one launch recorded by `runtime.record_launches` for a target (Hopper,
sm_90, by default) with the signature triton's own launcher would build from the same arguments: tensors
become typed pointers, ints i32 / i64, floats fp32, bools u1, None and `tl.constexpr` parameters constants;
ints equal to 1 become constants and pointers / ints divisible by 16 get the divisibility hint, as at a
real launch (triton's `native_specialize_impl` decides both). Keyword arguments that are not kernel
parameters (num_warps, num_stages, enable_fp_fusion, ...) are compile options. Only triton's compiler runs
(to PTX through ptxas to a cubin), no driver, so this works on a CPU-only machine.

Record with `record_launches(dry_run=True)` to get the constexprs of the compiled-GPU path; launches
recorded under TRITON_INTERPRET=1 carry the interpreter's workarounds instead. Compile in a process that
imported triton without TRITON_INTERPRET=1: triton jits its own helpers (tl.standard) at import, and
interpreted ones cannot be compiled (RuntimeError here).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvforge.core.kernels.runtime import Kernel, Launch, triton

if TYPE_CHECKING:
    from triton.backends.compiler import GPUTarget

HOPPER = (90, 32)  # (compute capability, warp size) of sm_90


@dataclass(frozen=True)
class Compiled:
    """One launch compiled ahead of time, with what its cubin tells about it."""

    name: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any]
    shared: int  # bytes of shared memory per program
    wgmma: bool  # Hopper warpgroup tensor-core MMA in the PTX
    mma: bool  # mma.sync (pre-Hopper tensor-core) instructions in the PTX
    registers: int | None  # per thread, from cuobjdump (None when it is not there)
    spill_bytes: int | None  # stack frame + local memory per thread: register spills (no local arrays here)
    kernel: Any = field(repr=False)  # triton's CompiledKernel: .asm["ptx"], .asm["cubin"], .metadata

    def summary(self) -> str:
        tc = "wgmma" if self.wgmma else "mma.sync" if self.mma else "no tensor cores"
        return (f"{self.name}: shared {self.shared} B, {tc}, registers {self.registers}, "
                f"spills {self.spill_bytes} B, {self.options}")


def _target(target: GPUTarget | None) -> GPUTarget:
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", *HOPPER) if target is None else target


@functools.cache
def _jit(kernel: Kernel):
    from triton.runtime.jit import JITFunction

    if not isinstance(triton.language.standard._sum_combine, JITFunction):
        raise RuntimeError("triton was imported with TRITON_INTERPRET=1: its own jitted helpers are interpreted "
                           "and cannot be compiled; compile in a process started without it")
    # JITFunction directly, not triton.jit: under TRITON_INTERPRET=1 that would give an interpreted function
    return JITFunction(kernel.with_helpers(JITFunction))


def launch_signature(launch: Launch, target: GPUTarget | None = None,
                     ) -> tuple[dict[str, str], dict[str, Any], dict, dict[str, Any]]:
    """(signature, constexprs, attrs, options) that triton's launcher would compile `launch` with on `target`."""
    from triton.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    jit = _jit(launch.kernel)
    backend = make_backend(_target(target))
    names = set(jit.arg_names)
    options = {k: v for k, v in launch.kwargs.items() if k not in names}
    bound = jit.signature.bind(*launch.args, **{k: v for k, v in launch.kwargs.items() if k in names})
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for param in jit.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            kind, key = "constexpr", None
        else:
            kind, key = native_specialize_impl(type(backend), value, param.is_const, not param.do_not_specialize,
                                               not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = value
        elif isinstance(key, str) and (parsed := backend.parse_attr(key)):
            attrs[(param.num,)] = parsed
    return signature, constexprs, attrs, options


def compile_launch(launch: Launch, target: GPUTarget | None = None) -> Compiled:
    """Compile `launch` for `target` (default sm_90); raises triton's error when it does not compile."""
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = launch_signature(launch, target)
    kernel = triton.compile(ASTSource(_jit(launch.kernel), signature, constexprs, attrs),
                            target=_target(target), options=options)
    ptx = kernel.asm["ptx"]
    registers, spills = _resource_usage(kernel.asm["cubin"])
    return Compiled(launch.name, signature, constexprs, options, shared=kernel.metadata.shared,
                    wgmma="wgmma.mma_async" in ptx, mma="mma.sync" in ptx, registers=registers,
                    spill_bytes=spills, kernel=kernel)


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack + local bytes) per thread from triton's bundled cuobjdump; (None, None) without it.
    The driver would report them too, but only after loading the cubin on a GPU."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(tool, os.X_OK):
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True)
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", done.stdout))
    if "REG" not in usage:
        return None, None
    return int(usage["REG"]), int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0))


def signature_key(launch: Launch, target: GPUTarget | None = None) -> tuple:
    """Hashable identity of what `compile_launch` would build: equal keys compile to the same kernel."""
    signature, constexprs, attrs, options = launch_signature(launch, target)
    return (launch.kernel.fn, tuple(signature.items()), tuple((k, repr(v)) for k, v in constexprs.items()),
            tuple((k, repr(v)) for k, v in attrs.items()), tuple(sorted((k, repr(v)) for k, v in options.items())))


__all__ = ["Compiled", "compile_launch", "launch_signature", "signature_key"]
