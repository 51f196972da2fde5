"""CPU kernels written in C: compiled at first use with the system C compiler for this CPU (-march=native),
cached in the cache dir by a hash of the source, the compiler and the CPU, loaded through ctypes.

Why by hand: no maintained package offers a paged attention for CPU tensors that works with our torch
(vLLM's CPU ops come only inside vLLM's own wheel). Why C through ctypes rather than a torch C++ extension:
torch's headers take ~40 s to compile on two cores, plain C takes about one; ctypes releases the GIL during
the call. The OpenMP runtime is the one torch already loaded (the same libgomp.so.1 soname), so the kernel's
threads are torch's threads, not a second pool.

Without a C compiler the kernels are not offered: the torch variants run (the reason is in `unavailable()`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvforge.core.kv.quant import KVFormat, check_kv_cache

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.c"))  # paged_attention.c, elementwise.c, dequant.c, gguf_blocks.c; all include common.h
# -fno-trapping-math: without it GCC keeps a clamp (`x > 87 ? 87 : x`) as a branch and leaves the loop around it
# scalar (exp_clamped: SiLU of 8192 values 42 -> 20 us); it changes no computed value, only which floating-point
# exception flags a loop may raise, and no kernel reads them
# KVFORGE_CPU_MARCH: the instruction set to build for (default native: this CPU's widest); e.g. x86-64-v3 builds the
# AVX2 code, as a CPU without AVX-512 runs it (the tests build it so on an AVX-512 machine too), or for a library
# cache shared between machines
MARCH = os.environ.get("KVFORGE_CPU_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_I32, _I64, _PTR, _F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = {  # kvf_<name>'s argument types, as declared in the C files
    "paged_attention": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _F32, _I32,
                        _F32, _I32, _I32, _I32, _I32, _I32],
    "silu_and_mul": [_PTR, _I64, _PTR, _I64, _I32, _I32, _I32],
    "add_rms_norm": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I32, _F32, _I32, _I32],
    "rotary": [_PTR, _I64, _PTR, _PTR, _I64, _I32, _I32, _I32, _I32],
    "store_kv": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I32, _I32, _I32, _I32, _I32],
    "dequant_int4": [_PTR, _PTR, _PTR, _I64, _I32, _I32],
    "int8_linear": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I32, _I64, _I32, _I32, _I32, _I32],
    "dequant_int8": [_PTR, _PTR, _PTR, _PTR, _I64, _I32, _I32, _I32],
    "gguf_linear": [_PTR, _I64, _I32, _I32, _I32, _I32, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I32, _I32, _I32],
    "gguf_linear_exact": [_PTR, _I64, _I32, _I32, _I32, _I32, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I32, _I32, _I32],
    "gguf_experts_linear": [_PTR, _I64, _I64, _PTR, _I32, _I32, _I32, _I32, _PTR, _I32, _PTR, _PTR, _PTR, _PTR, _PTR,
                            _I32, _I32, _I32],
    "moe_group": [_PTR, _PTR, _I64, _I32, _I32, _I32, _PTR, _PTR, _PTR],
    "moe_combine": [_PTR, _PTR, _PTR, _I64, _I32, _I32, _I64, _PTR],
    "gguf_dequant": [_I32, _PTR, _I64, _PTR, _I64, _I32, _PTR, _I32, _I32],
    "gguf_simd_built": [],
}
RETURNS = {"gguf_simd_built": _I32, "gguf_experts_linear": _I32, "moe_group": _I32,
           "moe_combine": _I32}  # (the others return nothing)


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (no compiler, a failed build)."""


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise KernelUnavailable("no C compiler found (install gcc, or set CC)")
    return compiler


@functools.cache
def _library() -> ctypes.CDLL:
    from kvforge.core.config import cache_dir
    from kvforge.core.cpu import cpu_signature
    from kvforge.core.private_files import private_dir

    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C compiler {compiler!r} does not run: {e}") from e
    texts = [path.read_text() for path in sorted(HERE.glob("*.[ch]"))]
    key = hashlib.sha1("\0".join([*texts, version, " ".join(FLAGS), repr(sorted(cpu_signature().items()))]).encode()
                       ).hexdigest()[:16]
    directory = private_dir(cache_dir() / "cpu_kernels")
    path = directory / f"kernels-{key}.so"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so")
        os.close(fd)
        try:
            built = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                                   text=True, timeout=300)
            if built.returncode != 0:
                raise KernelUnavailable(f"building the CPU kernels failed: {built.stderr.strip()[-2000:]}")
            os.replace(tmp, path)  # atomic: a concurrent build by another process is the same file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    library = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(library, f"kvf_{name}")
        fn.argtypes, fn.restype = argtypes, RETURNS.get(name)
    return library


@functools.cache  # a failed build is not retried at every call
def unavailable() -> str | None:
    """Why the C kernels cannot run here, or None when they can (builds them on first call)."""
    try:
        _library()
    except (KernelUnavailable, OSError) as e:
        return str(e)
    return None


def paged_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    scale: float, window: int | None, out: torch.Tensor, row_seqs: torch.Tensor | None = None,
                    portable: bool = False, softcap: float | None = None, kv_format: KVFormat | None = None,
                    rotate: bool = False) -> None:
    """Each query row over its sequence's paged K/V, read in place (core/cpu_kernels/paged_attention.c).
    q [rows, heads, head_dim] (rows may be strided); cache [2, kv_heads, blocks, block_size, head_dim] one layer,
    contiguous; block_tables int32 [seqs, width]; row_seqs int32 [rows]: each row's sequence (None: row r is
    sequence r); context_lens int32 [rows]: L, the row is the token at position L - 1 and sees keys [0, L) (within
    the window; 0: a padding row, output 0); out [rows, heads * head_dim], contiguous, q's dtype: written.
    `portable`: the plain C loops even where the AVX-512 path would run (the tests check both); `softcap`: scores
    -> softcap * tanh(scores / softcap) before the softmax (None: none); `kv_format`: the cache's quantized format
    (core/kv/quant.py: a uint8 cache [2, kv_heads, blocks, block_size, row_bytes]), dequantized as it is read;
    `rotate`: the cache holds K and V times the Hadamard matrix H (KVFormat.rotate): q and out stay the model's, the
    kernel multiplies q by H^-1 (rounded to q's dtype) and the fp32 output by H^-1."""
    rows, heads, head_dim = q.shape
    check_rotation("paged attention", rotate, head_dim)
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    kv = check_kv_storage("paged attention", q, cache, kv_format)
    if q.dtype not in DTYPE_CODES or out.dtype != q.dtype:
        raise ValueError(f"paged attention: q {q.dtype} and out {out.dtype} must be one of float32 / bfloat16 / "
                         f"float16, the same")
    indices = (block_tables, context_lens) if row_seqs is None else (block_tables, context_lens, row_seqs)
    if not (cache.is_contiguous() and out.is_contiguous()
            and all(t.is_contiguous() and t.dtype == torch.int32 for t in indices)):
        raise ValueError("paged attention: cache, out, block_tables, context_lens, row_seqs must be contiguous; the "
                         "tables, lengths and row sequences int32")
    if rows == 0:
        return
    _, kv_heads, blocks, block_size, _ = cache.shape
    _run("paged_attention", q.data_ptr(), q.stride(0), out.data_ptr(), cache.data_ptr(), block_tables.data_ptr(),
         None if row_seqs is None else row_seqs.data_ptr(), context_lens.data_ptr(), rows, heads, kv_heads, head_dim,
         blocks, block_size, block_tables.shape[1], scale, window or 0, softcap or 0.0, DTYPE_CODES[q.dtype], kv,
         torch.get_num_threads(), portable, rotate)


def check_rotation(name: str, rotate: bool, head_dim: int) -> None:
    if rotate and head_dim & (head_dim - 1):
        raise ValueError(f"{name}: rotating rows by a Hadamard matrix needs a power-of-two head_dim, not {head_dim}")


def check_kv_storage(name: str, x: torch.Tensor, cache: torch.Tensor, kv_format: KVFormat | None) -> int:
    """The kernels' code of the cache's storage: x's dtype for a full-precision cache, the format's for a quantized
    one (core/kv/quant.py check_kv_cache); a ValueError naming both otherwise."""
    check_kv_cache(name, kv_format, cache, x.shape[-1])
    if kv_format is not None:
        return kv_format.code
    if cache.dtype != x.dtype or x.dtype not in DTYPE_CODES:
        raise ValueError(f"{name}: a cache of {cache.dtype} for {x.dtype} values; without a quantized KV format "
                         f"both must be one of float32 / bfloat16 / float16, the same")
    return DTYPE_CODES[x.dtype]


@functools.cache
def _kernel(kernel: str):
    return getattr(_library(), f"kvf_{kernel}")


def _run(kernel: str, *args):
    """Call kvf_<kernel> (what it returns); under torch's profiler named as an op (a ctypes call is none: it would
    count as Python)."""
    fn = _kernel(kernel)
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(f"kvforge::{kernel}"):
            return fn(*args)
    return fn(*args)


FUSED_DTYPES = (torch.bfloat16, torch.float32)  # what the fused elementwise kernels take


def fused_elementwise_for(x: torch.Tensor, fp32: bool = False) -> bool:
    """Whether the fused elementwise kernels (core/cpu_kernels/elementwise.c) take `x`: a bf16 CPU tensor, or an
    fp32 one where `fp32` allows it (rotary: bit for bit torch's; SiLU / RMSNorm: where the model's linears are
    not exact anyway, core/layers/backend.py), where the kernels build."""
    return ((x.dtype == torch.bfloat16 or (fp32 and x.dtype == torch.float32)) and x.device.type == "cpu"
            and unavailable() is None)


def _fused_dtype(x: torch.Tensor, *others: torch.Tensor) -> int:
    """The dtype code of the fused kernels' tensors: bf16 or fp32, all one dtype (checked cheaply: a decode step
    calls these kernels ~100 times)."""
    if x.dtype not in FUSED_DTYPES or any(t.dtype != x.dtype for t in others):
        raise ValueError(f"the fused elementwise kernels take bfloat16 or float32 tensors, all one dtype, got "
                         f"{[t.dtype for t in (x, *others)]}")
    return DTYPE_CODES[x.dtype]


def moe_group(experts: torch.Tensor, weights: torch.Tensor, num_experts: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A MoE step's routing grouped by expert (core/cpu_kernels/elementwise.c): `experts` int64 and `weights` (fp32 /
    bf16 / fp16) [tokens, k] -> (each grouped pair's token [pairs], its weight [pairs], starts [num_experts + 1], the
    most pairs one expert has); pairs in their order within an expert, as torch's stable argsort groups them."""
    flat, flat_weights = experts.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    if flat.dtype != torch.int64 or flat_weights.dtype not in DTYPE_CODES or flat.numel() != flat_weights.numel():
        raise ValueError("experts: int64 and weights: fp32 / bf16 / fp16 of one shape expected")
    pairs = flat.numel()
    tokens = torch.empty(pairs, dtype=torch.int64)
    sorted_weights = torch.empty(pairs, dtype=flat_weights.dtype)
    starts = torch.empty(num_experts + 1, dtype=torch.int64)
    widest = _run("moe_group", flat.data_ptr(), flat_weights.data_ptr(), pairs, experts.shape[-1], num_experts,
                  DTYPE_CODES[flat_weights.dtype], tokens.data_ptr(), sorted_weights.data_ptr(), starts.data_ptr())
    if widest < 0:
        raise ValueError(f"expert ids outside [0, {num_experts})")
    return tokens, sorted_weights, starts, widest


def moe_combine(y: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens, hidden]: zeros, then y[p] * weights[p] added into row tokens[p] for each grouped pair p in order,
    each product and sum kept in the dtype (fp32 / bf16 / fp16): the bits of transformers' MoE loop, one `index_add_`
    of `y * w` per expert."""
    y, weights, tokens = y.contiguous(), weights.contiguous(), tokens.contiguous()
    if y.dtype not in DTYPE_CODES or weights.dtype != y.dtype or tokens.dtype != torch.int64 or \
            y.shape[0] != weights.numel() or tokens.numel() != y.shape[0]:
        raise ValueError("y [pairs, hidden], weights [pairs] of y's dtype, tokens int64 [pairs] expected")
    out = torch.zeros(num_tokens, y.shape[1], dtype=y.dtype)
    if _run("moe_combine", y.data_ptr(), weights.data_ptr(), tokens.data_ptr(), tokens.numel(), y.shape[1],
            DTYPE_CODES[y.dtype], num_tokens, out.data_ptr()):
        raise ValueError(f"tokens outside [0, {num_tokens})")
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate_up projection x [rows, 2 * inter] (bf16 / fp32, unit column stride)."""
    dtype = _fused_dtype(x)
    rows, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, inter)
    _run("silu_and_mul", x.data_ptr(), x.stride(0), out.data_ptr(), rows, inter, dtype, torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """RMSNorm of x (+ residual) [rows, hidden], contiguous bf16 / fp32 (the weight too): norm(x + residual), and
    x + residual when a residual is given (then a tuple), as core/layers/norm.py's torch path computes them."""
    dtype = _fused_dtype(x, weight, *([] if residual is None else [residual]))
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    _run("add_rms_norm", x.data_ptr(), None if residual is None else residual.data_ptr(),
         None if total is None else total.data_ptr(), out.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps,
         dtype, torch.get_num_threads())
    return out if residual is None else (out, total)


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """core/layers/rotary.apply_rotary written back into x (bf16 / fp32 [tokens, heads, head_dim], heads contiguous
    within a row, e.g. the q|k columns of a fused qkv output) and returned; cos, sin [tokens, 1, head_dim], x's
    dtype."""
    dtype = _fused_dtype(x, cos, sin)
    rows, heads, head_dim = x.shape
    cos, sin = cos.reshape(rows, head_dim).contiguous(), sin.reshape(rows, head_dim).contiguous()
    _run("rotary", x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads, head_dim, dtype,
         torch.get_num_threads())
    return x


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
             kv_format: KVFormat | None = None, rotate: bool = False) -> None:
    """The step's new K and V [tokens, kv_heads, head_dim] (heads contiguous within a row, any row stride: e.g. the
    columns of a fused qkv output) written into one layer's contiguous paged cache at `rows` (int64, one per
    (K/V, token, head), indexing the cache viewed as [-1, head_dim]): torch's stack + index_copy_ in one pass; a
    quantized cache (`kv_format`, rows of its row_bytes) gets each row quantized as core/kv/quant.py's quantize.
    The rows come from the runner (in range by construction); they are not checked here. `rotate`: each row is
    multiplied by the Hadamard matrix and rounded to k's dtype first (KVFormat.rotate), as the attention layer's
    torch rotation does."""
    tokens, kv_heads, head_dim = k.shape
    check_rotation("store_kv", rotate, head_dim)
    kv = check_kv_storage("store_kv", k, cache, kv_format)
    if not (k.dtype == v.dtype and k.shape == v.shape
            and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim
            and rows.dtype == torch.int64 and rows.numel() == 2 * tokens * kv_heads
            and cache.is_contiguous() and rows.is_contiguous()):
        raise ValueError("store_kv: k / v [tokens, kv_heads, head_dim] of one dtype with heads contiguous, a "
                         "contiguous cache, int64 rows, one per (K/V, token, head)")
    _run("store_kv", k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cache.data_ptr(), rows.data_ptr(), tokens,
         kv_heads, head_dim, DTYPE_CODES[k.dtype], kv, rotate)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes [rows, cols] (cols a multiple of 32) in dequant_int4's layout: per group of 32 columns, byte j
    holds column j in its low nibble and column j + 16 in its high one."""
    rows, cols = q.shape
    g = q.to(torch.uint8).view(rows, cols // 32, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def dequant_int4(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The bf16 weight [rows, cols] of nibble codes (`pack_nibbles`) with torch's int4 scales and zeros (bf16
    [cols / 32, rows, 2]): bf16((q - 8) * scale + zero), computed in fp32 (core/cpu_kernels/dequant.c)."""
    rows, cols = codes.shape[0], codes.shape[1] * 2
    if scales_zeros.dtype != torch.bfloat16 or scales_zeros.shape != (cols // 32, rows, 2) or \
            not (codes.is_contiguous() and scales_zeros.is_contiguous()):
        raise ValueError("dequant_int4: codes [rows, cols / 2] uint8 and scales_zeros bf16 [cols / 32, rows, 2], "
                         "contiguous")
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    _run("dequant_int4", codes.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), rows, cols,
         torch.get_num_threads())
    return out


def _check_int8_codes(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> int:
    """The group size of int8 codes [outs, cols] with fp32 scales / offsets [outs, cols / group], all contiguous."""
    outs, cols = codes.shape
    if not (codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.dim() == 2
            and scales.shape[0] == outs and scales.shape[1] and cols % scales.shape[1] == 0
            and codes.is_contiguous() and scales.is_contiguous()
            and (offsets is None or (offsets.shape == scales.shape and offsets.dtype == torch.float32
                                     and offsets.is_contiguous()))):
        raise ValueError("int8 codes: codes int8 [outs, cols], scales / offsets fp32 [outs, cols / group], contiguous")
    return cols // scales.shape[1]


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                offsets: torch.Tensor | None) -> torch.Tensor:
    """x [..., cols] @ W.T with W = codes * scale + offset per group (core/cpu_kernels/dequant.c), fp32 math, in x's
    dtype (fp32 / bf16 / fp16)."""
    group = _check_int8_codes(codes, scales, offsets)
    outs, cols = codes.shape
    rows = x.reshape(-1, cols) if x.dtype in DTYPE_CODES else x.reshape(-1, cols).float()
    if rows.stride(-1) != 1:  # the kernel takes any row stride, not strided rows
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], outs, dtype=rows.dtype)
    if rows.shape[0]:
        _run("int8_linear", rows.data_ptr(), rows.stride(0), out.data_ptr(), codes.data_ptr(), scales.data_ptr(),
             None if offsets is None else offsets.data_ptr(), rows.shape[0], outs, cols, group,
             DTYPE_CODES[rows.dtype], torch.get_num_threads())
    return out.view(*x.shape[:-1], outs).to(x.dtype)


def dequant_int8(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """The bf16 weight [outs, cols] of int8 codes with fp32 scales / offsets per group (int8_linear's W)."""
    group = _check_int8_codes(codes, scales, offsets)
    out = torch.empty(codes.shape, dtype=torch.bfloat16)
    _run("dequant_int8", codes.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
         out.data_ptr(), codes.shape[0], codes.shape[1], group, torch.get_num_threads())
    return out


# ---- GGUF blocks read in place (core/cpu_kernels/gguf_blocks.c) ----
GGUF_SUPER = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
              14: (256, 210)}  # ggml type number -> (weights per block, bytes per block)
GGUF_FLOATS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # the float types, read in place too


def gguf_layout(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type a kernel reads (a float type: one weight a block)."""
    if qtype in GGUF_FLOATS:
        return 1, GGUF_FLOATS[qtype].itemsize
    if qtype not in GGUF_SUPER:
        raise ValueError(f"GGUF type number {qtype} has no block kernel")
    return GGUF_SUPER[qtype]


class GgufSegments:
    """The weights of one GGUF-block matmul, side by side in its output (a fused q / k / v or gate / up may mix
    types): per weight its ggml type number and its blocks, uint8 [out_features, row bytes] (any row stride: a
    memory-mapped file's tensor, or a slice of one), as ctypes arrays built once. `columns`: where each of those
    output columns goes in the result (a permutation; Llama's Q / K rows, which GGUF files store permuted, are put
    back in order as the kernel stores them); None: in order."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int,
                 columns: torch.Tensor | None = None) -> None:
        if len({qtype in GGUF_FLOATS for qtype, _ in parts}) > 1:
            raise ValueError("GGUF weights of float and block types cannot share one matmul")
        for qtype, blocks in parts:
            block, size = gguf_layout(qtype)
            if in_features % block or blocks.dtype != torch.uint8 or blocks.dim() != 2 or \
                    blocks.shape[1] != in_features // block * size or blocks.stride(1) != 1:
                raise ValueError(f"GGUF blocks of type {qtype}: uint8 [rows, {in_features // max(block, 1) * size}] "
                                 f"with unit column stride expected for {in_features} input features, got "
                                 f"{blocks.dtype} {tuple(blocks.shape)}")
        self.parts = parts  # keeps the tensors (and the mapping under them) alive
        self.floats = parts[0][0] in GGUF_FLOATS
        self.in_features = in_features
        self.out_features = sum(b.shape[0] for _, b in parts)
        n = len(parts)
        self.types = (_I32 * n)(*(q for q, _ in parts))
        self.pointers = (ctypes.c_void_p * n)(*(b.data_ptr() for _, b in parts))
        self.row_bytes = (_I64 * n)(*(b.stride(0) for _, b in parts))
        self.outs = (_I64 * n)(*(b.shape[0] for _, b in parts))
        self.columns = None
        if columns is not None:
            if sorted(columns.tolist()) != list(range(self.out_features)):
                raise ValueError(f"GGUF output columns: a permutation of {self.out_features} expected")
            self.columns = (_I64 * self.out_features)(*columns.tolist())


GGUF_ACTIVATIONS = {"fp32": 0, "int16": 16, "int8": 8}  # gguf_linear's `activations`: x's bits when quantized
# gguf_linear's `simd`: the widest code built for this CPU, the plain C loops, or AVX2 even where AVX-512 is built
# (gguf_blocks.c's SIMD_WIDEST / SIMD_NONE / SIMD_AVX2; the tests compare them)
GGUF_SIMD = {"widest": 0, "none": 1, "avx2": 2}
GGUF_SIMD_FEATURES = ("avx2", "avx512_pairs", "avx512_bf16_tile")  # gguf_simd_features' names, by bit


def gguf_simd_features() -> tuple[str, ...]:
    """The SIMD code gguf_linear runs on this CPU by default (gguf_blocks.c: AVX2; AVX-512 BW / DQ / VL / VNNI: the
    decode step's int16 / int8 dot products two sub-blocks at a time; AVX512_BF16: many rows of bf16 x in bf16
    products)."""
    bits = _library().kvf_gguf_simd_built()
    return tuple(name for i, name in enumerate(GGUF_SIMD_FEATURES) if bits >> i & 1)


def gguf_linear(x: torch.Tensor, weights: GgufSegments, simd: str = "widest",
                activations: str = "fp32", batch_invariant: bool = True) -> torch.Tensor:
    """x [..., in_features] @ W.T for the GGUF-block weights, in x's dtype (fp32 / bf16 / fp16), fp32 math.
    `activations`: "fp32": x as given meets W formed exactly as GGUF dequantizes it (fp32 rounding only); "int16" /
    "int8": x quantized per 32 values to that width (int8 as ggml does), integer dot products (the error bound is in
    gguf_blocks.c). `simd`: a key of GGUF_SIMD (every one gives the same bits but the plain C loops, whose fp32
    sums may run in another order with quantized x). `batch_invariant` (fp32): a row's
    result the same bits whatever rows run with it; False lets many rows take the faster outer-product tile, whose
    sums run over k in another order (gguf_blocks.c's outer_linear)."""
    cols = weights.in_features
    # a decode step's x is already [rows, cols] with unit stride: its reshape and the output's view back cost more
    # than a small matmul's kernel (a 16 x 256 one: 23 us a call with them, 10 without)
    plain = x.dim() == 2 and x.dtype in DTYPE_CODES and x.stride(-1) == 1
    rows = x if plain else x.reshape(-1, cols) if x.dtype in DTYPE_CODES else x.reshape(-1, cols).float()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weights.out_features, dtype=rows.dtype)
    bits = GGUF_ACTIVATIONS[activations]
    if rows.shape[0]:
        args = (rows.data_ptr(), rows.stride(0), rows.shape[0], cols, DTYPE_CODES[rows.dtype], len(weights.parts),
                weights.types, weights.pointers, weights.row_bytes, weights.outs, weights.columns, out.data_ptr(),
                torch.get_num_threads(), GGUF_SIMD[simd])
        if bits and not weights.floats:  # float weights: always fp32 math on x as given
            _run("gguf_linear", *args, bits)
        else:
            _run("gguf_linear_exact", *args, batch_invariant)
    return out if plain else out.view(*x.shape[:-1], weights.out_features).to(x.dtype)


class GgufExperts:
    """A mixture-of-experts layer's experts for one projection (each a GgufSegments of the same shape: gate / up side
    by side, or down), for `gguf_experts_linear`: their types, pointers and row strides in one array, expert by
    expert, built once."""

    def __init__(self, experts: list[GgufSegments]) -> None:
        first = experts[0]
        if any(e.in_features != first.in_features or list(e.outs) != list(first.outs) or e.floats or
               e.columns is not None for e in experts):
            raise ValueError("stacked GGUF experts: block weights of one shape each, in their own column order")
        self.experts = experts  # keeps their tensors alive
        self.in_features, self.out_features = first.in_features, first.out_features
        self.segments = len(first.parts)
        self.types = (_I32 * (len(experts) * self.segments))(*(t for e in experts for t in e.types))
        self.pointers = (ctypes.c_void_p * (len(experts) * self.segments))(*(p for e in experts for p in e.pointers))
        self.row_bytes = (_I64 * (len(experts) * self.segments))(*(b for e in experts for b in e.row_bytes))
        self.outs = first.outs


def gguf_experts_linear(x: torch.Tensor, starts: torch.Tensor, weights: GgufExperts, rows: torch.Tensor | None = None,
                        activations: str = "int16", simd: str = "widest") -> torch.Tensor:
    """Each expert's rows of x through that expert's weights in one call: expert e takes rows [starts[e], starts[e + 1])
    of x[rows] (x itself when `rows` is None), out [len(rows), out_features] in x's dtype (fp32 / bf16 / fp16). x
    quantized per 32 values as gguf_linear's `activations` "int16" / "int8"; each expert's outputs the bits gguf_linear
    gives for its rows alone. `starts`: int64 [experts + 1], ascending from 0."""
    if x.dim() != 2 or x.dtype not in DTYPE_CODES or x.stride(-1) != 1 or x.shape[1] != weights.in_features:
        raise ValueError(f"x: [rows, {weights.in_features}] fp32 / bf16 / fp16 with unit column stride expected")
    if activations not in ("int16", "int8"):
        raise ValueError(f"activations: int16 or int8 expected, got {activations!r}")
    count = x.shape[0] if rows is None else rows.shape[0]
    if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 1 or rows.stride(0) != 1):
        raise ValueError("rows: contiguous int64 ids of x's rows expected")
    experts = len(weights.experts)
    if starts.dtype != torch.int64 or starts.shape != (experts + 1,) or not starts.is_contiguous():
        raise ValueError(f"starts: contiguous int64 [{experts + 1}] expected")
    out = torch.empty(count, weights.out_features, dtype=x.dtype)
    # their values are checked by the kernel before it reads anything
    refused = _run("gguf_experts_linear", x.data_ptr(), x.stride(0), x.shape[0],
                   None if rows is None else rows.data_ptr(), count, weights.in_features, DTYPE_CODES[x.dtype],
                   experts, starts.data_ptr(), weights.segments, weights.types, weights.pointers, weights.row_bytes,
                   weights.outs, out.data_ptr(), torch.get_num_threads(), GGUF_SIMD[simd],
                   GGUF_ACTIVATIONS[activations])
    if refused:
        raise ValueError(f"starts: ascending from 0 to the {count} rows expected" if refused == 1 else
                         f"rows: ids of x's {x.shape[0]} rows expected")
    return out


def gguf_dequant(qtype: int, blocks: torch.Tensor, in_features: int, ids: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (all when None) of a GGUF-block weight (uint8 [rows, row bytes], unit column stride) dequantized
    into `dtype`: in fp32 bit for bit the `gguf` package's values (a float type's rows: its values converted)."""
    GgufSegments([(qtype, blocks)], in_features)  # checks the layout
    if qtype in GGUF_FLOATS:
        values = blocks.view(GGUF_FLOATS[qtype])
        return (values if ids is None else values[ids.reshape(-1).long()]).to(dtype)
    if ids is not None:
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= blocks.shape[0]):
            raise IndexError(f"row ids outside [0, {blocks.shape[0]})")
    count = blocks.shape[0] if ids is None else ids.numel()
    out = torch.empty(count, in_features, dtype=dtype)
    if count:
        _run("gguf_dequant", qtype, blocks.data_ptr(), blocks.stride(0), None if ids is None else ids.data_ptr(),
             count, in_features, out.data_ptr(), DTYPE_CODES[dtype], torch.get_num_threads())
    return out
