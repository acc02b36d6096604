"""A layout as one value: how a step is laid out over the devices, in a line a person can read.

    dp+tp data=2,tensor=4 remat=selective mb=2 accum=4
    zero1+tp+sp+pp fsdp=64,stage=16,tensor=8 remat=full mb=1 schedule=interleaved m=32 v=2 precision=mixed

The first word is the strategy (a rules preset), then the mesh (axis=size, comma-joined), then
`key=value` fields, each left out at its default: `remat` (none), `mb` (rows per micro-batch per
data shard, 1), `accum` (passes accumulated before the update, 1), `schedule`, `m` (pipeline
micro-batches), `v` (virtual chunks), `stage-remat`, `precision`, `reduce` (the gradient
reduction's dtype). `Layout.parse(str(layout)) == layout`. `jshard plan --search` prints its
layouts so; `--layout` in `plan`, `compile` and `train` takes one back.
"""

from __future__ import annotations

import dataclasses

from jshard.mesh import STANDARD_AXES

# field name -> the key its line uses, and its type
KEYS = {"remat": ("remat", str), "micro_batch_size": ("mb", int), "grad_accum": ("accum", int),
        "schedule": ("schedule", str), "microbatches": ("m", int), "virtual": ("v", int),
        "stage_remat": ("stage-remat", str), "precision": ("precision", str), "reduce": ("reduce", str)}


class LayoutError(ValueError):
    """A layout line that does not parse; its message names the word and the fix."""


@dataclasses.dataclass(frozen=True)
class Layout:
    strategy: str
    mesh: tuple[tuple[str, int], ...] = ()  # (axis, size) of the axes above 1, in mesh order
    remat: str = "none"
    micro_batch_size: int = 1
    grad_accum: int = 1
    schedule: str | None = None
    microbatches: int | None = None
    virtual: int | None = None
    stage_remat: str | None = None
    precision: str | None = None
    reduce: str | None = None

    @property
    def sizes(self) -> dict[str, int]:
        """Every standard axis's size (1 where the mesh leaves it out)."""
        return {a: 1 for a in STANDARD_AXES} | dict(self.mesh)

    @property
    def mesh_text(self) -> str:
        """The mesh as `--mesh` takes it."""
        return ",".join(f"{a}={n}" for a, n in self.mesh) or "data=1"

    def __str__(self) -> str:
        words = [self.strategy, self.mesh_text]
        for field, (key, _) in KEYS.items():
            value = getattr(self, field)
            if value != next(f.default for f in dataclasses.fields(Layout) if f.name == field):
                words.append(f"{key}={value}")
        return " ".join(words)

    @classmethod
    def of(cls, strategy: str, sizes: dict[str, int], **fields) -> Layout:
        """From mesh sizes as a dict (axes of size 1 left out, mesh order kept)."""
        return cls(strategy, tuple((a, n) for a, n in sizes.items() if n > 1), **fields)

    @classmethod
    def parse(cls, text: str) -> Layout:
        words = text.split()
        if not words or "=" in words[0]:
            raise LayoutError(f"layout {text!r}: it starts with the strategy (e.g. 'dp+tp data=2,tensor=4'). "
                              "Fix: put the strategy first.")
        mesh, fields = (), {}
        by_key = {key: (field, kind) for field, (key, kind) in KEYS.items()}
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or not value:
                raise LayoutError(f"layout {text!r}: {word!r} is not key=value. Fix: e.g. remat=full, mb=2.")
            if key in STANDARD_AXES:
                try:
                    mesh = tuple((a, int(n)) for a, n in (part.split("=") for part in word.split(",")))
                except ValueError:
                    raise LayoutError(f"layout {text!r}: mesh {word!r} is not axis=size,... with integer sizes. "
                                      "Fix: e.g. data=2,tensor=4.") from None
                unknown = [a for a, _ in mesh if a not in STANDARD_AXES]
                if unknown:
                    raise LayoutError(f"layout {text!r}: {unknown[0]!r} is not a mesh axis. "
                                      f"Fix: one of {', '.join(STANDARD_AXES)}.")
                continue
            if key not in by_key:
                raise LayoutError(f"layout {text!r}: no field {key!r}. Fix: one of "
                                  f"{', '.join(STANDARD_AXES)} (the mesh), {', '.join(by_key)}.")
            field, kind = by_key[key]
            try:
                fields[field] = kind(value)
            except ValueError:
                raise LayoutError(f"layout {text!r}: {key}={value!r} is not an integer. Fix: e.g. {key}=2.") from None
        return cls(words[0], mesh, **fields)
