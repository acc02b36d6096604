"""`TrainConfig`: a training run's inputs in sections, each read by the component it names
(`jshard.app.components`), and their checks, all before any device work.

A field keeps the name `jshard train`'s flag and its --config JSON key give it (`TrainConfig.of`
builds the sections from those flat names), so an error names the flag that sets the value.
"""

from __future__ import annotations

import dataclasses
import os

from jshard.app import curves
from jshard.app import tokenizer as tokenizers
from jshard.app.config import MODEL_FIELDS
from jshard.layout import Layout
from jshard.models import SIZES
from jshard.models.stack import REMAT_POLICIES
from jshard.parallel.tick_program import STAGE_REMAT
from jshard.precision import PRECISIONS, REDUCE_DTYPES

FAKE_DEVICES = 8  # CPU devices faked when no accelerator is present (--fake-devices), unless XLA_FLAGS gives a count
PIPELINE_MICROBATCHES = 4  # when the strategy pipelines and --microbatches is not given
SEQ_LEN = 64  # tokens per row where --seq-len is not given (the model's, where it takes fewer)
EVAL_BATCHES = 8  # at most, where --eval-batches is not given
AUTO = "auto"  # `--strategy auto`: the layout `jshard plan --search` ranks first for this run's devices


class TrainError(ValueError):
    """A training run that cannot start as asked."""


@dataclasses.dataclass
class ModelConfig:
    """What is trained: a named size and its overrides, or an imported model."""

    model: str = "small"
    init_from: str | None = None  # a Hugging Face model directory: its config, weights and tokenizer (jshard.app.hf)
    layers: int | None = None  # None: the named model's; these override its sizes
    embed: int | None = None
    heads: int | None = None
    kv_heads: int | None = None  # a Llama's
    mlp: int | None = None
    vocab: int | None = None
    experts: int | None = None  # a Llama's mixture of experts (jshard.moe)
    moe_every: int | None = None
    attention: str | None = None  # None: the model's (auto: cuDNN flash on a GPU in bf16, else XLA)

    def overrides(self) -> dict:
        """The sizes and attention given: {DecoderConfig field: value}."""
        return {f: getattr(self, f) for f in MODEL_FIELDS + ("attention",) if getattr(self, f) is not None}


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW's schedule and the non-finite guard's patience."""

    steps: int = 400
    lr: float = 3e-3
    warmup: int | None = None  # None: steps // 10
    skip_nonfinite: int = 0  # updates of non-finite gradients skipped in a row before the run stops (0: stop at the first)

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else self.steps // 10

    def schedule(self) -> dict:
        """The learning-rate schedule's inputs (warm-up, then cosine over `steps`), as a checkpoint records them."""
        return dict(steps=self.steps, lr=self.lr, warmup=self.warmup_steps)


@dataclasses.dataclass
class LayoutConfig:
    """Where and how the step runs: devices, mesh, strategy, pipeline, precision, accumulation."""

    mesh: str | None = None  # None: the strategy's default mesh over the devices (mesh.default_mesh)
    strategy: str = "dp+fsdp+tp"
    schedule: str | None = None  # pipeline schedule; None: build_step's default (GPipe)
    virtual: int | None = None  # virtual stages per device, interleaved schedule
    stage_remat: str | None = None  # what a pipeline stage keeps for its backward; None: its residuals ("none")
    microbatches: int | None = None  # pipeline micro-batches; None: 4 when the strategy pipelines
    precision: str = "fp32"  # jshard.precision: fp32, bf16 (compute), mixed (bf16 params, fp32 master), fp8
    grad_reduce: str | None = None  # the gradient reduction's dtype; None: the precision's
    grad_accum: int = 1
    remat: str = "none"
    fake_devices: int | None = None  # None: XLA_FLAGS's count, else FAKE_DEVICES

    def on(self, sizes: dict[str, int]) -> Layout:
        """The run's layout, whole (`jshard.Layout`), on mesh `sizes` (its `mesh` resolved over the
        devices: `mesh.mesh_sizes`)."""
        return Layout.of(self.strategy, sizes, remat=self.remat, grad_accum=self.grad_accum, schedule=self.schedule,
                         microbatches=self.microbatches, virtual=self.virtual, stage_remat=self.stage_remat,
                         precision=self.precision, reduce=self.grad_reduce)


@dataclasses.dataclass
class DataConfig:
    """The tokens, their order and the rows of a step."""

    data: str | None = None  # None: the shipped corpus; text (a file, a folder of *.txt), ids (.bin, .npy), or documents (.jsonl, .parquet, a save_to_disk folder)
    text_field: str = "text"  # the documents' field holding the text (JSONL key, Parquet / Arrow column)
    tokenizer: str | None = None  # of text: bytes, or bpe (trained on the data); None: the checkpoint's, or bytes
    eval_split: float = 0.1  # the fraction of the tokens held out, never trained on
    batch_size: int = 16
    seq_len: int | None = None  # None: SEQ_LEN, or the model's when shorter
    seed: int | None = None  # model init and data order; None: 0, or the checkpoint's when resuming


@dataclasses.dataclass
class CheckpointConfig:
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # None: only at the end
    resume: bool = False


@dataclasses.dataclass
class EvalConfig:
    eval_every: int | None = None  # None: no evaluation
    eval_batches: int | None = None  # held-out batches (of batch_size // grad_accum rows) per evaluation; None: all, up to 8


@dataclasses.dataclass
class LoggingConfig:
    """What the run writes besides checkpoints, and how often it prints."""

    metrics: str | None = None
    tensorboard: str | None = None  # a folder of TensorBoard event files: the metrics file's numbers
    plot: str | None = None  # a PNG of the curves, drawn at the end
    profile: str | None = None
    log_every: int | None = None  # None: steps // 10
    peak_tflops: float | None = None  # per device, for MFU where jshard does not know the device


@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on, by the component that reads it; `jshard train`'s flags and its
    --config JSON give the fields by name (`of`)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    @classmethod
    def of(cls, **fields) -> TrainConfig:
        """The config of flat fields, each put in its section; TypeError for a name none has."""
        sections = {name: {} for name in SECTIONS}
        for name, value in fields.items():
            if name not in SECTION_OF:
                raise TypeError(f"TrainConfig has no field {name!r}")
            sections[SECTION_OF[name]][name] = value
        return cls(**{name: SECTIONS[name](**values) for name, values in sections.items()})

    def replace(self, **fields) -> TrainConfig:
        """This config with flat `fields` changed."""
        return TrainConfig.of(**self.flat() | fields)

    def flat(self) -> dict:
        """{field: value} over every section, in their order."""
        return {k: v for section in dataclasses.fields(self) for k, v in vars(getattr(self, section.name)).items()}


SECTIONS = {"model": ModelConfig, "optimizer": OptimizerConfig, "layout": LayoutConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "eval": EvalConfig, "logging": LoggingConfig}
FIELDS = [field for section in SECTIONS.values() for field in dataclasses.fields(section)]  # flat, in section order
SECTION_OF = {field.name: name for name, section in SECTIONS.items() for field in dataclasses.fields(section)}


# -- checks, before any device work ------------------------------------------------------


REQUIRED_INTS = ("steps", "batch_size", "grad_accum")
OPTIONAL_INTS = ("fake_devices", "seq_len", "microbatches", "virtual", "checkpoint_every", "log_every", "eval_every",
                 "eval_batches") + MODEL_FIELDS
CHOICES = {"model": SIZES, "precision": PRECISIONS, "remat": REMAT_POLICIES}
OPTIONAL_CHOICES = {"grad_reduce": REDUCE_DTYPES, "stage_remat": STAGE_REMAT, "tokenizer": tokenizers.KINDS}


def check(config: TrainConfig) -> None:
    """Numbers and names of `config`, as the flags name them; makes the folders outputs go to."""
    c = config.flat()  # the checks run in one order over the sections: the first error is the one reported

    def flag(name):
        return "--" + name.replace("_", "-")

    def positive(value, kind) -> bool:
        return isinstance(value, kind) and not isinstance(value, bool) and value > 0

    for name in REQUIRED_INTS + OPTIONAL_INTS:
        if not positive(c[name], int) and (c[name] is not None or name in REQUIRED_INTS):
            raise TrainError(f"{flag(name)} must be a positive int, got {c[name]!r}")
    for name in ("lr", "peak_tflops"):
        if not positive(c[name], (int, float)) and (c[name] is not None or name == "lr"):
            raise TrainError(f"{flag(name)} must be a positive number, got {c[name]!r}")
    if isinstance(c["skip_nonfinite"], bool) or not (isinstance(c["skip_nonfinite"], int) and c["skip_nonfinite"] >= 0):
        raise TrainError(f"--skip-nonfinite must be an int >= 0, got {c['skip_nonfinite']!r}")
    if c["warmup"] is not None and not (isinstance(c["warmup"], int) and 0 <= c["warmup"] < c["steps"]):
        raise TrainError(f"--warmup must be an int in 0..steps-1 ({c['steps'] - 1}), got {c['warmup']!r}")
    for name, known in [*CHOICES.items(), *OPTIONAL_CHOICES.items()]:
        if c[name] not in known and (c[name] is not None or name in CHOICES):
            raise TrainError(f"unknown {flag(name)} {c[name]!r}; choose one of {', '.join(known)}")
    if not (isinstance(c["text_field"], str) and c["text_field"]):
        raise TrainError(f"--text-field must name a field, got {c['text_field']!r}. Fix: e.g. --text-field text.")
    if c["checkpoint_dir"] is None and (c["resume"] or c["checkpoint_every"]):
        raise TrainError("--resume and --checkpoint-every need --checkpoint-dir DIR")
    if isinstance(c["eval_split"], bool) or not (isinstance(c["eval_split"], (int, float)) and 0 <= c["eval_split"] < 1):
        raise TrainError(f"--eval-split must be a fraction in [0, 1), got {c['eval_split']!r}")
    if c["init_from"] is not None:
        if given := [flag(f) for f in MODEL_FIELDS + ("tokenizer",) if c[f] is not None]:
            raise TrainError(f"--init-from {c['init_from']} gives the model and its tokenizer; {given[0]} would "
                             f"change them. Fix: drop {', '.join(given)}.")
    if c["plot"] is not None:
        try:
            curves.check_output_path(c["plot"])
        except curves.PlotError as e:
            raise TrainError(f"--plot {e}") from None
    for name, folder in (("metrics", os.path.dirname(c["metrics"] or "") or "."), ("tensorboard", c["tensorboard"]),
                         ("profile", c["profile"])):
        if c[name] is not None:
            _make_folder(flag(name), c[name], folder)


def _make_folder(flag: str, value: str, folder: str) -> None:
    """The folder an output flag writes into, made now: before any device work, not after set-up."""
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "permission denied")
    except OSError as e:
        raise TrainError(f"{flag} {value}: cannot write into {folder} ({e.strerror.lower()}). "
                         f"Fix: a path in a folder you can write to.") from None
