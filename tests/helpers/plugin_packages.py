"""Real third-party plugin packages, built from source in a test and pip-installed into a private
--target directory (no fake metadata files): the toy int8 quant plugin and a builder for others."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TOY_INT8_SOURCE = '''
"""A toy third-party plugin: per-output-row symmetric int8 weights, dequantized for each matmul."""

import torch
import torch.nn.functional as F
from kvforge.core.plugins import QuantMethod

APPLY_CALLS = 0  # how many matmuls went through this plugin


class ToyInt8Method(QuantMethod):
    name = "toy-int8"
    description = "Per-row symmetric int8 weights (test plugin)."
    settings = {"scale_floor": {"type": "number", "default": 1e-12, "description": "smallest per-row scale"}}

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype):
        weight = torch.nn.Parameter(torch.empty(sum(out_features_per_shard), in_features, dtype=params_dtype),
                                    requires_grad=False)
        weight.weight_loader = layer.weight_loader
        layer.register_parameter("weight", weight)
        layer.toy_dtype = params_dtype

    def process_after_loading(self, layer):
        w = layer.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=self.options.get("scale_floor", 1e-12)) / 127.0
        qweight = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        del layer.weight
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("scale", scale.to(layer.toy_dtype))

    def apply(self, layer, x, bias=None):
        global APPLY_CALLS
        APPLY_CALLS += 1
        return F.linear(x, layer.qweight.to(x.dtype) * layer.scale.to(x.dtype), bias)
'''

def build_and_install(root: Path, dist: str, version: str, module: str, source: str,
                       entry_points: dict[str, str]) -> Path:
    """Write a one-module setuptools project under root/src, pip-install it into root/site."""
    pkg, site = root / "src", root / "site"
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(textwrap.dedent(source))
    eps = "\n".join(f'"{name}" = "{target}"' for name, target in entry_points.items())
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "{version}"

        [tool.setuptools]
        packages = ["{module}"]

        [project.entry-points."kvforge.quant"]
        """) + eps + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(pkg)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip install of {dist} failed:\n{result.stdout}\n{result.stderr}"
    assert list(site.glob("*.dist-info")), f"pip installed no metadata for {dist} into {site}"
    return site




def toy_int8_site(root: Path) -> Path:
    return build_and_install(root, "kvforge-toy-int8", "0.3.1", "kvforge_toy_int8", TOY_INT8_SOURCE,
                             {"toy-int8": "kvforge_toy_int8:ToyInt8Method"})
