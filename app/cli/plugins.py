"""`kvforge plugins`: the installed quantization and decoding plugins, with their options."""

from __future__ import annotations

import argparse
import json


def describe_setting(schema: dict) -> str:
    """One line for a plugin option: its type, choices, default and description."""
    parts = [schema.get("type", "any")]
    if "enum" in schema:
        parts.append("one of " + " / ".join(map(str, schema["enum"])))
    if "default" in schema:
        parts.append(f"default {json.dumps(schema['default'])}")
    text = ", ".join(parts)
    return f"{text}: {schema['description']}" if schema.get("description") else text


def cmd_plugins(args: argparse.Namespace) -> int:
    from kvforge.core.plugins import DECODING_GROUP, QUANT_GROUP, discover

    for group in (QUANT_GROUP, DECODING_GROUP):
        registry = discover(group)
        print(f"{group}:")
        if not registry.plugins and not registry.errors:
            print("  (none installed)")
        for name, cls in sorted(registry.plugins.items()):
            devices = " / ".join(getattr(cls, "devices", ()) or ("any",))
            print(f"  {name:<12} {registry.sources[name]:<24} {getattr(cls, 'description', '')} [{devices}]")
            for option, schema in getattr(cls, "settings", {}).items():
                print(f"      {option}: {describe_setting(schema)}")
        for name, error in sorted(registry.errors.items()):
            print(f"  {name:<12} FAILED: {error}")
    return 0
