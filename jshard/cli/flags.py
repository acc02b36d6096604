"""The flags `jshard` sub-commands share: one name, one meaning and one help text each.

    --model NAME         a named size (`models.SIZES`: GPTs and Llamas); --layers, --embed,
                         --heads, --kv-heads (Llama), --mlp and --vocab override its fields
    --seq-len N          tokens per row;  --attention auto|xla|cudnn  the attention kernel
    --strategy PRESET    rules preset, e.g. dp+fsdp+tp+sp+pp
    --mesh SIZES         e.g. data=2,fsdp=2,tensor=2; one axis may be -1 (the devices left);
                         not given: `mesh.default_mesh` of the strategy over the devices
    --precision NAME     precision policy (`jshard.precision`: fp32, bf16 compute, mixed);
                         --grad-reduce fp32|bf16 its gradient reduction dtype
    --remat POLICY       activation checkpointing of each block (`models.stack.REMAT_POLICIES`)
    --schedule, --microbatches, --virtual    the pipeline, when the strategy has pp
    --grad-accum N       micro-batches a step accumulates gradients over (`build_step(grad_accum=)`)
    --fake-devices N     CPU devices to fake when no accelerator is present
    --json FILE          also write the command's result to FILE

A command's defaults differ only where its job does (`bench step` times one device by
default, so that its ratio is pure overhead); each says so in its help.

What a flag's value means below the command line lives in the library, which `TrainConfig`
and `GenerateConfig` reach without it: `jshard.app.config` (`model_config`, `MODEL_FIELDS`,
`write_json`, `FlagError`) and `jshard.mesh` (`mesh_sizes`, `default_mesh`).
"""

from __future__ import annotations

import argparse
import functools
import re

from jshard.app.config import MODEL_FIELDS, FlagError, model_config
from jshard.layout import KEYS, Layout, LayoutError
from jshard.models import SIZES
from jshard.models.stack import REMAT_POLICIES
from jshard.nn.attn import ATTENTION
from jshard.parallel.tick_program import STAGE_REMAT
from jshard.parallel.schedules import SCHEDULES
from jshard.precision import PRECISIONS, REDUCE_DTYPES, Precision, precision


def _int_at_least(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive int")


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0, "an int of 0 or more")


def _shown(help: str, default, shown=None) -> str:
    shown = default if shown is None else shown
    return help if shown is None else f"{help} (default: {shown})"


# Each `add_*` registers its flags with a default; `shown` is the default the help names
# where the value is decided later (`jshard train` takes None, then its TrainConfig's).


def add_model(parser, default: str | None, shown: str | None = None, seq_len_help: str = "tokens per row") -> None:
    add = parser.add_argument
    add("--model", choices=SIZES, default=default, help=_shown("a named model size", default, shown))
    for field in MODEL_FIELDS:
        add(f"--{field.replace('_', '-')}", type=positive_int, help=f"override the model's {field}")
    add("--seq-len", type=positive_int, help=seq_len_help)
    add("--attention", choices=ATTENTION, help="attention kernel: auto (cuDNN's flash kernel on a GPU in bf16 where "
                                               "the head dim allows, else XLA's; under the ring and cp-gather "
                                               "jshard's flash kernel on a GPU), xla, cudnn or pallas (jshard's "
                                               "flash kernel, a GPU's) (default: auto)")


def add_bench(parser, model_shown: str, batch_size: int, repeats: int = 5) -> None:
    """A benchmark that builds its own model and times rows of steps: the model flags, --batch-size,
    --repeats, --json (the rows), --fake-devices."""
    add_model(parser, None, model_shown, seq_len_help="tokens per row, and the model's longest (default: the model's)")
    parser.add_argument("--batch-size", type=positive_int, default=batch_size, help=f"rows per step (default: {batch_size})")
    parser.add_argument("--repeats", type=positive_int, default=repeats,
                        help=f"timed steps; the median is reported (default: {repeats})")
    add_json(parser, "the rows")
    add_fake_devices(parser)


def model_overrides(args) -> dict:
    """The model flags given (sizes, --attention): {config field: value}."""
    return {f: getattr(args, f) for f in MODEL_FIELDS + ("attention",) if getattr(args, f, None) is not None}


def built_model(args, name: str, defaults: dict | None = None, **fields):
    """The model a command builds from its flags alone (`plan`, the benches): `args.model`, or
    else `name` with `defaults`; the size flags and --seq-len (its longest sequence) override
    both, then `fields`."""
    sizes = ({} if args.model else defaults or {}) | model_overrides(args)
    if args.seq_len:
        sizes["seq_len"] = args.seq_len
    return model_config(args.model or name, sizes, **fields)


def add_strategy(parser, default: str | None, shown: str | None = None, auto: bool = False) -> None:
    """--strategy; `auto`: the command also takes `auto`, the search's first layout (`plan.search`)."""
    parser.add_argument("--strategy", default=default,
                        help=_shown("rules preset, e.g. dp, zero3+tp, dp+fsdp+tp+sp, pp+fsdp"
                                    + ("; or auto: the layout `jshard plan --search` ranks first" if auto else ""),
                                    default, shown))


def add_mesh(parser, default: str | None = None, shown: str | None = None) -> None:
    parser.add_argument(
        "--mesh", default=default,
        help=_shown("mesh axis sizes, e.g. data=2,fsdp=2,tensor=2,stage=1; one may be -1, the devices left", default,
                    shown or "the strategy's axes over the devices: each inner one 2, the outermost the rest"))


def add_batch(parser) -> None:
    """A planned step's rows: --batch-size, per step over every data shard and micro-batch as
    `jshard train`'s, or --micro-batch-size, per micro-batch per data shard (default: 1)."""
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--batch-size", type=positive_int,
                      help="rows per step over every data shard and micro-batch, as jshard train's")
    rows.add_argument("--micro-batch-size", type=positive_int, help="rows per micro-batch per data shard (default: 1)")


def add_grad_accum(parser) -> None:
    """--grad-accum N: the step's batch cut into N micro-batches per batch shard, their gradients
    added up inside the step before one reduction and update (`build_step(grad_accum=)`)."""
    parser.add_argument("--grad-accum", type=positive_int, default=1, metavar="N",
                        help="micro-batches per step, their gradients accumulated inside the step before one "
                             "reduction and update (default: 1)")


def add_precision(parser, default: str | None, shown: str | None = None) -> None:
    parser.add_argument("--precision", choices=PRECISIONS, default=default,
                        help=_shown("fp32; bf16 (bf16 compute over fp32 params); mixed (bf16 params and grads, "
                                    "fp32 master and Adam moments in the optimizer's ZeRO layout)", default, shown))
    parser.add_argument("--grad-reduce", choices=REDUCE_DTYPES,
                        help="dtype of the gradient reduction (default: the precision's, fp32)")


def precision_of(args, default: str = "fp32") -> Precision:
    """The policy --precision and --grad-reduce name (`default` where --precision is not given)."""
    try:
        return precision(args.precision or default, getattr(args, "grad_reduce", None))
    except ValueError as e:
        raise FlagError(f"--precision/--grad-reduce: {e}") from None


def add_remat(parser, default: str | None = "none", shown: str | None = None) -> None:
    parser.add_argument("--remat", choices=REMAT_POLICIES, default=default,
                        help=_shown("activation checkpointing of each block", default, shown))


def add_pipeline(parser, microbatches: int | None = None, shown: str | None = None, schedule: str = "optional") -> None:
    """--schedule (`schedule`: "optional", "required", or "none" where a command takes several),
    --microbatches and --virtual. Their values are checked by `make_schedule`, whose errors say
    what fits (so they are plain ints here, not argparse's terser refusals)."""
    add = parser.add_argument
    if schedule != "none":
        add("--schedule", choices=tuple(SCHEDULES), required=schedule == "required",
            help="pipeline schedule" + ("" if schedule == "required" else ", when the strategy has pp (default: gpipe)"))
    add("--microbatches", type=int, default=microbatches,
        help=_shown("pipeline micro-batches per step", microbatches, shown))
    add("--virtual", type=int, help="model chunks per device, interleaved schedule only (default: 2)")
    add("--stage-remat", choices=STAGE_REMAT, default=None,
        help="what a pipeline stage keeps from F to its backward: none = what the backward needs (default), "
             "full = its input only, recomputing the forward (a third more work)")


FAKE_DEVICES = 8  # a command's --fake-devices when neither it nor XLA_FLAGS gives a count


def add_fake_devices(parser, shown: int = FAKE_DEVICES) -> None:
    """--fake-devices N; not given (None): XLA_FLAGS's count, else the command's (`mesh.fake_device_count`)."""
    parser.add_argument("--fake-devices", type=positive_int, default=None,
                        help=f"CPU devices to fake when no accelerator is present (default: the count "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count=N asks for, else {shown})")


def add_json(parser, what: str = "the result") -> None:
    parser.add_argument("--json", metavar="FILE", help=f"also write {what} to FILE as JSON")


# What `--layout` sets: the flags' dests, by the `Layout` field each takes (the mesh as --mesh's text).
LAYOUT_DESTS = {"strategy": "strategy", "mesh_text": "mesh", "remat": "remat", "micro_batch_size": "micro_batch_size",
                "grad_accum": "grad_accum", "schedule": "schedule", "microbatches": "microbatches", "virtual": "virtual",
                "stage_remat": "stage_remat", "precision": "precision", "reduce": "grad_reduce"}


def layout_of(args, sizes: dict[str, int]) -> Layout:
    """The `Layout` the flags name, on mesh `sizes` (a command's flags it lacks at their defaults)."""
    get = functools.partial(getattr, args)
    return Layout.of(args.strategy, sizes, remat=get("remat", None), micro_batch_size=get("micro_batch_size", None) or 1,
                     grad_accum=get("grad_accum", 1), schedule=get("schedule", None),
                     microbatches=get("microbatches", None), virtual=get("virtual", None),
                     stage_remat=get("stage_remat", None), precision=get("precision", None) or "fp32",
                     reduce=get("grad_reduce", None))


def add_layout(parser) -> None:
    """--layout LINE: a layout as `jshard plan --search` prints it (`jshard.layout`), in place of
    the flags it sets, which may not be given beside it."""
    parser.add_argument("--layout", metavar="LINE", type=_layout,
                        help="a layout line as `jshard plan --search` prints it, e.g. 'dp+tp data=2,tensor=4 remat=full "
                             "mb=2 accum=4': sets --strategy, --mesh, --remat and the rest it names")
    parser.set_defaults(_flag_defaults={dest: parser.get_default(dest) for dest in LAYOUT_DESTS.values()})


# A library error names what it checks by its Python field (`Layout.grad_accum`,
# `TrainConfig.batch_size`); the command line says the flag that sets it.
FIELD_FLAGS = {"Layout.reduce": "--grad-reduce", "Layout.mesh_text": "--mesh", "Layout.strategy": "--strategy"}
_FIELD = re.compile(r"\b(Layout|PlanInput|TrainConfig|DecoderConfig|GenerateConfig)\.([a-z_]+)\b")


def spoken(message: str) -> str:
    """`message` with each config field it names (`Layout.grad_accum`) as the flag that sets it."""
    return _FIELD.sub(lambda m: FIELD_FLAGS.get(m[0], "--" + m[2].replace("_", "-")), message)


def _layout(text: str) -> Layout:
    try:
        return Layout.parse(text)
    except LayoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def with_layout(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --layout's fields set (those the command has); one line if a flag it sets was
    given too."""
    layout = getattr(args, "layout", None)
    if layout is None:
        return args
    defaults, unset = args._flag_defaults, Layout(layout.strategy)
    # what the line names: the strategy and the mesh, and each field it gives (not at its default)
    taken = {dest: getattr(layout, field) for field, dest in LAYOUT_DESTS.items() if hasattr(args, dest)
             and (field in ("strategy", "mesh_text") or getattr(layout, field) != getattr(unset, field))}
    given = [dest for dest in taken if getattr(args, dest) != defaults.get(dest)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise FlagError(f"--layout sets {flag} itself; {flag} {getattr(args, given[0])} was given too. "
                        f"Fix: drop {flag}, or change it in the layout line.")
    dropped = [f"{key}={getattr(layout, field)}" for field, (key, _) in KEYS.items()
               if LAYOUT_DESTS[field] not in taken and getattr(layout, field) != getattr(unset, field)]
    if dropped:
        raise FlagError(f"--layout {layout}: {', '.join(dropped)} is not this command's to set. "
                        f"Fix: drop it from the line (e.g. mb: jshard train takes --batch-size rows a step).")
    return argparse.Namespace(**vars(args) | taken)
