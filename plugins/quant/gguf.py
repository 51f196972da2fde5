"""The `gguf` plugin: a GGUF file's projections served from its own quantized blocks.

Chosen automatically for a GGUF source. The loader reads the file in place (core/gguf_source.py): each projection
arrives as its blocks, a view of the memory-mapped file, loaded into the layer's `qblocks` parameter without a copy
(q / k / v and gate / up each keep their own tensor, of their own type: a fused layer is a list of them). After
loading, each layer goes to the fastest path of its device:

- `blocks` (CPU, any model dtype: fp32, bf16, fp16): the blocks read in place by the C kernels of
  core/cpu_kernels/gguf_blocks.c (every type of gguf_blocks.DECODERS). Activations (`activations`): fp32, x as given
  meets W exactly as GGUF dequantizes it; int16 or int8, x quantized per 32 values, integer dot products, fp32 scales
  (int8: ggml's method), within the bound stated there of x @ dequantize(W); auto (the default): int16 up to the
  row count where it is faster on this CPU (a decode step: 2.2x fp32's speed at one row on Zen 2, an error 256
  times under int8's), fp32 beyond (prefill, wide batches: fp32's panel path is faster there). The process holds
  the file's pages and nothing else per weight. Llama's Q / K rows, which GGUF files store permuted, are put back
  in order as the kernel stores its outputs (each column where HF's order has it) instead of in the weight;
- `int4pack` (CPU, bf16 compute): the 4-bit types (Q4_0, Q4_1, Q4_K) through torch's weight-only int4 matmul
  (cpu_kernels.py), groups of 32, scale and zero rounded to bf16; from the row count where it loses (timed once per
  shape, `block_paths.wide_rows`) a call expands the weight to bf16 (core/cpu_kernels/dequant.c) and runs oneDNN's
  bf16 GEMM;
- `int8` (CPU, bf16 compute): the other types as int8 codes with fp32 scales (and offsets) per group of 16 or 32,
  through a C matmul reading the codes (core/cpu_kernels/dequant.c), expanded for wide batches likewise;
- `triton` (CUDA; on CPU under TRITON_INTERPRET=1 when named): every type through the Triton dequantize-GEMM
  (plugins/quant/triton_gemm.py) from its codes packed in 4 or 8 bits, an integer zero and the fp32 scales and
  offsets: W = scale * (q - zero) + offset, GGUF's values, dequantized tile by tile;
- `dense`: the weight dequantized once into the model dtype (exact in fp32: bit for bit what transformers'
  GGUF loader gives), then whatever the dense method runs.
The last four decode the blocks into codes, scales and offsets at load (plugins/quant/gguf_blocks.py: a copy in
their own layout). `auto` picks blocks on CPU where the C kernels build, triton on CUDA where triton is
installed, dense elsewhere.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from gguf import GGMLQuantizationType

from kvforge.plugins.quant.block_paths import (
    blocks_activations,
    blocks_linear,
    expanded_linear,
    int8_layer_linear,
    int16_rows,
    wide_rows,
)
from kvforge.plugins.quant.cpu_kernels import int4_linear, int4pack_available, pack_int4_affine
from kvforge.plugins.quant.dense import DenseMethod
from kvforge.plugins.quant.gguf_blocks import SUPPORTED, affine_weight

KERNELS = ("auto", "blocks", "int4pack", "int8", "triton", "dense")
DECODED_GROUP = 16  # the group the decoding paths store scales at (the finest type's: a fused layer's parts share it)
# the int8 path's group (scales kept at 32 where the type's groups are) and whether the type has offsets
INT8_GROUPS = {GGMLQuantizationType.Q5_0: (32, False), GGMLQuantizationType.Q5_1: (32, True),
               GGMLQuantizationType.Q8_0: (32, False), GGMLQuantizationType.Q5_K: (32, True),
               GGMLQuantizationType.Q6_K: (16, False)}
ACTIVATIONS = ("auto", "fp32", "int16", "int8")


def held_bytes_per_weight(qtype: int, dtype: torch.dtype) -> tuple[float, str] | None:
    """What `auto` holds per weight of a tensor of ggml type `qtype` after loading on CPU, and the path, for estimates
    before loading: a block type's own bytes where the blocks kernel runs (the file's pages, read in place); None:
    dense in the dtype."""
    from kvforge.core.cpu_kernels import GGUF_FLOATS, GGUF_SUPER, gguf_layout, unavailable

    if (qtype not in GGUF_SUPER and qtype not in GGUF_FLOATS) or unavailable() is not None:
        return None
    block, size = gguf_layout(qtype)
    return size / block, "blocks"


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


class GgufMethod(DenseMethod):
    name = "gguf"
    supported_types = SUPPORTED  # the ggml types read natively, named by the core's GGUF reader (core/gguf_source.py)
    description = ("GGUF files' own quantized weights (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K), read in place "
                   "from the memory-mapped file by C kernels on CPU in any dtype; torch's int4 kernel or an int8-code "
                   "kernel in bf16, Triton on CUDA, or dequantized once.")
    settings = {
        "activations": {"type": "string", "enum": list(ACTIVATIONS), "default": "auto",
                        "description": "the blocks kernel's activations: fp32 (x as given meets the exactly "
                                       "dequantized weight), int16 or int8 (x quantized per 32 values, integer dot "
                                       "products; int8 as ggml), or auto: int16 up to the row count where it is "
                                       "faster on this CPU (decode steps), fp32 beyond (timed once per CPU)"},
        "kernel": {"type": "string", "enum": list(KERNELS), "default": "auto",
                   "description": "blocks (CPU: the file's blocks read in place), int4pack (CPU, 4-bit types, bf16), "
                                  "int8 (CPU, bf16), triton (CUDA), dense (dequantized once) or auto"},
    }

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        return {} if quantization_config.get("quant_method") == "gguf" else None

    @classmethod
    def exact_fp32(cls, options: dict[str, Any]) -> bool:
        return options["kernel"] == "dense"  # the blocks' sums (and int16 x) are not torch's matmul

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype) -> None:
        # filled by _load_blocks with views of the file, one per projection (shard), never copied
        param = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        param.weight_loader = functools.partial(self._load_blocks, layer)
        layer.register_parameter("qblocks", param)
        layer.gguf_parts = {}  # shard index -> (ggml type number, uint8 blocks [rows, row bytes], row order or None)
        layer.params_dtype = params_dtype
        layer.weight = None
        layer.segments = None  # the blocks path's GgufSegments
        layer.int16_rows = 0  # `activations: auto`: x with up to this many rows is quantized to int16
        layer.packed_weight = None
        layer.int4 = None
        layer.int8 = None  # (codes, scales, offsets or None) on the int8 path
        layer.triton = None  # triton_gemm.dequant_gemm's arguments on the triton path
        layer.nibbles = None  # the codes for the expand-then-GEMM path (`wide_rows`), when it is faster somewhere
        layer.wide_rows = None
        layer.weight_bytes = 0

    @staticmethod
    def _load_blocks(layer, param, loaded: torch.Tensor, shard_id=None) -> None:
        """One projection's blocks (core/gguf_source.py's view): this layer's rows of it (its shard, its
        tensor-parallel rank's slice), as a view."""
        from kvforge.core.cpu_kernels import gguf_layout

        qtype, order = loaded.gguf_type, loaded.gguf_rows
        sizes = getattr(layer, "output_sizes", [layer.out_features])
        if shard_id is None and len(sizes) > 1:  # a file that fused the projections already (Phi-3's qkv)
            start = 0
            for sid, size in zip(layer.shard_ids, sizes):
                part = loaded[start: start + size]
                part.gguf_type, part.gguf_in_features = qtype, loaded.gguf_in_features
                part.gguf_rows = None if order is None else order[start: start + size] - start
                GgufMethod._load_blocks(layer, param, part, sid)
                start += size
            return
        if getattr(layer, "full_in_features", layer.in_features) != layer.in_features:  # a row-parallel rank's inputs
            block, size = gguf_layout(qtype)
            first = layer.input_first
            if first % block or layer.in_features % block:
                raise ValueError(f"gguf: {layer.prefix}: this rank's inputs [{first}, {first + layer.in_features}) do "
                                 f"not start and end on blocks of {block}")
            loaded = loaded[:, first // block * size: (first + layer.in_features) // block * size]
        index = 0 if shard_id is None else layer._shard_index(shard_id)
        start = layer._source_start(index) if hasattr(layer, "_source_start") else 0
        count = layer.out_features_per_shard[index]
        if start + count > loaded.shape[0]:
            raise ValueError(f"gguf: {layer.prefix}: {loaded.shape[0]} rows in the file, {start + count} expected")
        rows = loaded[start: start + count]
        if order is not None:
            order = order[start: start + count] - start
            if order.min() < 0 or order.max() >= count:
                raise ValueError(f"gguf: {layer.prefix}: a tensor-parallel slice splits the file's permuted heads")
        layer.gguf_parts[index] = (qtype, rows, order)

    def process_after_loading(self, layer) -> None:
        from kvforge.core.cpu_kernels import GGUF_FLOATS

        parts = [layer.gguf_parts[i] for i in range(len(layer.out_features_per_shard))]
        device = layer.qblocks.device  # where the model was built
        del layer.qblocks
        layer.gguf_parts = None
        if self._use_blocks(layer, parts, device):
            return
        if any(qtype in GGUF_FLOATS for qtype, _, _ in parts):  # float weights: nothing to decode, served dense
            weight = torch.cat([rows.view(GGUF_FLOATS[qtype]).float()[order if order is not None else slice(None)]
                                for qtype, rows, order in parts])
            layer.weight = torch.nn.Parameter(weight.to(device, layer.params_dtype), requires_grad=False)
            layer.weight_bytes = layer.weight.numel() * layer.weight.element_size()
            return
        codes, scales, offsets = (t.to(device) for t in decoded_parts(parts, layer.in_features))
        if self._use_triton(layer, codes, scales, offsets) or self._use_int4pack(layer, codes, scales, offsets) or \
                self._use_int8(layer, codes, scales, offsets):
            return
        weight = affine_weight(codes, scales, offsets, DECODED_GROUP)
        layer.weight = torch.nn.Parameter(weight.to(layer.params_dtype), requires_grad=False)
        layer.weight_bytes = layer.weight.numel() * layer.weight.element_size()

    def _use_blocks(self, layer, parts: list, device: torch.device) -> bool:
        from kvforge.core.cpu_kernels import GgufSegments, unavailable

        wanted = self.options["kernel"]
        if wanted not in ("auto", "blocks"):
            return False
        why = unavailable()
        if device.type != "cpu":
            why = "it runs on CPU"
        if why is not None:
            if wanted == "blocks":
                raise ValueError(f"gguf: {layer.prefix or 'a layer'} cannot use the blocks kernel: {why}")
            return False
        columns = None
        if any(order is not None for _, _, order in parts):  # the kernel stores each column where HF's order has it
            starts = [0, *itertools.accumulate(rows.shape[0] for _, rows, _ in parts)]
            columns = torch.argsort(torch.cat([(torch.arange(rows.shape[0]) if order is None else order) + start
                                               for (_, rows, order), start in zip(parts, starts)]))
        layer.segments = GgufSegments([(qtype, rows) for qtype, rows, _ in parts], layer.in_features, columns)
        layer.weight_bytes = sum(rows.numel() for _, rows, _ in parts)  # the file's pages this layer reads
        if self.options["activations"] == "auto":
            layer.int16_rows = int16_rows(torch.get_num_threads(), layer.params_dtype)
        return True

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
        """The layer's weight rows by index, dequantized in fp32 (exactly GGUF's values) from its blocks or its int8
        codes: a tied embedding served from the head's; None where the layer keeps neither."""
        if layer.segments is not None and layer.segments.columns is None and len(layer.segments.parts) == 1:
            from kvforge.core.cpu_kernels import gguf_dequant

            qtype, blocks = layer.segments.parts[0]
            return lambda ids: gguf_dequant(qtype, blocks, layer.in_features, ids)
        if layer.int8 is None:
            return None
        codes, scales, offsets = layer.int8
        group = codes.shape[1] // scales.shape[1]
        return lambda ids: affine_weight(codes[ids], scales[ids], None if offsets is None else offsets[ids], group)

    def stack_experts(self, gate_up: list, down: list) -> StackedExperts | None:
        """A MoE layer's experts (their gate / up and down layers) computed together for a step: None unless every
        one is on the blocks path with block types (float weights take x as given: one call each) and no bias."""
        from kvforge.core.cpu_kernels import GgufExperts

        layers = [*gate_up, *down]
        if any(layer.segments is None or layer.segments.floats or layer.segments.columns is not None or
               layer.bias is not None for layer in layers):
            return None
        return StackedExperts(GgufExperts([layer.segments for layer in gate_up]),
                              GgufExperts([layer.segments for layer in down]), gate_up[0].int16_rows,
                              self.options["activations"])

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.segments is not None:
            return blocks_linear(x, layer.segments, layer.int16_rows, self.options["activations"], bias)
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


class StackedExperts:
    """A MoE layer's experts on the blocks path, each projection's experts in one kernel call: a decode step's routed
    experts are two calls (gate / up, down) instead of two per expert, x quantized once per call and one team of
    threads over all their weights. Each expert's outputs are the bits its own layer gives for its rows (the kernel's
    promise), so the block's result does not change. Steps whose rows per expert take x as given (`auto` past
    `int16_rows` rows, or `fp32`: prefill) keep one call per expert: those calls are long and the shared call would
    save nothing."""

    def __init__(self, gate_up, down, int16_rows: int, activations: str) -> None:
        self.gate_up, self.down, self.int16_rows, self.activations = gate_up, down, int16_rows, activations

    def takes(self, widest: int) -> str | None:
        """The activations a step whose busiest expert has `widest` rows runs with together, or None (one call each)."""
        activations = blocks_activations(widest, self.int16_rows, self.activations)
        return None if activations == "fp32" else activations

    def __call__(self, x: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, act, activations: str
                 ) -> torch.Tensor:
        """Rows `rows` of x through expert e's MLP for e's rows [starts[e], starts[e + 1]): act(gate / up) then down."""
        from kvforge.core.cpu_kernels import gguf_experts_linear

        hidden = act(gguf_experts_linear(x, starts, self.gate_up, rows, activations))
        return gguf_experts_linear(hidden, starts, self.down, None, activations)


def decoded_parts(parts: list, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's projections (ggml type, blocks, row order) decoded into one set of int8 codes [N, K] and fp32 scales
    and offsets [N, K / DECODED_GROUP], in HF row order (gguf_blocks.decode: lossless): the layout of the paths that do
    not read blocks."""
    from gguf import GGMLQuantizationType

    from kvforge.plugins.quant.gguf_blocks import decode

    decoded = []
    for qtype, rows, order in parts:
        stored = decode(rows.contiguous().numpy(), GGMLQuantizationType(qtype)).stored(DECODED_GROUP)
        decoded.append([t if order is None else t[order] for t in stored])
    if any(t[0].shape[1] != in_features for t in decoded):
        raise ValueError(f"gguf: blocks of {decoded[0][0].shape[1]} features for a layer of {in_features}")
    return tuple(torch.cat(ts) for ts in zip(*decoded))
