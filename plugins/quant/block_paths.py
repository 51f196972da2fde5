"""The CPU paths a quantized layer is multiplied by -- GGUF blocks read in place by the C kernels (blocks_linear, with
x as given or quantized to int16 / int8), int8 codes, or the weight expanded to bf16 for a wide batch -- and the row
counts from which each path wins on this CPU (int16_rows, wide_rows: timed once per shape and CPU signature, kept in
the kernel-choice cache). Used by the gguf method and by GPTQ / AWQ on the block kernels (group_quant.py)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from kvforge.plugins.quant.cpu_kernels import COMPUTE_DTYPE, int4_linear, pack_int4_affine

INT16_TIMED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # row counts at which `auto` times int16 x against fp32 x


WIDE_ROWS = (4, 8, 16, 32, 64, 128)  # row counts at which the expand-then-GEMM path is timed against the kernels


TIMED_OUTPUTS = 16384


def expanded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) in bf16, with W just expanded from its codes (core/cpu_kernels: dequant_int4 / dequant_int8)."""
    return F.linear(x.to(COMPUTE_DTYPE), weight, None if bias is None else bias.to(COMPUTE_DTYPE)).to(x.dtype)


def int8_layer_linear(x: torch.Tensor, int8: tuple, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) from int8 codes, scales and offsets (core/cpu_kernels.int8_linear), in x's dtype."""
    from kvforge.core.cpu_kernels import int8_linear

    out = int8_linear(x, *int8)
    return out if bias is None else out + bias.to(out.dtype)


@functools.cache
def wide_rows(kind: str, out_features: int, in_features: int, threads: int) -> int | None:
    """The fewest timed rows from which expanding a weight of this shape to bf16 and running the bf16 GEMM beats
    the `kind` kernel ("int4pack": torch's int4 matmul; "int8": the int8-code C kernel) at every larger timed
    count (random weights: the speed does not depend on their values); None: it never does, or the C kernels
    cannot run here. Timed on at most TIMED_OUTPUTS of the output features (both paths cost in proportion to them:
    a 262k-vocabulary head timed whole added 10 s to loading), once per shape and CPU signature: a steady timing is
    kept in the kernel-choice cache (core/kernel_choice.py), so later loads on this machine read it (Gemma 3 270M's
    six shapes took ~10 s of every load on a 2-core Zen 2)."""
    from kvforge.core.cpu_kernels import dequant_int4, dequant_int8, pack_nibbles, unavailable
    from kvforge.core.kernel_choice import cached_choice, time_calls

    if unavailable() is not None:
        return None
    out_features = min(out_features, TIMED_OUTPUTS)

    def measure():
        inputs = {rows: torch.randn(rows, in_features, dtype=COMPUTE_DTYPE) for rows in WIDE_ROWS}
        if kind == "int4pack":
            q = torch.randint(0, 16, (out_features, in_features))
            scales = torch.rand(out_features, in_features // 32) / 64
            packed = pack_int4_affine(q, scales, -8 * scales, 32)
            if packed is None:
                return None, None
            nibbles = pack_nibbles(q)
            kernel = {r: (lambda x=x: int4_linear(x, packed)) for r, x in inputs.items()}
            expand = {r: (lambda x=x: expanded_linear(x, dequant_int4(nibbles, packed.scales_and_zeros)))
                      for r, x in inputs.items()}
        else:
            int8 = (torch.randint(-32, 32, (out_features, in_features), dtype=torch.int8),
                    torch.rand(out_features, in_features // 32) / 64, None)
            kernel = {r: (lambda x=x: int8_layer_linear(x, int8)) for r, x in inputs.items()}
            expand = {r: (lambda x=x: expanded_linear(x, dequant_int8(*int8))) for r, x in inputs.items()}
        timing = time_calls({kind: kernel, "expand": expand}, min_total=0.002)
        threshold = None
        for rows in reversed(WIDE_ROWS):
            if timing.us["expand"][rows] >= timing.us[kind][rows]:
                break
            threshold = rows
        return threshold, timing

    return cached_choice(f"gguf_wide_rows:{kind}:{out_features}x{in_features}:rows={','.join(map(str, WIDE_ROWS))}"
                         f":t{threads}", measure)


@functools.cache
def int16_rows(threads: int, dtype: torch.dtype = torch.float32) -> int:
    """`activations: auto`: up to how many rows of x (0: none) the blocks kernel with x quantized to int16 beats the
    path `auto` takes otherwise (x as given in the model's dtype, without the fixed order) at every timed count, on
    this CPU. Timed on a random Q4_K weight (Q4_K_M files' main type) of 4096 x 2048 (the kernels' costs scale alike
    with the shape), once per CPU signature, thread count and dtype, a steady timing cached like `wide_rows`'. On a
    2-core Zen 2 (AVX2) int16 was 2.2x faster at 1 row (a decode step reads the weight once: decoding its codes to
    fp32 is what costs) and fp32's panel path won from 5 rows; on Zen 5 (AVX-512) int16 won at every count to 16."""
    from kvforge.core.cpu_kernels import GgufSegments, gguf_layout, gguf_linear, unavailable
    from kvforge.core.kernel_choice import cached_choice, time_calls

    if unavailable() is not None:
        return 0

    def measure():
        out_features, in_features = 4096, 2048
        block, size = gguf_layout(GGMLQuantizationType.Q4_K)
        generator = torch.Generator().manual_seed(0)
        blocks = torch.randint(0, 256, (out_features * in_features // block, size), dtype=torch.uint8,
                               generator=generator)
        blocks[:, 0:4] = torch.tensor([0.01, 0.001], dtype=torch.float16).view(torch.uint8)  # d, dmin: finite
        weights = GgufSegments([(int(GGMLQuantizationType.Q4_K), blocks.view(out_features, -1))], in_features)
        inputs = {rows: torch.randn(rows, in_features, dtype=dtype) for rows in INT16_TIMED_ROWS}
        timing = time_calls({acts: {r: (lambda x=x, a=acts: gguf_linear(x, weights, activations=a,
                                                                        batch_invariant=False))
                                    for r, x in inputs.items()} for acts in ("int16", "fp32")}, min_total=0.002)
        choice = 0
        for rows in INT16_TIMED_ROWS:
            if timing.us["int16"][rows] >= timing.us["fp32"][rows]:
                break
            choice = rows
        return choice, timing

    dtype_name = str(dtype).removeprefix("torch.")
    return cached_choice(f"gguf_int16_rows:rows={','.join(map(str, INT16_TIMED_ROWS))}:{dtype_name}:t{threads}",
                         measure)


def blocks_linear(x: torch.Tensor, segments, int16_rows: int, activations: str = "auto",
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for GGUF blocks (a GgufSegments) through the C kernels, with `activations` as the option of
    that name: `auto` quantizes x to int16 up to `int16_rows` rows (int16_rows()) and takes x as given beyond,
    without the fixed order (a decode step is int16 anyway); `fp32` keeps every row's result batch-invariant."""
    from kvforge.core.cpu_kernels import gguf_linear

    out = gguf_linear(x, segments, activations=blocks_activations(x.numel() // x.shape[-1], int16_rows, activations),
                      batch_invariant=activations == "fp32")
    return out if bias is None else out + bias.to(out.dtype)


def blocks_activations(rows: int, int16_rows: int, activations: str = "auto") -> str:
    """The blocks kernel's activations for a call of `rows` rows under the option `activations` (`auto`: int16 up to
    `int16_rows` rows, fp32 beyond)."""
    if activations == "auto":
        return "int16" if rows <= int16_rows else "fp32"
    return activations
