"""The `gguf` plugin: a GGUF file's projections served from its own quantized blocks.

Chosen automatically for a GGUF source (core/gguf_checkpoint.py writes the checkpoint it loads: per layer
int8 codes, fp32 scales and offsets per group of 16 input features, W = scale * code + offset, exactly
GGUF's dequantized values). After loading, each layer goes to the fastest exact path on its device:

- `int4pack` (CPU, bf16 compute): the 4-bit types (Q4_0, Q4_1, Q4_K) through torch's weight-only int4
  matmul (cpu_kernels.py), groups of 32, scale and zero rounded to bf16 -- the kernel's own rounding. That
  kernel is the fastest for a few rows but recomputes the weight for every few rows, so from the row count
  where it loses (timed once per shape on this machine, `wide_rows`) a call expands the weight to bf16 with a
  C kernel (core/cpu_kernels/dequant.c, from a second copy of the codes: +0.5 byte per weight) and runs
  oneDNN's bf16 GEMM; where that never wins, or the C kernels cannot build, the copy is not kept;
- `int8` (CPU, bf16 compute, where the C kernels build): the other types (Q5_0, Q5_1, Q8_0, Q5_K, Q6_K) as their
  int8 codes with fp32 scales (and offsets where the type has them) per group of 16 or 32: a C matmul reading the
  codes (1.1-1.3 bytes per weight instead of bf16's 2: a decode step is bound by reading weights) with fp32 math
  (core/cpu_kernels/dequant.c); from the row count where it loses (timed per shape, `wide_rows`) a call expands the
  weight to bf16 and runs the bf16 GEMM. A GGUF's LM head is one of these layers (the tied embedding's codes);
- `triton` (CUDA; on CPU under TRITON_INTERPRET=1 when named): every type through the Triton dequantize-GEMM
  (plugins/quant/triton_gemm.py) from its codes packed in 4 or 8 bits, an integer zero and the fp32 scales and
  offsets: W = scale * (q - zero) + offset, GGUF's values, dequantized tile by tile;
- `dense`: the weight dequantized once into the model dtype (exact in fp32: bit for bit what transformers'
  GGUF loader gives; fp32 models on CPU take it), then whatever the dense method runs (F.linear or oneDNN's
  prepacked linear, chosen by timing).
`auto` picks int4pack where the layer's codes are 4-bit and int8 for the others where the model computes in bf16
on CPU, triton on CUDA where triton is installed, dense elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from kvforge.plugins.quant.cpu_kernels import COMPUTE_DTYPE, int4_linear, int4pack_available, pack_int4_affine
from kvforge.plugins.quant.dense import DenseMethod
from kvforge.plugins.quant.gguf_blocks import FOUR_BIT, affine_weight

KERNELS = ("auto", "int4pack", "int8", "triton", "dense")
# the int8 path's group (scales kept at 32 where the type's groups are) and whether the type has offsets
INT8_GROUPS = {GGMLQuantizationType.Q5_0: (32, False), GGMLQuantizationType.Q5_1: (32, True),
               GGMLQuantizationType.Q8_0: (32, False), GGMLQuantizationType.Q5_K: (32, True),
               GGMLQuantizationType.Q6_K: (16, False)}
WIDE_ROWS = (4, 8, 16, 32, 64, 128)  # row counts at which the expand-then-GEMM path is timed against the kernels
TIMED_OUTPUTS = 16384


def int4_bytes_per_weight() -> float:
    """What a 4-bit layer holds per weight after loading (for estimates): torch's int4 layout (a nibble, a bf16 scale
    and zero per 32 weights) and, where the C kernels build, the codes again for the wide path (typically kept:
    it wins at prefill-sized batches)."""
    from kvforge.core.cpu_kernels import unavailable

    return 0.5 + 4 / 32 + (0.5 if unavailable() is None else 0.0)


def int8_bytes_per_weight(group: int, offsets: bool) -> float | None:
    """What a layer on the int8 path holds per weight (for estimates): its codes, an fp32 scale (and offset) per
    group; None where the C kernels cannot build (the layer is then dense)."""
    from kvforge.core.cpu_kernels import unavailable

    return None if unavailable() is not None else 1 + (8 if offsets else 4) / group


def held_bytes_per_weight(qtype: GGMLQuantizationType, dtype: torch.dtype) -> tuple[float, str] | None:
    """What `auto` holds per weight of a projection of `qtype` after loading on CPU in `dtype`, and the path
    ("int4pack" / "int8"), for estimates before loading; None: dense in the dtype."""
    if dtype != COMPUTE_DTYPE:
        return None
    if qtype in FOUR_BIT and int4pack_available():
        return int4_bytes_per_weight(), "int4pack"
    held = int8_bytes_per_weight(*INT8_GROUPS[qtype]) if qtype in INT8_GROUPS else None
    return None if held is None else (held, "int8")


def expanded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) in bf16, with W just expanded from its codes (core/cpu_kernels: dequant_int4 / dequant_int8)."""
    return F.linear(x.to(COMPUTE_DTYPE), weight, None if bias is None else bias.to(COMPUTE_DTYPE)).to(x.dtype)


def groups_of_32(scales: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Scales and offsets stored per 16 features, at groups of 32 where every pair of 16-groups agrees (the type's
    own groups are 32: all but Q6_K); None where they do not."""
    if scales.shape[1] % 2 or not (torch.equal(scales[:, ::2], scales[:, 1::2])
                                   and torch.equal(offsets[:, ::2], offsets[:, 1::2])):
        return None
    return scales[:, ::2].contiguous(), offsets[:, ::2].contiguous()


def code_bits(codes: torch.Tensor) -> int:
    """4 where the codes fit in 4 bits (0..15, or -8..7 as Q4_0's q - 8), else 8."""
    lo, hi = int(codes.min()), int(codes.max())
    return 4 if (0 <= lo and hi <= 15) or (-8 <= lo and hi <= 7) else 8


def triton_layout(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> dict:
    """The dequantize-GEMM's arguments for codes [N, K] (int8) with fp32 scales / offsets [N, K / group]: the codes
    as unsigned 4-bit (where they fit) or 8-bit words with one integer zero (q - zero = the code, exactly), scales
    and offsets transposed to [groups, N] (groups of 32 where the type's are), offsets dropped when all zero."""
    from kvforge.plugins.quant.packing import pack_cols, pack_rows

    bits = code_bits(codes)
    zero = 0 if bits == 4 and int(codes.min()) >= 0 else 1 << (bits - 1)
    n, k = codes.shape
    scales, offsets = groups_of_32(scales, offsets) or (scales, offsets)
    group = k // scales.shape[1]
    per = 32 // bits
    columns = -(-n // per) * per  # the zeros are packed along N in whole words
    zeros = torch.full((scales.shape[1], columns), zero, dtype=torch.int32)
    return {"qweight": pack_rows((codes.to(torch.int32) + zero).T.contiguous(), bits).to(codes.device),
            "scales": scales.T.contiguous(), "qzeros": pack_cols(zeros, bits).to(codes.device),
            "g_idx": (torch.arange(k, device=codes.device) // group).to(torch.int32), "bits": bits,
            "offsets": offsets.T.contiguous() if offsets.any() else None}


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
    from kvforge.core.cpu import cpu_signature
    from kvforge.core.cpu_kernels import dequant_int4, dequant_int8, pack_nibbles, unavailable
    from kvforge.core.kernel_choice import ChoiceCache, default_cache_dir, time_calls

    if unavailable() is not None:
        return None
    out_features = min(out_features, TIMED_OUTPUTS)
    cache = ChoiceCache(default_cache_dir(), cpu_signature())
    key = f"gguf_wide_rows:{kind}:{out_features}x{in_features}:rows={','.join(map(str, WIDE_ROWS))}:t{threads}"
    known = cache.read().get(key)
    if known is not None:
        return known["choice"]
    inputs = {rows: torch.randn(rows, in_features, dtype=COMPUTE_DTYPE) for rows in WIDE_ROWS}
    if kind == "int4pack":
        q = torch.randint(0, 16, (out_features, in_features))
        scales = torch.rand(out_features, in_features // 32) / 64
        packed = pack_int4_affine(q, scales, -8 * scales, 32)
        if packed is None:
            return None
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
    if timing.steady:  # a busy machine's answer serves this process only
        cache.write({key: {"choice": threshold, "us": timing.us}})
    return threshold


class GgufMethod(DenseMethod):
    name = "gguf"
    description = ("GGUF files' own quantized weights (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K): 4-bit types "
                   "through torch's int4 kernel in bf16, the others through an int8-code kernel in bf16; "
                   "dequantized once into the model dtype in fp32 and on CUDA.")
    settings = {
        "group_size": {"type": "integer", "enum": [16], "default": 16,
                       "description": "input features per stored scale / offset (the checkpoint's layout)"},
        "kernel": {"type": "string", "enum": list(KERNELS), "default": "auto",
                   "description": "int4pack (CPU, 4-bit types, bf16 compute), int8 (CPU, any type, bf16 compute), "
                                  "triton (CUDA), dense (dequantized once) or auto"},
    }

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        if quantization_config.get("quant_method") != "gguf":
            return None
        return {"group_size": int(quantization_config.get("group_size", 16))}

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype) -> None:
        group = self.options["group_size"]
        if in_features % group:
            raise ValueError(f"gguf: {in_features} input features are not whole groups of {group}")
        n = sum(out_features_per_shard)
        for name, shape, dtype, axes in (
                ("qcodes", (n, in_features), torch.int8, {}),
                ("qscales", (n, in_features // group), torch.float32, {"packed_dim": 1, "pack_factor": group}),
                ("qoffsets", (n, in_features // group), torch.float32, {"packed_dim": 1, "pack_factor": group})):
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            for axis, value in axes.items():
                setattr(param, axis, value)
            param.weight_loader = layer.weight_loader
            layer.register_parameter(name, param)
        layer.params_dtype = params_dtype
        layer.weight = None
        layer.packed_weight = None
        layer.int4 = None
        layer.int8 = None  # (codes, scales, offsets or None) on the int8 path
        layer.triton = None  # triton_gemm.dequant_gemm's arguments on the triton path
        layer.nibbles = None  # the codes for the expand-then-GEMM path (`wide_rows`), when it is faster somewhere
        layer.wide_rows = None
        layer.weight_bytes = 0

    def process_after_loading(self, layer) -> None:
        codes, scales, offsets = layer.qcodes.data, layer.qscales.data, layer.qoffsets.data
        for name in ("qcodes", "qscales", "qoffsets"):
            delattr(layer, name)
        if self._use_triton(layer, codes, scales, offsets) or self._use_int4pack(layer, codes, scales, offsets) or \
                self._use_int8(layer, codes, scales, offsets):
            return
        weight = affine_weight(codes, scales, offsets, self.options["group_size"])
        layer.weight = torch.nn.Parameter(weight.to(layer.params_dtype), requires_grad=False)
        layer.weight_bytes = layer.weight.numel() * layer.weight.element_size()

    def _use_int4pack(self, layer, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> bool:
        wanted = self.options["kernel"]
        if wanted == "dense":
            return False
        paired = groups_of_32(scales, offsets)
        why = self._int4pack_refusal(layer, codes) or (None if paired else "its groups are smaller than 32")
        if why is None:
            s, o = paired
            if int(codes.min()) < 0:  # Q4_0's codes q - 8: the same W as codes q with offset -8 * scale
                codes, o = codes.to(torch.int32) + 8, o - 8 * s
            layer.int4 = pack_int4_affine(codes, s, o, 32)
            if layer.int4 is not None:
                layer.wide_rows = wide_rows("int4pack", codes.shape[0], codes.shape[1], torch.get_num_threads())
                if layer.wide_rows is not None:
                    from kvforge.core.cpu_kernels import pack_nibbles

                    layer.nibbles = pack_nibbles(codes)
                layer.weight_bytes = layer.int4.nbytes() + (0 if layer.nibbles is None else layer.nibbles.numel())
                return True
            why = "torch's int4 packing refused this shape"
        if wanted == "int4pack":
            raise ValueError(f"gguf: {layer.prefix or 'a layer'} cannot use the int4pack kernel: {why}")
        return False

    def _use_triton(self, layer, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> bool:
        from kvforge.plugins.quant.triton_gemm import triton_available

        wanted = self.options["kernel"]
        if wanted not in ("auto", "triton") or (wanted == "auto" and codes.device.type != "cuda"):
            return False
        if not triton_available():
            if wanted == "triton":
                raise ValueError(f"gguf: {layer.prefix or 'a layer'} cannot use the triton kernel: it needs triton "
                                 "and a CUDA device (or TRITON_INTERPRET=1)")
            return False
        layer.triton = triton_layout(codes, scales, offsets)
        layer.weight_bytes = sum(t.numel() * t.element_size() for t in layer.triton.values()
                                 if isinstance(t, torch.Tensor))
        return True

    def _use_int8(self, layer, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> bool:
        from kvforge.core.cpu_kernels import unavailable

        wanted = self.options["kernel"]
        if wanted == "dense":
            return False
        why = unavailable()
        if codes.device.type != "cpu":
            why = "it runs on CPU"
        elif layer.params_dtype != torch.bfloat16:
            why = "it computes in bf16, and the model runs in " + str(layer.params_dtype).removeprefix("torch.")
        if why is not None:
            if wanted == "int8":
                raise ValueError(f"gguf: {layer.prefix or 'a layer'} cannot use the int8 kernel: {why}")
            return False
        scales, offsets = groups_of_32(scales, offsets) or (scales, offsets)  # half the scales where they repeat
        layer.int8 = (codes, scales, None if not offsets.any() else offsets)  # symmetric types: no offsets
        layer.wide_rows = wide_rows("int8", codes.shape[0], codes.shape[1], torch.get_num_threads())
        layer.weight_bytes = sum(t.numel() * t.element_size() for t in layer.int8 if t is not None)
        return True

    @staticmethod
    def _int4pack_refusal(layer, codes) -> str | None:
        """Why int4pack cannot run this layer exactly, but for its groups (None: it can)."""
        if codes.device.type != "cpu" or not int4pack_available():
            return "it needs torch's CPU int4 kernel"
        if layer.params_dtype != torch.bfloat16:
            return "it computes in bf16, and the model runs in " + str(layer.params_dtype).removeprefix("torch.")
        if code_bits(codes) != 4:
            return "its codes are wider than 4 bits"
        return None

    @staticmethod
    def row_lookup(layer):
        """The layer's weight rows by index, dequantized from its int8 codes in fp32 (exactly GGUF's values): a tied
        embedding served from the head's codes; None where the layer keeps no int8 codes."""
        if layer.int8 is None:
            return None
        codes, scales, offsets = layer.int8
        group = codes.shape[1] // scales.shape[1]
        return lambda ids: affine_weight(codes[ids], scales[ids], None if offsets is None else offsets[ids], group)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.triton is not None:
            from kvforge.plugins.quant.triton_gemm import dequant_gemm

            out = dequant_gemm(x, **layer.triton)
            return out if bias is None else out + bias.to(out.dtype)
        wide = layer.wide_rows is not None and x.numel() >= layer.wide_rows * x.shape[-1]
        if layer.int4 is not None:
            if wide and layer.nibbles is not None:
                from kvforge.core.cpu_kernels import dequant_int4

                return expanded_linear(x, dequant_int4(layer.nibbles, layer.int4.scales_and_zeros), bias)
            return int4_linear(x, layer.int4, bias)
        if layer.int8 is not None:
            if wide:
                from kvforge.core.cpu_kernels import dequant_int8

                return expanded_linear(x, dequant_int8(*layer.int8), bias)
            return int8_layer_linear(x, layer.int8, bias)
        return super().apply(layer, x, bias)
