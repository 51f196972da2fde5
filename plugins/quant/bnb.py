"""bitsandbytes quantization: `bnb-int8` (LLM.int8() per-row absmax int8) and `bnb-nf4` (4-bit
blockwise NF4 / FP4), quantized at load with bitsandbytes' own functions.

A layer loads a dense [N, K] weight (q/k/v and gate/up already fused) and quantizes it in
`process_after_loading`; the dense copy is dropped. Pre-quantized checkpoints written by HF
transformers' `save_pretrained` for a `BitsAndBytesConfig` model are dequantized tensor by tensor in
`checkpoint_tensors` and re-quantized at load: re-quantizing a dequantized row (int8) or block (4-bit)
gives back the stored codes and absmax (see tests/plugins/test_bnb.py), so nothing is lost twice.

Kernels, chosen by timing the embedded model's 30 layers of linears (576->960 qkv, 576->576 o,
576->3072 gate_up, 1536->576 down) on a shared 2-core AVX512-BF16 CPU, one thread, ms per decode step
at batch 1 / batch 16, ranges over runs (dense fp32 through oneDNN: 9-11 / 19-26):
- int8: `torch._weight_int8pack_mm` on the bitsandbytes-quantized rows, bf16 3.1-3.3 / 21-22;
  bitsandbytes' own matmul (LLM.int8(), threshold 0, int8 activations) 9.2-16 / 17-34; dequantize to
  bf16 + F.linear 30-32 / 36-39. The weight-only kernel is used up to INT8PACK_MAX_ROWS rows (it does
  not block across rows: at 64 rows it takes 83-89 against 57-63 dequantized), dequantize + F.linear
  above. bitsandbytes' matmul is fast at large batches but quantizes the activations without outlier
  handling at threshold 0, so it runs only when `threshold` > 0 asks for LLM.int8() (and on CUDA).
  float16 / float32 compute dequantize + F.linear (torch's int8 kernel has no vector path for them).
- 4-bit: bitsandbytes' packed CPU layout (what its `Linear4bit` converts to on the first forward on
  AVX512-BF16 CPUs) through `matmul_4bit` -> its fused bf16 kernel 4.9-5.9 / 14-17; `matmul_4bit` on
  the standard layout (dequantize + linear) 21-23 / 28-31 (faster only from ~256 rows: 136 vs 168).
  Without that CPU feature, for other compute dtypes, or when N % 32 or K % blocksize: the weight is
  dequantized to the compute dtype for each call (F.linear); on CUDA `bitsandbytes.matmul_4bit`.
Whole embedded model, one thread, greedy decode: fp32 27 tok/s, bnb-int8 40, bnb-nf4 57.

bitsandbytes is imported on first use: plugin discovery stays cheap (the import takes seconds).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvforge.core.plugins import QuantMethod
from kvforge.plugins.quant.dense import create_dense_weight

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
COMPUTE_DTYPE_SETTING = {
    "type": "string", "enum": list(COMPUTE_DTYPES), "default": "bfloat16",
    "description": "Dtype the matmul runs in (the output is cast back to the model dtype). bfloat16 is the "
                   "fast path on CPU; float16 and float32 dequantize the weight on every call there.",
}
# Storage of the per-row scales of an int8 weight: the fp32 absmax (SCB) plus the compute-dtype copy
# the CPU kernel reads, 48 bits per row; 0.1 bit per weight covers it for rows of >= 480 inputs.
INT8_ROW_OVERHEAD_BITS = 0.1
# Batches up to this many rows use the weight-only int8 kernel; it does no blocking across rows, so
# longer prefill chunks are faster dequantized to bfloat16 through oneDNN's GEMM.
INT8PACK_MAX_ROWS = 32
INT8PACK_K_MULTIPLE = 16  # the kernel reads 16 inputs per step with aligned loads: K must be a multiple
NESTED_BLOCKSIZE = 256  # bitsandbytes' double quantization: absmax in 8-bit blocks of 256

_QUANT_STATE = "quant_state.bitsandbytes__"
_4BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


_bitsandbytes = None


def _bnb():
    """bitsandbytes, imported on first use. Its CPU backend logs a warning at import when the optional
    `kernels` package is missing; the built-in kernel it falls back to is the one used here."""
    global _bitsandbytes
    if _bitsandbytes is None:
        cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
        level = cpu_ops.level
        cpu_ops.setLevel(logging.ERROR)
        try:
            import bitsandbytes
            import bitsandbytes.functional
            import bitsandbytes.utils  # noqa: F401 - unpack_tensor_to_dict, for checkpoints
        finally:
            cpu_ops.setLevel(level)
        _bitsandbytes = bitsandbytes
    return _bitsandbytes


def _take_dense_weight(layer) -> torch.Tensor:
    weight = layer.weight.data
    del layer.weight  # the quantized copy replaces it
    layer.weight = None
    return weight


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, N] in the compute dtype -> x's leading shape and dtype, plus the bias (added in x's dtype)."""
    out = out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out.add_(bias.to(x.dtype))


def _empty(layer, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], layer.out_features)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# --- int8 ---------------------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 codes [N, K], fp32 row absmax SCB [N]) with W[n] ~= codes[n] * SCB[n] / 127.

    Quantized from float16 like bitsandbytes' `Int8Params` (and so transformers' BitsAndBytesConfig):
    a dense model quantized here has the codes and SCB a bitsandbytes model of it has."""
    bnb = _bnb()
    weight16 = weight.detach().to(torch.float16).contiguous()
    if not torch.isfinite(weight16).all():
        raise ValueError("bnb-int8: the weight has values that are not finite in float16 (|w| > 65504); "
                         "bitsandbytes quantizes int8 weights from float16")
    codes, scb, _ = bnb.functional.int8_vectorwise_quant(weight16)
    codes[scb == 0] = 0  # an all-zero row: 0 * (127 / 0) is NaN before the cast
    return codes.contiguous(), scb.float()


def _with_whole_row_absmax(shard: torch.Tensor) -> torch.Tensor:
    """A row-parallel shard [N, K / ranks] plus one column holding each row's absmax over all the ranks:
    quantized by bitsandbytes (then the column dropped), it gets the codes and scales the whole weight
    gets -- the int8 scale is per row, and a rank only sees its part of the row."""
    absmax = shard.detach().to(torch.float16).abs().amax(dim=1, keepdim=True).float()
    dist.all_reduce(absmax, op=dist.ReduceOp.MAX)  # every rank processes its layers in the same order
    return torch.cat([shard, absmax.to(shard.dtype)], dim=1)


def dequantize_int8(codes: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    return _bnb().functional.int8_vectorwise_dequant(codes, scb.float())


class _BnbMethod(QuantMethod):
    """What both bitsandbytes methods share: a dense weight loaded as is (a pre-quantized checkpoint is
    dequantized in the tensor stream), quantized in process_after_loading."""

    @classmethod
    def checkpoint_tensors(cls, tensors: Iterator[tuple[str, torch.Tensor]],
                           options: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        return dequantize_checkpoint(tensors, cls.name, options)

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype) -> None:
        create_dense_weight(layer, in_features, out_features_per_shard, params_dtype)


class BnbInt8Method(_BnbMethod):
    name = "bnb-int8"
    description = ("bitsandbytes LLM.int8(): int8 weights with one absmax scale per output row "
                   "(~1/4 of fp32). Quantized at load; loads bitsandbytes checkpoints saved by transformers.")
    settings = {
        "threshold": {
            "type": "number", "default": 0.0, "minimum": 0.0,
            "description": "Outlier threshold of LLM.int8()'s mixed-precision decomposition (transformers' "
                           "llm_int8_threshold, usually 6.0). 0: no decomposition and, on CPU, the fast "
                           "weight-only kernel (activations stay unquantized); > 0: bitsandbytes' own "
                           "int8 matmul in float16.",
        },
        "compute_dtype": COMPUTE_DTYPE_SETTING,
    }
    devices = ("cpu", "cuda")

    @classmethod
    def bits_per_weight(cls, options: dict[str, Any]) -> float:
        return 8.0 + INT8_ROW_OVERHEAD_BITS

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        """A transformers `load_in_8bit` checkpoint. Its llm_int8_threshold is how transformers computes,
        not how the weights are stored: `threshold` stays the user's choice."""
        return {} if _bnb_checkpoint_bits(quantization_config) == 8 else None

    def process_after_loading(self, layer) -> None:
        bnb = _bnb()
        weight = _take_dense_weight(layer)
        if getattr(layer, "input_split", False):
            weight = _with_whole_row_absmax(weight)
        codes, scb = quantize_int8(weight)
        if getattr(layer, "input_split", False):
            codes = codes[:, :-1].contiguous()
        layer.bnb_codes, layer.bnb_scb = codes, scb
        compute = COMPUTE_DTYPES[self.options["compute_dtype"]]
        layer.bnb_scales = None  # what the CPU weight-only kernel multiplies the int8 rows by
        layer.bnb_state = None  # bitsandbytes' LLM.int8() matmul state
        if codes.device.type == "cpu" and self.options["threshold"] == 0:
            layer.bnb_scales = (scb / 127).to(compute)
        else:
            state = bnb.MatmulLtState()
            state.CB, state.SCB = codes, scb
            state.threshold = float(self.options["threshold"])
            state.has_fp16_weights = False
            state.is_training = False
            layer.bnb_state = state

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = _rows(x)
        if rows.shape[0] == 0:
            return _empty(layer, x)
        if layer.bnb_state is not None:  # bitsandbytes' LLM.int8(): activations quantized from float16
            out = _bnb().matmul(rows.to(torch.float16), layer.bnb_codes, state=layer.bnb_state)
            return _finish(out, x, bias)
        scales = layer.bnb_scales
        if (scales.dtype == torch.bfloat16 and rows.shape[0] <= INT8PACK_MAX_ROWS
                and rows.shape[1] % INT8PACK_K_MULTIPLE == 0 and hasattr(torch, "_weight_int8pack_mm")):
            a = rows.to(torch.bfloat16).contiguous()
            if a.data_ptr() % 64:  # the kernel's aligned loads need an aligned row start
                a = a.clone()
            return _finish(torch._weight_int8pack_mm(a, layer.bnb_codes, scales), x, bias)
        weight = layer.bnb_codes.to(scales.dtype).mul_(scales.unsqueeze(1))
        return _finish(F.linear(rows.to(scales.dtype), weight), x, bias)

    def weight_bytes(self, layer) -> int:
        return _nbytes(layer.bnb_codes, layer.bnb_scb, layer.bnb_scales)


# --- 4-bit --------------------------------------------------------------------------------------


def quantize_4bit(weight: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64,
                  double_quant: bool = False):
    """[N, K] -> (packed uint8 [(N*K+1)//2, 1], bitsandbytes QuantState): blocks of `blocksize`
    consecutive values of the row-major weight, each with its absmax (itself 8-bit quantized in blocks
    of 256 with double quantization)."""
    functional = _bnb().functional
    return functional.quantize_4bit(weight.detach().contiguous(), blocksize=blocksize,
                                    compress_statistics=double_quant, quant_type=quant_type)


def dequantize_4bit(packed: torch.Tensor, state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [N, K] weight in `dtype` (default: the dtype it was quantized from).

    Dequantized as one flat row: bitsandbytes 0.50.2's CPU kernel gets a 2-D weight wrong when a block
    spans two rows (K % blocksize != 0, e.g. K = 576 with blocks of 128); the flat layout is what the
    blocks index anyway."""
    flat = copy.copy(state)
    flat.shape = torch.Size([state.shape.numel()])
    flat.dtype = dtype or state.dtype
    return _bnb().functional.dequantize_4bit(packed, flat).reshape(state.shape)


def _cpu_packing_supported(weight: torch.Tensor, blocksize: int) -> bool:
    """bitsandbytes' packed CPU layout: a fused bf16 kernel on AVX512-BF16 CPUs, 32 output rows per tile,
    absmax per (row, block) so blocks must not straddle rows."""
    functional = _bnb().functional
    n, k = weight.shape
    return (weight.device.type == "cpu" and hasattr(functional, "_convert_weight_packed_for_cpu")
            and functional.has_avx512bf16() and n % 32 == 0 and k % blocksize == 0 and k % 2 == 0)


class BnbNf4Method(_BnbMethod):
    name = "bnb-nf4"
    description = ("bitsandbytes 4-bit: NF4 (or FP4) codes in blocks of 64 with one absmax per block "
                   "(~1/7 of fp32). Quantized at load; loads bitsandbytes checkpoints saved by transformers.")
    settings = {
        "quant_type": {
            "type": "string", "enum": ["nf4", "fp4"], "default": "nf4",
            "description": "4-bit data type: nf4 (normal float, for normally distributed weights) or fp4.",
        },
        "double_quant": {
            "type": "boolean", "default": False,
            "description": "Quantize the absmax values too (8-bit blocks of 256): ~0.37 bit per weight less "
                           "on CUDA. bitsandbytes' packed CPU kernel keeps the absmax in bfloat16 either way.",
        },
        "blocksize": {
            "type": "integer", "enum": [64, 128, 256], "default": 64,
            "description": "Weights per absmax block. A block never spans two rows only when it divides the "
                           "input size (the embedded model's 576 needs 64).",
        },
        "compute_dtype": COMPUTE_DTYPE_SETTING,
    }
    devices = ("cpu", "cuda")

    @classmethod
    def bits_per_weight(cls, options: dict[str, Any]) -> float:
        blocksize = options.get("blocksize", 64)
        if options.get("double_quant", False):  # 8-bit absmax per block + an fp32 absmax per 256 blocks
            return 4.0 + 8.0 / blocksize + 32.0 / (blocksize * NESTED_BLOCKSIZE)
        return 4.0 + 32.0 / blocksize

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        """A transformers `load_in_4bit` checkpoint: quantizing its dequantized weights again with its own
        data type, double quantization and blocks (bitsandbytes' 64; the tensors record theirs) gives back
        its codes. The compute dtype stays the user's choice."""
        if _bnb_checkpoint_bits(quantization_config) != 4:
            return None
        quant_type = quantization_config.get("bnb_4bit_quant_type", "fp4")  # transformers' default
        if quant_type not in ("nf4", "fp4"):
            raise ValueError(f"bitsandbytes 4-bit data type {quant_type!r} is not supported (nf4, fp4)")
        return {"quant_type": quant_type, "blocksize": 64,
                "double_quant": bool(quantization_config.get("bnb_4bit_use_double_quant", False))}

    def process_after_loading(self, layer) -> None:
        weight = _take_dense_weight(layer)
        opts = self.options
        packed, state = quantize_4bit(weight, opts["quant_type"], opts["blocksize"], opts["double_quant"])
        compute = COMPUTE_DTYPES[opts["compute_dtype"]]
        layer.bnb_cpu_packed = compute == torch.bfloat16 and _cpu_packing_supported(weight, opts["blocksize"])
        if layer.bnb_cpu_packed:  # what Linear4bit does on the first forward on such a CPU
            packed, state = _bnb().functional._convert_weight_packed_for_cpu(packed, state)
        layer.bnb_packed, layer.bnb_quant_state = packed, state
        layer.bnb_compute_dtype = compute

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        compute = layer.bnb_compute_dtype
        rows = _rows(x).to(compute).contiguous()  # the packed CPU kernel assumes unit stride along K
        if rows.shape[0] == 0:  # ... and crashes on an empty batch
            return _empty(layer, x)
        if layer.bnb_cpu_packed or rows.device.type != "cpu":
            out = _bnb().matmul_4bit(rows, layer.bnb_packed, layer.bnb_quant_state)
        else:  # what matmul_4bit does on CPU, without its 2-D dequantization (see dequantize_4bit)
            out = F.linear(rows, dequantize_4bit(layer.bnb_packed, layer.bnb_quant_state, compute))
        return _finish(out, x, bias)

    def weight_bytes(self, layer) -> int:
        state = layer.bnb_quant_state
        total = _nbytes(layer.bnb_packed, state.absmax, state.code)
        if state.nested:
            total += _nbytes(state.state2.absmax, state.state2.code)
        return total


# --- pre-quantized checkpoints ----------------------------------------------------------------------


def _bnb_checkpoint_bits(quantization_config: dict[str, Any]) -> int | None:
    """8 or 4 for a transformers BitsAndBytesConfig checkpoint, else None."""
    if quantization_config.get("quant_method", "bitsandbytes") != "bitsandbytes":
        return None
    if quantization_config.get("load_in_8bit"):
        return 8
    if quantization_config.get("load_in_4bit"):
        return 4
    return None


def _bnb_part(name: str, tensor: torch.Tensor, pending: dict[str, dict[str, torch.Tensor]]) -> tuple[str, str] | None:
    """(module prefix, part) when `name` is a piece of a bitsandbytes-quantized linear, else None."""
    for suffix in (".SCB", ".weight_format"):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix[1:]
    head, sep, tail = name.rpartition(".weight.")
    if sep and (tail in _4BIT_PARTS or tail.startswith(_QUANT_STATE)):
        return head, tail
    if name.endswith(".weight"):
        prefix = name[: -len(".weight")]
        # int8 codes / uint8 4-bit storage; [n, 1]: 4-bit packed in another quant_storage dtype
        if (tensor.dtype in (torch.int8, torch.uint8) or prefix in pending
                or (tensor.dim() == 2 and tensor.shape[1] == 1)):
            return prefix, "weight"
    return None


def _int8_format_is_row_major(prefix: str, weight_format: torch.Tensor) -> None:
    value = int(weight_format.item())
    if value != 0:
        raise ValueError(f"{prefix}: bitsandbytes int8 weight_format {value} is a tiled GPU layout; only row-major "
                         "(0, what bitsandbytes >= 0.45 writes) can be loaded")


def _dequantize_group(prefix: str, group: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict] | None:
    """The dense fp32 weight of one module once all its pieces are in `group`, with what it was stored as."""
    if "weight" not in group:
        return None
    if "SCB" in group:
        if "weight_format" in group:
            _int8_format_is_row_major(prefix, group["weight_format"])
        return dequantize_int8(group["weight"], group["SCB"]).float(), {"format": "int8"}
    state_key = next((k for k in group if k.startswith(_QUANT_STATE)), None)
    if state_key is None or "absmax" not in group or "quant_map" not in group:
        return None
    bnb = _bnb()
    packed_state = bnb.utils.unpack_tensor_to_dict(group[state_key])
    nested = "nested_blocksize" in packed_state
    if nested and not ("nested_absmax" in group and "nested_quant_map" in group):
        return None
    parts = {k: v for k, v in group.items() if k != "weight"}
    state = bnb.functional.QuantState.from_dict(parts, device=group["weight"].device)
    dense = dequantize_4bit(group["weight"], state, torch.float32)
    return dense, {"format": state.quant_type, "blocksize": state.blocksize, "double_quant": nested}


def dequantize_checkpoint(tensors: Iterator[tuple[str, torch.Tensor]], method: str = "",
                          options: dict[str, Any] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a checkpoint, replacing each bitsandbytes-quantized linear (int8: `<p>.weight` int8 +
    `<p>.SCB` [+ `<p>.weight_format`]; 4-bit: `<p>.weight` uint8 + `<p>.weight.absmax`, `.quant_map`,
    `.quant_state.bitsandbytes__nf4|fp4` [+ `.nested_absmax`, `.nested_quant_map`]) by its dequantized
    fp32 `<p>.weight`. Every other tensor passes through unchanged, in order. A module's pieces are held
    only until the last one arrives (safetensors files list them together), never the whole checkpoint."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    emitted_int8: set[str] = set()
    warned = False
    for name, tensor in tensors:
        split = _bnb_part(name, tensor, pending)
        if split is None:
            yield name, tensor
            continue
        prefix, part = split
        if part == "weight_format" and prefix in emitted_int8:  # listed after the weight it describes
            _int8_format_is_row_major(prefix, tensor)
            continue
        group = pending.setdefault(prefix, {})
        group[part] = tensor
        done = _dequantize_group(prefix, group)
        if done is None:
            continue
        dense, stored = done
        del pending[prefix]
        if stored["format"] == "int8":
            emitted_int8.add(prefix)
        if not warned and options is not None and _requantized_differently(method, stored, options):
            warned = True
            log.warning("%s: the checkpoint's bitsandbytes weights (%s) are dequantized and quantized again "
                        "as %s %s: a second rounding", prefix, _describe(stored), method, options)
        yield f"{prefix}.weight", dense
    for prefix, group in pending.items():
        if set(group) == {"weight"} and group["weight"].is_floating_point():  # an ordinary [n, 1] weight
            yield f"{prefix}.weight", group["weight"]
            continue
        raise ValueError(f"incomplete bitsandbytes checkpoint: module {prefix} has only {', '.join(sorted(group))}")


def _describe(stored: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in stored.items())


def _requantized_differently(method: str, stored: dict, options: dict[str, Any]) -> bool:
    if method == BnbInt8Method.name:
        return stored["format"] != "int8"
    if method == BnbNf4Method.name:
        return (stored["format"] != options.get("quant_type") or stored.get("blocksize") != options.get("blocksize")
                or stored.get("double_quant") != options.get("double_quant"))
    return False
