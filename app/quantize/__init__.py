"""`kvforge quantize`: write a quantized checkpoint (GPTQ, AWQ, bitsandbytes NF4 / int8) of a model that
both kvforge and HF transformers load.

- gptq / awq go through GPTQModel (gptqmodel_writer.py), calibrated on a small built-in text set
  (`calibration.txt`: prose, code, chats) or on --calibration-file, packed into --calibration-samples
  sequences of --seq-len tokens (calibration.py).
- bnb-nf4 / bnb-int8 go through transformers' BitsAndBytesConfig on CPU (bnb_writer.py).
- rtn_writer.py writes round-to-nearest GPTQ / AWQ checkpoints in seconds, without calibration (the tests
  and `kvforge bench quant`).

Every output directory holds config.json with `quantization_config` as the library writes it, safetensors
weights only, the source's tokenizer and chat template, and its generation_config.json when it has one
(pipeline.py). Options and their defaults: options.py; checks before any work: checks.py; the command
line: cli.py.
"""

from kvforge.app.quantize.cli import add_parser

__all__ = ["add_parser"]
