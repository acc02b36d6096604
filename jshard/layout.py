"""A layout as one value: how a step is laid out over the devices, in a line a person can read.

    dp+tp data=2,tensor=4 remat=selective mb=2 accum=4
    zero1+tp+sp+pp fsdp=64,stage=16,tensor=8 remat=full mb=1 schedule=interleaved m=32 v=2 precision=mixed

The first word is the strategy (a rules preset), then the mesh (axis=size, comma-joined), then
`key=value` fields, each left out at its default: `remat` (the model's own), `mb` (rows per
micro-batch per data shard, 1), `accum` (passes accumulated before the update, 1), `schedule`,
`m` (pipeline micro-batches), `v` (virtual chunks), `stage-remat`, `precision`, `reduce` (the
gradient reduction's dtype). `Layout.parse(str(layout)) == layout`. `jshard plan --search` prints
its layouts so; `--layout` in `plan`, `compile` and `train` takes one back.

The library takes it whole: `build_step(model, tx, loss_fn, layout)`, `parallel.make_plan`,
`aot.compile_step`, the planner's `PlanInput` and `jshard.app.training` (`TrainConfig.layout.on`). Who
reads which field: the step (`make_plan`) the strategy, mesh, schedule, micro-batches, virtual
chunks, stage remat, precision, reduction and accumulation; `remat` is the model's (a jshard
decoder's `config.remat`: the step checks they agree) and `mb` the batch's (the planner's rows).
A Python caller may give the strategy as a `Rules` value and the precision as a `Precision`;
their names are what the line shows.
"""

from __future__ import annotations

import dataclasses
import math

from jshard.mesh import STANDARD_AXES, mesh_shape
from jshard.precision import Precision, precision
from jshard.rules import Rules, ShardingError, axes_of, preset, resolve

# field name -> the key its line uses, and its type
KEYS = {"remat": ("remat", str), "micro_batch_size": ("mb", int), "grad_accum": ("accum", int),
        "schedule": ("schedule", str), "microbatches": ("m", int), "virtual": ("v", int),
        "stage_remat": ("stage-remat", str), "precision": ("precision", str), "reduce": ("reduce", str)}
# A vocabulary the layout does not divide is padded to a multiple of this and of the split
# (Megatron's make-vocab-size-divisible-by): 128 keeps a padded table's shape whatever the
# tensor size up to 128, so a checkpoint resumes under another.
VOCAB_MULTIPLE = 128
# What holds a vocabulary dim: the token table, an untied head, the logits.
VOCAB_TENSORS = ((("vocab", "embed"), "param"), (("embed", "vocab"), "param"), (("batch", "seq", "vocab"), "activation"))


class LayoutError(ShardingError):
    """A layout line that does not parse, or a field no step can take; its message names the word
    or the field (`Layout.grad_accum`), and the fix."""


COUNTS = ("micro_batch_size", "grad_accum", "microbatches", "virtual")  # integer fields, each >= 1 where given


@dataclasses.dataclass(frozen=True)
class Layout:
    strategy: str | Rules  # a rules preset's name (`jshard.preset`), or the Rules themselves
    mesh: tuple[tuple[str, int], ...] = ()  # (axis, size) of the axes not of size 1, in mesh order
    remat: str | None = None  # None: the model's own
    micro_batch_size: int = 1
    grad_accum: int = 1
    schedule: str | None = None
    microbatches: int | None = None
    virtual: int | None = None
    stage_remat: str | None = None
    precision: str | Precision | None = None  # `jshard.precision`; None: params as the model holds them
    reduce: str | None = None

    def __post_init__(self):
        for field in COUNTS:
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise LayoutError(f"Layout.{field}={value!r}: it counts {COUNT_MEANS[field]}. Fix: an integer >= 1.")
        for axis, size in self.mesh:
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                raise LayoutError(f"Layout.mesh: {axis}={size!r} is not a size. Fix: an integer >= 1 (or -1 for one "
                                  "axis: the devices the others leave).")

    @property
    def rules(self) -> Rules:
        """The strategy's rules: the preset it names, or the Rules it is."""
        return self.strategy if isinstance(self.strategy, Rules) else preset(self.strategy)

    @property
    def policy(self) -> Precision | None:
        """The precision policy with its reduction dtype (`jshard.precision.precision`)."""
        try:
            return precision(self.precision, self.reduce)
        except ValueError as e:
            raise LayoutError(f"Layout.precision={_name(self.precision)!r}, Layout.reduce={self.reduce!r}: {e}") from None

    @property
    def sizes(self) -> dict[str, int]:
        """Every standard axis's size (1 where the mesh leaves it out)."""
        return {a: 1 for a in STANDARD_AXES} | dict(self.mesh)

    @property
    def vocab_split(self) -> int:
        """Into how many parts the layout splits a vocabulary (its token table, head or logits)."""
        split = 1
        for names, kind in VOCAB_TENSORS:
            try:
                spec, _ = resolve(self.rules.table(kind), names, (None,) * len(names), self.sizes, "vocab")
            except ShardingError:  # rules without a vocabulary (a model of another kind): nothing splits one
                continue
            split = math.lcm(split, math.prod(self.sizes[a] for a in axes_of(spec[names.index("vocab")])))
        return split

    def model(self, config):
        """A decoder's config as this layout runs it: its remat the layout's where the layout sets
        one; its vocabulary padded (`vocab_multiple`) where the split does not divide its table."""
        if self.remat is not None:
            config = dataclasses.replace(config, remat=self.remat)
        split = self.vocab_split
        if split > 1 and config.vocab_rows % split:
            config = dataclasses.replace(config, vocab_multiple=math.lcm(VOCAB_MULTIPLE, split))
        return config

    @property
    def mesh_text(self) -> str:
        """The mesh as `--mesh` takes it."""
        return ",".join(f"{a}={n}" for a, n in self.mesh) or "data=1"

    def __str__(self) -> str:
        words = [_name(self.strategy), self.mesh_text]
        for field, (key, _) in KEYS.items():
            value = getattr(self, field)
            if value != DEFAULTS[field]:
                words.append(f"{key}={_name(value)}")
        return " ".join(words)

    @classmethod
    def of(cls, strategy: str | Rules, sizes, **fields) -> Layout:
        """From mesh sizes as a dict, or a mesh's (a `jax.sharding.Mesh` or `AbstractMesh`): axes of
        size 1 left out, mesh order kept."""
        sizes = mesh_shape(sizes) if hasattr(sizes, "axis_names") else sizes
        return cls(strategy, tuple((a, n) for a, n in sizes.items() if n != 1), **fields)

    @classmethod
    def coerce(cls, layout: Layout | str) -> Layout:
        """A Layout, or its line parsed."""
        if isinstance(layout, str):
            return cls.parse(layout)
        if not isinstance(layout, Layout):
            raise LayoutError(f"layout {layout!r} is a {type(layout).__name__}, not a Layout. Fix: jshard.Layout(...) "
                              "or its line, e.g. 'dp+tp data=2,tensor=4'.")
        return layout

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


def _name(value) -> str:
    """A field as its line shows it: a Rules' or a Precision's name."""
    return value.name if isinstance(value, (Rules, Precision)) else value


COUNT_MEANS = {"micro_batch_size": "rows per micro-batch per data shard", "grad_accum": "the micro-batches a step "
               "accumulates gradients over (1: none)", "microbatches": "a pipeline's micro-batches per step",
               "virtual": "model chunks per device (the interleaved schedule)"}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Layout)}
