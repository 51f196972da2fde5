"""A model's own sampling defaults: what a request gets for a sampling field it leaves out.

Small models derail at neutral settings (temperature 1, top-p 1): the embedded SmolLM2-135M answers "What is the
capital of France?" with pages of repeated French there, and its model card recommends temperature 0.2 and top-p
0.9. So, as vLLM does with `generation_config.json`, each model brings its defaults, found in this order (the first
source that sets any field wins; the user's own, from the settings file, go over it field by field):

1. the checkpoint's `generation_config.json`: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens
   (HF's names; `do_sample` is not read, as vLLM does not: a config that sets a temperature means it);
2. FAMILY_DEFAULTS below, matched on the model's names (its checkpoint directory, the source it was converted from,
   the config's `_name_or_path`), for families whose model card recommends settings the checkpoint does not carry;
3. none: SamplingParams' neutral defaults.

The layers above a request (app/): request fields > a conversation's settings > these defaults > SamplingParams'.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.core.sampling import SamplingParams

# generation_config.json's names -> ours
CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# the fields a model's defaults may set: generation_config.json's, and the penalties a settings file may add
FIELDS = (*CONFIG_FIELDS.values(), "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class Family:
    pattern: str  # matched (re.search, case-insensitive) on the model's names
    defaults: dict[str, Any]
    source: str  # where the recommendation comes from


FAMILY_DEFAULTS = (  # the first pattern that matches wins
    # The embedded default (its Q4_1 GGUF, converted or not) decodes greedily: sampled at its model card's 0.2 / 0.9
    # it found the expected fact in 73% of `kvforge bench defaults` replies against 88% greedy (Intel Xeon with AMX,
    # bf16, 10 questions x 8 seeds), and "What is the capital of France?" went off into lists of French words in
    # 9 of 40 samples: its first token is a near tie ("The" -1.82, "L" -1.95 logprob), which any temperature samples.
    Family(r"smollm2-135m-instruct\.q4_1", {"temperature": 0.0}, "kvforge bench defaults (embedded Q4_1)"),
    # HuggingFaceTB's model cards for SmolLM2-135M / 360M / 1.7B-Instruct sample at these
    Family(r"smollm2[-_ ].*instruct", {"temperature": 0.2, "top_p": 0.9}, "SmolLM2 model card"),
)


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling fields a model's requests default to (only the fields some source set), and where they came
    from ("generation_config.json", a family's model card, "settings", or "none")."""

    values: dict[str, Any] = field(default_factory=dict)
    source: str = "none"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.values) - set(FIELDS))
        if unknown:
            raise ValueError(f"sampling defaults: unknown fields {', '.join(unknown)} (known: {', '.join(FIELDS)})")
        SamplingParams(**self.values)  # the fields' bounds: a bad default fails at load, naming the field

    def over(self, base: GenerationDefaults) -> GenerationDefaults:
        """These values over `base`'s, field by field."""
        if not self.values:
            return base
        source = self.source if not base.values else f"{self.source} over {base.source}"
        return GenerationDefaults({**base.values, **self.values}, source)

    def params(self, **fields: Any) -> SamplingParams:
        """SamplingParams with these defaults under the given fields."""
        return SamplingParams(**{**self.values, **fields})


def model_generation_defaults(model_path: Path, names: list[str | None] = ()) -> GenerationDefaults:
    """The defaults of the checkpoint at `model_path` (see the module's docstring); `names`: other names it goes by
    (the source it was converted from, the name it is served under)."""
    from_config = _from_generation_config(model_path / "generation_config.json")
    if from_config.values:
        return from_config
    config_name = _read_json(model_path / "config.json").get("_name_or_path")
    candidates = [model_path.name, config_name, *names]
    for family in FAMILY_DEFAULTS:
        if any(name and re.search(family.pattern, str(name), re.IGNORECASE) for name in candidates):
            return GenerationDefaults(dict(family.defaults), family.source)
    return GenerationDefaults()


def _from_generation_config(path: Path) -> GenerationDefaults:
    config = _read_json(path)
    values = {ours: config[theirs] for theirs, ours in CONFIG_FIELDS.items() if config.get(theirs) is not None}
    try:
        return GenerationDefaults(values, "generation_config.json") if values else GenerationDefaults()
    except ValueError as exc:  # a value out of bounds (top_k null, temperature < 0): the checkpoint's, not ours
        raise ValueError(f"{path}: {exc}") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
