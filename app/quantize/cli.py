"""The `kvforge quantize` command line."""

from __future__ import annotations

import argparse
from dataclasses import fields

from kvforge.app.quantize.options import EXTRA_HINT, METHODS, QuantizeOptions
from kvforge.app.quantize.pipeline import quantize


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C does: the staging directory is removed


def cmd_quantize(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvforge.app.cli.cache import human_bytes

    names = {f.name for f in fields(QuantizeOptions)}
    options = QuantizeOptions(**{k: v for k, v in vars(args).items() if k in names})
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        result = quantize(options)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(f"kvforge: wrote {result.method} checkpoint {result.out} ({human_bytes(result.bytes_on_disk)} on disk) "
          f"in {result.seconds:.0f} s", flush=True)
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `quantize` on the top-level `kvforge` subcommands."""
    p = sub.add_parser(
        "quantize", help="write a GPTQ / AWQ / bitsandbytes checkpoint that kvforge and HF transformers load",
        description="Quantize a model into a checkpoint directory (config.json with quantization_config, "
        f"safetensors, tokenizer). gptq and awq need GPTQModel: {EXTRA_HINT}. Options that do not apply "
        "to the chosen method are refused.")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--model", default=None,
                   help="HF model directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    g = p.add_argument_group("gptq / awq")
    g.add_argument("--bits", type=int, default=None, help="gptq: 4 (default) or 8; awq: 4")
    g.add_argument("--group-size", type=int, default=None,
                   help="weights per scale; must divide every layer's input size (default: 64; -1: per row, gptq)")
    g.add_argument("--desc-act", action="store_true", default=None,
                   help="gptq: quantize columns by decreasing activation (act-order)")
    g.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq: symmetric (default) or with zero points; awq is always --no-sym")
    g.add_argument("--checkpoint-format", choices=("gptq", "gptq_v2"), default=None,
                   help="gptq: 'gptq' (v1, what most loaders read; default) or 'gptq_v2'")
    g.add_argument("--clip", action=argparse.BooleanOptionalAction, default=None,
                   help="awq: search a clipping range per weight group (default); --no-clip skips that search, "
                        "most of the build's time on CPU")
    g.add_argument("--calibration-samples", type=int, default=None, help="calibration sequences (default: 64)")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per calibration sequence (default: 256)")
    g.add_argument("--calibration-file", default=None,
                   help="UTF-8 text to calibrate on instead of the built-in set (passages after lines '%%%%%%')")
    b = p.add_argument_group("bnb-nf4 / bnb-int8")
    b.add_argument("--double-quant", action="store_true", default=None,
                   help="bnb-nf4: also quantize the per-block absmax constants")
    b.add_argument("--quant-type", choices=("nf4", "fp4"), default=None, help="bnb-nf4: 4-bit data type (nf4)")
    p.set_defaults(func=cmd_quantize)
    return p
