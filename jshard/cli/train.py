"""`jshard train`: its flags, and a `TrainConfig` from them (and from --config FILE); the run is
`jshard.app.training`'s."""

from __future__ import annotations

import argparse
import json

from jshard.app import checkpoint
from jshard.app import tokenizer as tokenizers
from jshard.app import training
from jshard.cli import flags
from jshard.metrics import PROFILE_STEPS
from jshard.app.train_config import EVAL_BATCHES, FIELDS, PIPELINE_MICROBATCHES, TrainConfig, TrainError
from jshard.app.train_config import FAKE_DEVICES as TRAIN_FAKE_DEVICES


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "train", help="train a GPT on the shipped corpus (the main job)", description=training.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = TrainConfig().flat()

    def add(flag, help, **kw):
        name = flag[2:].replace("-", "_")
        shown = defaults.get(name)
        parser.add_argument(flag, default=None, help=f"{help} (default: {shown})" if shown is not None else help, **kw)

    add("--config", "JSON file of TrainConfig fields; flags given override it", metavar="FILE")
    add("--data", "a text file, a folder of *.txt files, token ids in a .bin (uint16, nanoGPT's) or .npy, or "
                  "documents: .jsonl, .parquet or a datasets.save_to_disk folder (streamed through the tokenizer into "
                  "a cached token file); token files are read through a memory map (default: the shipped corpus)",
        metavar="PATH")
    add("--text-field", "the documents' field that holds the text (a JSONL key, a Parquet or Arrow column)",
        metavar="NAME")
    add("--tokenizer", f"of text: {' or '.join(tokenizers.KINDS)} (a byte-level BPE trained on the data, of --vocab "
                       f"tokens, default {tokenizers.BPE_VOCAB}; saved beside the checkpoints)",
        choices=tokenizers.KINDS)
    add("--init-from", "fine-tune a Hugging Face model: a local directory with config.json, safetensors and "
                       "tokenizer.json (Llama 3, Mistral, Qwen2, Qwen3, Mixtral; docs/checkpoints.md); in place of "
                       "--model and the size flags", metavar="DIR")
    flags.add_model(parser, None, defaults["model"], seq_len_help="tokens per row (default: 64, or the model's longest "
                                                               "if shorter)")
    flags.add_strategy(parser, None, defaults["strategy"], auto=True)
    flags.add_mesh(parser)
    flags.add_layout(parser)
    flags.add_pipeline(parser, shown=f"{PIPELINE_MICROBATCHES} when pipelining")
    add("--steps", "optimizer steps in all (a resumed run continues to this)", type=int)
    add("--batch-size", "rows per optimizer step (global batch)", type=int)
    add("--lr", "peak learning rate", type=float)
    add("--warmup", "linear warm-up steps before the cosine decay (default: steps // 10)", type=int)
    flags.add_precision(parser, None, defaults["precision"])
    add("--grad-accum", "micro-batches per optimizer step, their gradients accumulated inside the step before one "
                        "reduction and update", type=int)
    flags.add_remat(parser, None, defaults["remat"])
    add("--checkpoint-dir", "directory of orbax checkpoints", metavar="DIR")
    add("--checkpoint-every", "save every N steps (default: at the end only)", type=int, metavar="N")
    parser.add_argument("--resume", action="store_true", default=None,
                        help="continue from the latest checkpoint in --checkpoint-dir")
    add("--eval-every", "the held-out loss every N steps and at the end (default: no evaluation)", type=int,
        metavar="N")
    add("--eval-batches", f"held-out batches per evaluation (default: all the split holds, up to {EVAL_BATCHES})",
        type=int, metavar="K")
    add("--eval-split", "fraction of the data held out for evaluation, never trained on", type=float)
    add("--metrics", "write one JSON object per step to FILE", metavar="FILE")
    add("--tensorboard", "also write the step's numbers as TensorBoard scalars to DIR", metavar="DIR")
    add("--plot", "draw loss, eval loss, tokens/s and MFU over steps to FILE.png at the end", metavar="FILE.png")
    add("--profile", f"write a jax.profiler trace of {PROFILE_STEPS} steps to DIR", metavar="DIR")
    add("--seed", "model init and data order (default: 0, or the checkpoint's on --resume)", type=int)
    flags.add_fake_devices(parser, TRAIN_FAKE_DEVICES)
    add("--peak-tflops", "device peak for MFU, per device (default: known GPUs; measured on CPU)", type=float)
    add("--log-every", "print a line every N steps (default: steps // 10)", type=int, metavar="N")
    add("--skip-nonfinite", "skip the update of a step whose gradients are not finite, up to N in a row, and go "
                            "on (Megatron's behaviour); 0 stops at the first", type=int, metavar="N")
    parser.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig defaults <- the --config file <- flags given on the command line (--layout's
    fields as flags); the file and the flags name the fields flat, each goes to its section."""
    args = flags.with_layout(args)
    fields = {f.name for f in FIELDS}
    values = {}
    if args.config:
        try:
            with open(args.config) as f:
                values = json.load(f)
        except (OSError, ValueError) as e:
            raise TrainError(f"--config {args.config}: cannot read it as JSON ({e})") from e
        unknown = sorted(set(values) - fields) if isinstance(values, dict) else ["(not a JSON object)"]
        if unknown:
            raise TrainError(f"--config {args.config}: unknown field(s) {', '.join(unknown)}. "
                             f"Known: {', '.join(sorted(fields))}")
    values = {k: _as_text(k, v) for k, v in values.items()}
    wrong = [f for f in FIELDS if f.name in values and not _of_type(values[f.name], f.type)]
    if wrong:  # a JSON value of the wrong type, as a flag's: one line for them all
        raise TrainError(f"--config {args.config}: " + "; ".join(
            f"{f.name} is {json.dumps(values[f.name])}, not {_FIELD_WORDS.get(f.name) or _TYPE_WORDS[f.type]}"
            for f in wrong) + ". Fix: e.g. " + ", ".join(f'"{f.name}": {json.dumps(_example(f))}' for f in wrong) + ".")
    values.update({k: v for k, v in vars(args).items() if k in fields and v is not None})
    return TrainConfig.of(**values)


# TrainConfig's field types, as JSON must give them; a mesh and a strategy may also be given as
# JSON structures (`_as_text` turns them into the text --mesh and --strategy take).
_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}
_TYPE_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
               "int | None": "an integer or null", "float | None": "a number or null", "str | None": "a string or null"}
_FIELD_WORDS = {"mesh": 'a string ("data=2,tensor=4"), an object of axis sizes ({"data": 2, "tensor": 4}) or null',
                "strategy": 'a string ("dp+tp") or a list of strings (["dp", "tp"])'}


def _as_text(name: str, value):
    """A mesh given as {"axis": size}, a strategy as a list of parts: the text the flags take;
    anything else as it is (then checked by type)."""
    if name == "mesh" and isinstance(value, dict) and value and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items()):
        return ",".join(f"{axis}={size}" for axis, size in value.items())
    if name == "strategy" and isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return "+".join(value)
    return value


def _example(field):
    """A value of the field's type for the error: its default, or one --help would show."""
    default = field.default
    if field.name == "mesh":
        return "data=2,fsdp=2,tensor=2"
    return default if default is not None else {"int": 1, "float": 0.1, "str": "..."}[field.type.split(" ")[0]]


def _of_type(value, annotation: str) -> bool:
    kind, _, optional = annotation.partition(" | ")
    if value is None:
        return bool(optional)
    return isinstance(value, _TYPES[kind]) and (kind == "bool" or not isinstance(value, bool))


def run(args) -> int:
    config = config_from_args(args)
    if config.checkpoint.checkpoint_dir:
        checkpoint.reports_to_log()  # a failed save is one line here, not orbax's threads' tracebacks
    training.train(config)
    return 0
