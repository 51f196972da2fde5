"""bnb-nf4 / bnb-int8 checkpoints through transformers' BitsAndBytesConfig on CPU. The model is saved right
after loading, before any forward: on AVX512-BF16 CPUs a 4-bit model without double quant that has run a
forward writes a wrong `absmax`."""

from __future__ import annotations

from pathlib import Path

from kvforge.app.quantize.options import QuantizeOptions


def write_bnb(options: QuantizeOptions, source: Path, staging: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if options.method == "bnb-nf4":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=options.quant_type,
                                    bnb_4bit_use_double_quant=options.double_quant,
                                    bnb_4bit_compute_dtype=torch.bfloat16)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    # bf16: bitsandbytes' int8 matmul warns at every call on fp32 inputs
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, device_map="cpu",
                                                 dtype=torch.bfloat16)
    model.save_pretrained(staging)  # before any forward: see the module docstring
