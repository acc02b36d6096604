"""What a run's config names, resolved: a named model size with its overrides, and the JSON
file a result goes to. `TrainConfig` and `GenerateConfig` name these as the command line
does (`jshard.cli.flags` spells each field as a flag), so their errors speak in flags too.
"""

from __future__ import annotations

import dataclasses
import json

from jshard.models import SIZES

# Config fields a flag overrides (--experts, --moe-every: a Llama's mixture of experts).
MODEL_FIELDS = ("layers", "embed", "heads", "kv_heads", "mlp", "vocab", "experts", "moe_every")


class FlagError(ValueError):
    """Flags that cannot be used together or do not fit the model. Raised before device work."""


def model_config(name: str, overrides: dict, **fields):
    """Named size `name` with `overrides` (the size flags), then `fields`; FlagError if they do not fit."""
    given = "".join(f" --{k.replace('_', '-')} {v}" for k, v in overrides.items())
    known = {f.name for f in dataclasses.fields(SIZES[name])}
    if unknown := [k for k in overrides if k not in known]:
        raise FlagError(f"--model {name}{given}: a {type(SIZES[name]).__name__} has no "
                        f"{', '.join(unknown)}. Fix: drop --{unknown[0].replace('_', '-')}, or pick a model that has it.")
    try:
        return dataclasses.replace(SIZES[name], **overrides, **fields)
    except ValueError as e:  # e.g. embed not divisible by heads
        raise FlagError(f"--model {name}{given}: {e}") from None


def write_json(path: str | None, value) -> None:
    """`--json FILE`: the value, indented; nothing without a path."""
    if path:
        with open(path, "w") as f:
            json.dump(value, f, indent=1)
            f.write("\n")
