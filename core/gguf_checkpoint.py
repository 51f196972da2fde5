"""A GGUF file as a checkpoint directory that keeps its quantized weights (the `gguf` quant method loads it).

Written once into the cache, like the dense conversion (loader.convert_gguf), but each linear projection
stored in a GGUF block type stays quantized: its blocks are decoded losslessly (plugins/quant/gguf_blocks.py)
into three safetensors tensors beside where the dense weight would be, `<name>.qcodes` (int8 [N, K]),
`<name>.qscales` and `<name>.qoffsets` (fp32 [N, K / 16]: every type's groups written at the finest group
size, 16, so that the projections fused into one layer -- q/k/v of a Q4_K_M file mix Q4_K, Q6_K, Q8_0 --
share one layout). The LM head too, from the file's output tensor or, for a tied head, from the token
embedding's blocks (`"lm_head": true` in the quantization config: kvforge otherwise keeps heads dense): at a large
vocabulary (Gemma's 262k) the head is most of a decode step's weight reads. Embeddings, norms and F32 / F16 / BF16
projections are stored dequantized in fp32, exactly as transformers' GGUF loader gives them. config.json says
`quantization_config: {"quant_method": "gguf", ...}`, listing the projections kept dense.

Tensor names and the per-architecture fix-ups (Llama's Q / K row permutation, Gemma's norm offset) come from
transformers' GGUF loader, applied to codes, scales and offsets alike (they only move whole rows).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

NATIVE_CONVERTER_VERSION = "3"  # bump when the layout written here changes
STORED_GROUP = 16  # the group size every quantized projection is written at (the finest GGUF type's)


def write_native(gguf: Path, out: Path) -> None:
    """Write the checkpoint of `gguf` into the directory `out` (loader.cached_checkpoint calls it once)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    from kvforge.core.chat_templates import save_tokenizer
    from kvforge.core.models.registry import model_class_for
    from kvforge.plugins.quant.gguf_blocks import DECODERS, FLOAT_TYPES, decode

    log.warning("reading %s into %s (once; its quantized weights stay quantized)", gguf.name, out.parent)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):  # only for the tensor-name mapping; no memory is allocated
        reference = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(reference).__name__]
    packed = getattr(model_class_for(config), "packed_modules_mapping", {})  # unsupported families fail here
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
    reader = GGUFReader(str(gguf))
    arch = read_field(reader, "general.architecture")[0]
    # the fix-ups of transformers' loader (they rename nothing for the families kvforge runs)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(reference, processor)
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, object] = {}  # HF projection name (no ".weight") -> GroupCodes
    tied = getattr(config, "tie_word_embeddings", False)
    for tensor in reader.tensors:
        name = names.get(tensor.name)
        if name is None:
            continue
        qtype = tensor.tensor_type
        head = name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight")
        if (name.endswith("_proj.weight") or head) and qtype in DECODERS:
            codes = decode(tensor.data, qtype)
            codes.codes, codes.scales = _rows(processor, tensor.name, codes.codes), \
                _rows(processor, tensor.name, codes.scales)
            if codes.offsets is not None:
                codes.offsets = _rows(processor, tensor.name, codes.offsets)
            quantized["lm_head" if head else name.removesuffix(".weight")] = codes
            if name != "model.embed_tokens.weight":  # the embedding itself is stored dense below
                continue
        if qtype not in FLOAT_TYPES and qtype not in DECODERS:
            decode(tensor.data, qtype)  # raises: the type is not supported
        weights = processor.process(weights=dequantize(tensor.data, qtype), name=tensor.name).weights
        tensors[name] = torch.from_numpy(np.array(weights, dtype=np.float32))
    if tied or "lm_head" in quantized:
        tensors.pop("lm_head.weight", None)

    dense_modules = _mixed_fused_layers(quantized, tensors, packed)
    for module in dense_modules:  # a fused layer whose parts are not all quantized: all of it dense
        if module in quantized:
            tensors[f"{module}.weight"] = quantized.pop(module).dequantize()
    for module, codes in quantized.items():
        for suffix, value in zip(("qcodes", "qscales", "qoffsets"), codes.stored(STORED_GROUP)):
            tensors[f"{module}.{suffix}"] = value
    config.quantization_config = {"quant_method": "gguf", "group_size": STORED_GROUP, "lm_head": "lm_head" in quantized,
                                  "modules_to_not_convert": sorted(dense_modules), "source": gguf.name}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt", "source": gguf.name})
    config.save_pretrained(out)
    save_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), config.model_type, out)


def _rows(processor, gguf_name: str, values: torch.Tensor) -> torch.Tensor:
    """`values` [N, ...] with the architecture's row fix-up applied (e.g. Llama's Q / K permutation)."""
    return torch.from_numpy(np.ascontiguousarray(processor.process(weights=values.numpy(), name=gguf_name).weights))


def _mixed_fused_layers(quantized: dict, dense: dict[str, torch.Tensor], packed: dict) -> set[str]:
    """Projections fused into one layer (e.g. q/k/v_proj) of which some are quantized and some are not:
    those layers are kept dense (every part listed, as QuantConfig requires)."""
    groups: dict[str, list[str]] = {}
    for module in [*quantized, *(n.removesuffix(".weight") for n in dense if n.endswith("_proj.weight"))]:
        parent, _, leaf = module.rpartition(".")
        fused = packed.get(leaf, (leaf, None))[0]
        groups.setdefault(f"{parent}.{fused}", []).append(module)
    mixed: set[str] = set()
    for parts in groups.values():
        if any(p in quantized for p in parts) and not all(p in quantized for p in parts):
            mixed.update(parts)
    return mixed
