"""`jshard train`: a sharded GPT training run, on the text shipped with jshard or your own.

    jshard train                                   # small GPT, 8 fake CPU devices (or the local GPUs)
    jshard train --strategy zero3+tp --mesh fsdp=4,tensor=2 --precision bf16 --remat selective
    jshard train --data notes.txt --tokenizer bpe --eval-every 50 --plot curves.png
    jshard train --checkpoint-dir runs/a --checkpoint-every 50 ... ; jshard train ... --resume

One run: check every input (no device work until all are valid) -> print the set-up ->
place the model and the AdamW state by the strategy's rules (`jshard.init`, `build_step`)
-> restore a checkpoint onto them when resuming -> train: each step one global batch,
split over the batch axes, each shard's rows cut into `grad_accum` micro-batches whose gradients
the step adds up before its one reduction and update (`build_step(grad_accum=)`; and into
pipeline micro-batches); every `eval_every` steps the loss on held-out
rows, forward only (`step.loss`) -> save checkpoints (and the tokenizer beside them) ->
print a summary, and draw the curves (`curves.py`).

The parts live beside this module: `data.py` (files, memory maps, split, order,
per-process rows), `tokenizer.py` (bytes or BPE), `optim.py` (AdamW, schedule, sharded
clipping), `checkpoint.py` (orbax), `metrics.py` (FLOPs, peak, MFU, metrics file); the
step is `jshard.parallel.build_step`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import jshard
from jshard.app import data, hf, optim
from jshard.app import curves
from jshard.app import tokenizer as tokenizers
from jshard.app.checkpoint import CheckpointError, Checkpoints
from jshard.app.config import MODEL_FIELDS, model_config
from jshard.distributed import axes_across_processes, initialize, is_main_process
from jshard.mesh import (fake_device_count, mesh_shape, mesh_sizes, use_fake_cpu_devices_unless_accelerated,
                         use_gpu_xla_flags, xla_flags_line)
from jshard.metrics import PROFILE_STEPS, MetricsFile, device_memory, device_peak, flops_per_token
from jshard.nn import attention_implementation
from jshard.models import SIZES, DecoderConfig, decoder, gpt_loss
from jshard.models.stack import REMAT_POLICIES
from jshard.layout import Layout
from jshard.parallel import Plan, ShardedStep, TrainState, make_plan
from jshard.parallel.step_plan import step_mesh
from jshard.parallel.step import step_from_plan
from jshard.parallel.pipelining import STAGE_REMAT
from jshard.placement import describe, format_bytes
from jshard.planner import search as plan_search
from jshard.planner.estimate import KINDS, hardware_of
from jshard.precision import PRECISIONS, REDUCE_DTYPES, precision

FAKE_DEVICES = 8  # CPU devices faked when no accelerator is present (--fake-devices), unless XLA_FLAGS gives a count
PIPELINE_MICROBATCHES = 4  # when the strategy pipelines and --microbatches is not given


SEQ_LEN = 64  # tokens per row where --seq-len is not given (the model's, where it takes fewer)


class TrainError(ValueError):
    """A training run that cannot start as asked."""


@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on; `jshard train`'s flags and its --config JSON mirror it."""

    model: str = "small"
    init_from: str | None = None  # a Hugging Face model directory: its config, weights and tokenizer (jshard.app.hf)
    data: str | None = None  # None: the shipped corpus; text (a file, a folder of *.txt), ids (.bin, .npy), or documents (.jsonl, .parquet, a save_to_disk folder)
    text_field: str = "text"  # the documents' field holding the text (JSONL key, Parquet / Arrow column)
    tokenizer: str | None = None  # of text: bytes, or bpe (trained on the data); None: the checkpoint's, or bytes
    eval_every: int | None = None  # None: no evaluation
    eval_batches: int | None = None  # held-out batches (of batch_size // grad_accum rows) per evaluation; None: all, up to 8
    eval_split: float = 0.1  # the fraction of the tokens held out, never trained on
    plot: str | None = None  # a PNG of the curves, drawn at the end
    layers: int | None = None  # None: the named model's; these override its sizes
    embed: int | None = None
    heads: int | None = None
    kv_heads: int | None = None  # a Llama's
    mlp: int | None = None
    vocab: int | None = None
    experts: int | None = None  # a Llama's mixture of experts (jshard.moe)
    moe_every: int | None = None
    attention: str | None = None  # None: the model's (auto: cuDNN flash on a GPU in bf16, else XLA)
    mesh: str | None = None  # None: the strategy's default mesh over the devices (mesh.default_mesh)
    strategy: str = "dp+fsdp+tp"
    schedule: str | None = None  # pipeline schedule; None: build_step's default (GPipe)
    virtual: int | None = None  # virtual stages per device, interleaved schedule
    stage_remat: str | None = None  # what a pipeline stage keeps for its backward; None: its residuals ("none")
    microbatches: int | None = None  # pipeline micro-batches; None: 4 when the strategy pipelines
    steps: int = 400
    batch_size: int = 16
    seq_len: int | None = None  # None: SEQ_LEN, or the model's when shorter
    lr: float = 3e-3
    warmup: int | None = None  # None: steps // 10
    precision: str = "fp32"  # jshard.precision: fp32, bf16 (compute), mixed (bf16 params, fp32 master), fp8
    grad_reduce: str | None = None  # the gradient reduction's dtype; None: the precision's
    grad_accum: int = 1
    remat: str = "none"
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # None: only at the end
    resume: bool = False
    metrics: str | None = None
    tensorboard: str | None = None  # a folder of TensorBoard event files: the metrics file's numbers
    profile: str | None = None
    seed: int | None = None  # None: 0, or the checkpoint's when resuming
    fake_devices: int | None = None  # None: XLA_FLAGS's count, else FAKE_DEVICES
    peak_tflops: float | None = None  # per device, for MFU where jshard does not know the device
    log_every: int | None = None  # None: steps // 10
    skip_nonfinite: int = 0  # updates of non-finite gradients skipped in a row before the run stops (0: stop at the first)

    def layout(self, sizes: dict[str, int]) -> Layout:
        """The run's layout, whole (`jshard.Layout`), on mesh `sizes` (its `mesh` resolved over the
        devices: `mesh.mesh_sizes`)."""
        return Layout.of(self.strategy, sizes, remat=self.remat, grad_accum=self.grad_accum, schedule=self.schedule,
                         microbatches=self.microbatches, virtual=self.virtual, stage_remat=self.stage_remat,
                         precision=self.precision, reduce=self.grad_reduce)


@dataclasses.dataclass
class TrainResult:
    losses: list[float]  # one per step run here
    first_step: int  # the step the run started from (0, or the checkpoint's)
    summary: str
    eval_losses: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> held-out loss
    grad_norms: list[float] = dataclasses.field(default_factory=list)  # each step's gradients' global norm, clipped from


# -- checks, before any device work ------------------------------------------------------


REQUIRED_INTS = ("steps", "batch_size", "grad_accum")
OPTIONAL_INTS = ("fake_devices", "seq_len", "microbatches", "virtual", "checkpoint_every", "log_every", "eval_every",
                 "eval_batches") + MODEL_FIELDS
EVAL_BATCHES = 8  # at most, where --eval-batches is not given
CHOICES = {"model": SIZES, "precision": PRECISIONS, "remat": REMAT_POLICIES}
OPTIONAL_CHOICES = {"grad_reduce": REDUCE_DTYPES, "stage_remat": STAGE_REMAT, "tokenizer": tokenizers.KINDS}


def _check_values(config: TrainConfig) -> None:
    """Numbers and names of `config`, as the flags name them."""

    def flag(name):
        return "--" + name.replace("_", "-")

    def positive(value, kind) -> bool:
        return isinstance(value, kind) and not isinstance(value, bool) and value > 0

    for name in REQUIRED_INTS + OPTIONAL_INTS:
        value = getattr(config, name)
        if not positive(value, int) and (value is not None or name in REQUIRED_INTS):
            raise TrainError(f"{flag(name)} must be a positive int, got {value!r}")
    for name in ("lr", "peak_tflops"):
        value = getattr(config, name)
        if not positive(value, (int, float)) and (value is not None or name == "lr"):
            raise TrainError(f"{flag(name)} must be a positive number, got {value!r}")
    if isinstance(config.skip_nonfinite, bool) or not (isinstance(config.skip_nonfinite, int) and config.skip_nonfinite >= 0):
        raise TrainError(f"--skip-nonfinite must be an int >= 0, got {config.skip_nonfinite!r}")
    if config.warmup is not None and not (isinstance(config.warmup, int) and 0 <= config.warmup < config.steps):
        raise TrainError(f"--warmup must be an int in 0..steps-1 ({config.steps - 1}), got {config.warmup!r}")
    for name, known in [*CHOICES.items(), *OPTIONAL_CHOICES.items()]:
        if getattr(config, name) not in known and (getattr(config, name) is not None or name in CHOICES):
            raise TrainError(f"unknown {flag(name)} {getattr(config, name)!r}; choose one of {', '.join(known)}")
    if not (isinstance(config.text_field, str) and config.text_field):
        raise TrainError(f"--text-field must name a field, got {config.text_field!r}. Fix: e.g. --text-field text.")
    if config.checkpoint_dir is None and (config.resume or config.checkpoint_every):
        raise TrainError("--resume and --checkpoint-every need --checkpoint-dir DIR")
    if isinstance(config.eval_split, bool) or not (isinstance(config.eval_split, (int, float))
                                                   and 0 <= config.eval_split < 1):
        raise TrainError(f"--eval-split must be a fraction in [0, 1), got {config.eval_split!r}")
    if config.init_from is not None:
        if given := [flag(f) for f in MODEL_FIELDS + ("tokenizer",) if getattr(config, f) is not None]:
            raise TrainError(f"--init-from {config.init_from} gives the model and its tokenizer; {given[0]} would "
                             f"change them. Fix: drop {', '.join(given)}.")
    if config.plot is not None:
        try:
            curves.check_output_path(config.plot)
        except curves.PlotError as e:
            raise TrainError(f"--plot {e}") from None
    for name, folder in (("metrics", os.path.dirname(config.metrics or "") or "."), ("tensorboard", config.tensorboard),
                         ("profile", config.profile)):
        if getattr(config, name) is not None:
            _make_folder(flag(name), getattr(config, name), folder)


def _make_folder(flag: str, value: str, folder: str) -> None:
    """The folder an output flag writes into, made now: before any device work, not after set-up."""
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "permission denied")
    except OSError as e:
        raise TrainError(f"{flag} {value}: cannot write into {folder} ({e.strerror.lower()}). "
                         f"Fix: a path in a folder you can write to.") from None


@dataclasses.dataclass
class Setup:
    """A checked run: what it trains, where, on which data."""

    config: TrainConfig
    model: DecoderConfig
    seq_len: int
    plan: Plan  # the step's layouts, axes and pipeline, every check of them done
    checkpoints: Checkpoints | None
    record: dict | None  # the checkpoint resumed from
    seed: int
    data: data.Data
    split: data.Split  # the training stream and the held-out windows
    auto: str | None = None  # `--strategy auto`: what the search picked, and why

    # What the run reads of its plan.
    mesh = property(lambda self: self.plan.mesh)
    rules = property(lambda self: self.plan.rules)
    precision = property(lambda self: self.plan.precision)
    microbatches = property(lambda self: self.plan.microbatches)
    batch_axes = property(lambda self: self.plan.batch_axes)


def _model_identity(model: DecoderConfig) -> dict:
    """What a checkpoint must match to be this model's: the architecture, not how it computes."""
    return {k: v for k, v in dataclasses.asdict(model).items() if k not in ("dtype", "remat", "attention")}


def set_up(config: TrainConfig) -> Setup:
    """Check every input and the checkpoint dir; raises before any device work."""
    _check_values(config)
    use_gpu_xla_flags()  # on GPUs, beside the user's XLA_FLAGS (theirs win): before JAX starts its backends
    initialize()  # a multi-process run (jshard launch, srun, mpirun): join it; one process: nothing
    use_fake_cpu_devices_unless_accelerated(fake_device_count(config.fake_devices, FAKE_DEVICES))
    overrides = {f: getattr(config, f) for f in MODEL_FIELDS + ("attention",) if getattr(config, f) is not None}
    if _tokenizer_kind(config) == "bpe" and not config.init_from:  # the model's vocab is the BPE's size: the one it was trained with
        overrides.setdefault("vocab", _resumed(config, "vocab") or tokenizers.BPE_VOCAB)
    policy = precision(config.precision, config.grad_reduce)
    if config.init_from:  # the model the directory's config.json describes
        try:
            model = dataclasses.replace(hf.model_config(hf.read_config(config.init_from), config.init_from),
                                        remat=config.remat, **overrides)
        except hf.HFError as e:
            raise TrainError(f"--init-from {e}") from None
        config = dataclasses.replace(config, model=os.path.basename(os.path.normpath(config.init_from)))
    else:
        model = model_config(config.model, overrides, remat=config.remat)  # computes in the step's precision
    try:
        attention_implementation(model.attention, policy.compute, model.head_dim)
    except ValueError as e:
        raise TrainError(f"--attention {model.attention}: {e}") from None
    seq_len = config.seq_len or min(SEQ_LEN, model.seq_len)
    if seq_len > model.seq_len and not hasattr(model, "rope_theta"):  # a learned position table ends at seq_len
        raise TrainError(
            f"--seq-len {seq_len} is longer than model {config.model!r} takes ({model.seq_len}, its position "
            f"embeddings). Fix: --seq-len {model.seq_len} or less, or a larger --model."
        )
    # Rotary positions are computed, not looked up: the model takes what the run asks (and memory holds).
    model = dataclasses.replace(model, seq_len=max(seq_len, model.seq_len))
    auto = None
    if config.strategy == AUTO:
        config, auto = _auto_layout(config, dataclasses.replace(model, seq_len=seq_len))
    layout = config.layout(mesh_sizes(config.mesh, jshard.preset(config.strategy), jax.device_count()))
    model = layout.model(model)  # a vocabulary the layout's split does not divide: its table padded,
    if resumed_multiple := _resumed(config, "vocab_multiple"):  # a resumed run's as its checkpoint's was
        model = dataclasses.replace(model, vocab_multiple=resumed_multiple)
    # The step's plan, on the model's shapes: every check of the strategy, mesh and batch, once.
    plan = make_plan(nnx.eval_shape(lambda: decoder(model, nnx.Rngs(0))), layout, step_mesh(layout),
                     loss_fn=gpt_loss, default_microbatches=PIPELINE_MICROBATCHES)
    plan.check_batch(config.batch_size, seq_len, rows_name="TrainConfig.batch_size", seq_name="TrainConfig.seq_len",
                     name_accum=True)
    checkpoints, record = None, None
    if config.checkpoint_dir:
        checkpoints = Checkpoints(config.checkpoint_dir)
        try:
            # The tokenizer's kind too: ids of another tokenizer would mean nothing to this model.
            kind = _tokenizer_kind(config)
            if config.data and config.data.endswith(data.TOKEN_FILES) and not (config.init_from and kind == "bpe"):
                kind = "ids"  # (an imported model's token file holds its tokenizer's ids: the run keeps that tokenizer)
            record = checkpoints.check({"model": _model_identity(model), "tokenizer": {"kind": kind}},
                                       bool(config.resume))
            if record and record["step"] >= config.steps:
                raise TrainError(
                    f"--resume: the checkpoint in {checkpoints.directory} is at step {record['step']}, and --steps "
                    f"is {config.steps}: nothing to train. Fix: raise --steps above {record['step']}."
                )
        except Exception:
            checkpoints.close()
            raise
    seed = config.seed if config.seed is not None else (record["seed"] if record else 0)
    try:
        tokens = _data(config, model, record)
        split = _split(config, tokens, seq_len, seed, record, config.batch_size // config.grad_accum)
    except Exception:
        if checkpoints:
            checkpoints.close()
        raise
    return Setup(config, model, seq_len, plan, checkpoints, record, seed, tokens, split, auto)


# `--strategy auto`: the layout `jshard plan --search` ranks first for this run's devices.
AUTO = "auto"


def _auto_layout(config: TrainConfig, model: DecoderConfig) -> tuple[TrainConfig, str]:
    """`config` with the search's best layout for `model` on this run's devices (the planner's
    profile of their kind: `plan.search`): strategy, mesh, accumulation, pipeline; and a line
    saying what was picked. Its remat is the run's own (`--remat`)."""
    fixed = [f for f in ("mesh", "schedule", "microbatches", "virtual") if getattr(config, f) is not None]
    if fixed:
        raise TrainError(f"TrainConfig.strategy auto chooses the layout, but TrainConfig.{fixed[0]} "
                         f"{getattr(config, fixed[0])} fixes part of it. Fix: drop TrainConfig.{fixed[0]}, or name a "
                         "strategy (e.g. dp+tp).")
    if config.grad_accum != 1:
        raise TrainError(f"TrainConfig.strategy auto chooses the accumulation, but TrainConfig.grad_accum "
                         f"{config.grad_accum} fixes it. Fix: drop TrainConfig.grad_accum, or name a strategy.")
    hw = hardware_of(jax.devices()[0])
    if hw is None:
        raise TrainError(f"TrainConfig.strategy auto: the planner has no profile of a {jax.devices()[0].device_kind}. "
                         f"Fix: name a strategy and TrainConfig.mesh (profiles: {', '.join(KINDS)}, CPU).")
    best, line = plan_search.pick(model, jax.device_count(), hw, config.batch_size, config.precision, config.grad_reduce,
                                  config.remat)
    picked = best.layout
    config = dataclasses.replace(config, strategy=picked.strategy, mesh=picked.mesh_text, grad_accum=picked.grad_accum,
                                 schedule=picked.schedule, microbatches=picked.microbatches, virtual=picked.virtual)
    return config, f"auto: {line}"


def _context_line(p: Setup) -> str:
    """How context parallelism splits each row, for the set-up's batch line ('' without it)."""
    axes, n = p.plan.context_axes, p.plan.context_shards
    if not axes:
        return ""
    return (f"; each row over {'+'.join(axes)} ({n} devices × 2 chunks of {p.seq_len // (2 * n)} tokens, "
            f"load-balanced; {p.rules.context_attention} attention)")


def _tokenizer_kind(config: TrainConfig) -> str:
    """--tokenizer, or where not given: a resumed run's (a BPE beside its checkpoints), else bytes."""
    if config.tokenizer:
        return config.tokenizer
    if config.init_from:  # the imported model's own
        return "bpe" if os.path.exists(os.path.join(config.init_from, tokenizers.FILE)) else "bytes"
    saved = config.resume and os.path.exists(os.path.join(config.checkpoint_dir, tokenizers.FILE))
    return "bpe" if saved else "bytes"


def _resumed(config: TrainConfig, field: str):
    """A model field of the checkpoint a run resumes (None: none to resume, or unreadable; the
    checkpoint checks below say why)."""
    if not config.resume:
        return None
    with Checkpoints(config.checkpoint_dir) as checkpoints:
        step = checkpoints.latest_step()
        try:
            return step and checkpoints.record(step)["model"].get(field)
        except (CheckpointError, KeyError, TypeError, AttributeError):
            return None


def _data(config: TrainConfig, model: DecoderConfig, record: dict | None) -> data.Data:
    """The run's tokens: a resumed run's with the tokenizer saved beside its checkpoints,
    which must be the one the checkpoint was trained with; every id inside the model's vocab."""
    kind = _tokenizer_kind(config)
    beside = config.checkpoint_dir if record else config.init_from  # a resumed run's, or the imported model's
    saved = tokenizers.load(beside) if beside and kind == "bpe" else None
    try:
        tokens = data.load(config.data, kind, model.vocab, saved, config.text_field)
    except (data.DataError, tokenizers.TokenizerError) as e:
        raise TrainError(str(e)) from None
    trained = record and record.get("tokenizer", tokenizers.ByteTokenizer().identity())
    if trained and tokens.tokenizer_identity != trained:
        raise TrainError(
            f"--resume: the checkpoint in {config.checkpoint_dir} was trained with tokenizer {trained}, this run "
            f"would use {tokens.tokenizer_identity}. Fix: resume with --tokenizer {trained['kind']} and the "
            f"{tokenizers.FILE} the run saved beside its checkpoints, or start afresh in another --checkpoint-dir."
        )
    if tokens.max_id >= model.vocab and config.init_from:
        raise TrainError(
            f"--data {config.data}: token id {tokens.max_id} is outside the vocab of {config.init_from} "
            f"({model.vocab}: ids 0..{model.vocab - 1}). Fix: ids made by that model's tokenizer, or another model."
        )
    if tokens.max_id >= model.vocab:
        raise TrainError(
            f"--data {config.data or data.CORPUS}: token id {tokens.max_id} is outside the model's vocab of "
            f"{model.vocab} (ids 0..{model.vocab - 1}). Fix: --vocab {tokens.max_id + 1} or more (a multiple of 64 "
            "splits best), or a model whose vocab covers the data."
        )
    if record and record.get("data", tokens.identity) != tokens.identity:
        raise TrainError(
            f"--resume: the checkpoint was trained on {record['data']}, this run reads {tokens.identity}; its data "
            "position would point at other rows. Fix: resume with the same --data, or start afresh in another "
            "--checkpoint-dir."
        )
    return tokens


def _split(config: TrainConfig, tokens: data.Data, seq_len: int, seed: int, record: dict | None,
           rows: int) -> data.Split:
    """Held-out and training tokens; an evaluation needs --eval-batches × `rows` held-out windows."""
    fraction = record.get("eval_split", config.eval_split) if record else config.eval_split
    if record and fraction != config.eval_split:
        raise TrainError(f"--resume: the checkpoint held out --eval-split {fraction}, this run {config.eval_split}; "
                         f"the training rows would differ. Fix: --eval-split {fraction}.")
    try:
        split = data.split(tokens.tokens, seq_len, seed, fraction)
    except data.DataError as e:
        raise TrainError(f"--seq-len {seq_len}: {e}") from None
    batches = config.eval_batches or max(1, min(EVAL_BATCHES, split.eval_windows // rows))
    if config.eval_every and split.eval_windows < batches * rows:
        raise TrainError(
            f"--eval-every: the held-out split ({config.eval_split:g} of {len(tokens.tokens):,} tokens = "
            f"{len(split.eval):,}) holds {split.eval_windows} rows of {seq_len + 1} tokens; {batches} batch"
            f"{'es' if batches > 1 else ''} of {rows} rows need{'' if batches > 1 else 's'} {batches * rows}. Fix: "
            + ("fewer --eval-batches, " if batches > 1 else "") + "a larger --eval-split, a shorter --seq-len, "
            "a smaller --batch-size, or more data."
        )
    return dataclasses.replace(split, batches=batches)


# -- the run -----------------------------------------------------------------------------


def _portable(step: ShardedStep, state: TrainState) -> dict:
    """What a checkpoint holds: the params at full precision (the fp32 master under `mixed`),
    so it restores under any --precision, and the optimizer's state (gradient accumulation
    keeps none: the step adds up its micro-batches itself), so under any --grad-accum; in the
    model's layer order (`ShardedStep.to_model_order`), so under any pipeline schedule."""
    return {"params": step.full_params(state), "opt_state": state.opt_state}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _fmt_count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f}"


def _setup_lines(p: Setup, abstract_model, abstract_opt) -> list[str]:
    c, m = p.config, p.model
    params = describe(abstract_model, p.mesh, p.rules)
    opt = describe(abstract_opt, p.mesh, p.rules, "opt")
    count = sum(math.prod(r.shape) for r in params.rows)
    per_device = sum(r.bytes_per_device // r.dtype.itemsize for r in params.rows)
    held = p.precision.param.itemsize
    master = ""
    if p.precision.master:  # the optimizer's copy of the params, in the opt layout
        sharded = describe(abstract_model, p.mesh, p.rules, "opt").rows
        master_bytes = sum(r.bytes_per_device // r.dtype.itemsize * p.precision.master.itemsize for r in sharded)
        master = f"{p.precision.master.name} master {format_bytes(master_bytes)}, "
    mesh = " ".join(f"{k}={v}" for k, v in mesh_shape(p.mesh).items())
    pipeline = ""
    if p.microbatches:
        pipeline = (f", schedule {c.schedule or 'gpipe'} over {p.microbatches} micro-batches, stage remat "
                    f"{c.stage_remat or 'none'}")
    lines = [
        f"model       {m.family} {c.model}: {m.layers} layers, embed {m.embed}, {m.heads} heads"
        f"{f' ({m.kv_heads} kv)' if hasattr(m, 'kv_heads') else ''}, mlp {m.mlp}, "
        f"{_fmt_count(count)} params, vocab {m.vocab}"
        + (f" (table {m.vocab_rows}: padded to split, the pad never a token)" if m.vocab_rows != m.vocab else "")
        + _experts_line(m),
        f"devices     {jax.device_count()} × {jax.devices()[0].device_kind}, mesh {mesh}" + _processes(p.mesh)
        + (f"; XLA_FLAGS {xla_flags_line()}" if jax.devices()[0].platform == "gpu" else ""),
        f"strategy    {p.rules.name} (ZeRO stage {p.rules.zero}){pipeline}" + (f"; {p.auto}" if p.auto else ""),
        f"per device  {_fmt_count(per_device)} params ({format_bytes(per_device * held)} in {p.precision.param.name} "
        f"of {format_bytes(count * held)}), {master}optimizer state {format_bytes(opt.bytes_per_device)} of "
        f"{format_bytes(opt.total_bytes)}",
        f"batch       {c.batch_size} rows × {p.seq_len} tokens = {c.batch_size * p.seq_len} tokens per step "
        f"over {'+'.join(p.batch_axes) or 'no axis'}" + (f", {c.grad_accum} micro-batches accumulated" if c.grad_accum > 1 else "")
        + _context_line(p),
        f"training    {c.steps} steps, AdamW lr {c.lr:g} (warm-up {_warmup(c)}, cosine to {c.lr / 10:g}), "
        f"clip 1.0, precision {p.precision.describe()}, remat {c.remat}",
        f"data        {p.data.source}; seed {p.seed}",
        f"split       {len(p.split.train.tokens):,} tokens to train on ({p.split.train.windows:,} rows of {p.seq_len + 1}), "
        f"{len(p.split.eval):,} held out ({c.eval_split:g})" + (
            f", evaluated every {c.eval_every} steps on {p.split.batches} × {c.batch_size // c.grad_accum} rows"
            if c.eval_every else ", not evaluated (--eval-every N)"),
    ]
    lines += [f"! {row.path}: {flag}" for row in params.flagged for flag in row.flags]
    return lines


def _experts_line(m: DecoderConfig) -> str:
    if not getattr(m, "experts", 0):
        return ""
    slots = "dropless" if m.capacity_factor is None else f"capacity factor {m.capacity_factor:g}"
    where = "every block" if m.moe_every == 1 else f"one block in {m.moe_every}"
    return (f"; a mixture of {m.experts} experts in {where}, top-{m.top_k} routed, {slots}, "
            f"balance loss weight {m.balance_loss:g}")


def _processes(mesh) -> str:
    """', 2 processes × 4 devices, across processes: data' in a multi-process run."""
    if jax.process_count() == 1:
        return ""
    across = axes_across_processes(mesh)
    return (f", {jax.process_count()} processes × {jax.local_device_count()} devices, across processes: "
            f"{', '.join(across) or 'none'}")


def _warmup(config: TrainConfig) -> int:
    return config.warmup if config.warmup is not None else config.steps // 10


def train(config: TrainConfig, out=None) -> TrainResult:
    """Run `config`; prints the set-up, progress and a summary to `out` (default: stdout, on
    process 0 only in a multi-process run; every process returns the result)."""
    p = set_up(config)
    quiet = open(os.devnull, "w") if out is None and not is_main_process() else None
    try:
        return _train(p, out or quiet or sys.stdout)
    finally:
        if quiet:
            quiet.close()
        if p.checkpoints:
            p.checkpoints.close()  # a save in flight completes (killed, it leaves the one before)


def _start(p: Setup, tx, say) -> tuple[ShardedStep, TrainState, int, int]:
    """The step, and the state, step number and data position the run starts from."""

    def make_model():
        return decoder(p.model, nnx.Rngs(p.seed))

    abstract = nnx.eval_shape(make_model)
    say(f"jshard train: {p.model.family} {p.config.model} on {p.config.data or data.CORPUS}")
    for line in _setup_lines(p, abstract, jax.eval_shape(tx.init, nnx.state(abstract))):
        say("  " + line)
    step = step_from_plan(p.plan, jshard.init(make_model, p.mesh, p.rules), tx, gpt_loss)
    if not p.record and p.config.init_from:  # each device's blocks read from the files, in the master's dtype
        # in the model's layer order (an uneven pipeline's step holds padding rows the file has not)
        params = hf.load_params(p.config.init_from, p.model, _abstract(step.full_params(step.to_model_order(step.state))))
        say(f"  weights     from {p.config.init_from} (Hugging Face {hf.read_config(p.config.init_from)['model_type']})")
        return step, step.from_model_order(step.with_params(step.state, params)), 0, 0
    if not p.record:
        return step, step.state, 0, 0
    start, position = p.record["step"], p.record["data_position"]
    # into this step's layout, the checkpoint in the model's layer order (`_portable`)
    saved = p.checkpoints.restore(start, _abstract(_portable(step, step.to_model_order(step.state))))
    state = TrainState(None, saved["opt_state"], step.state.model_state)  # (jshard's models hold Params only)
    state = step.from_model_order(step.with_params(state, saved["params"]))
    say(f"  resumed     step {start} from {p.checkpoints.directory} (saved under {p.record['strategy']} "
        f"on {p.record['mesh']}), data position {position} rows")
    saved, now = p.record.get("schedule"), _schedule(p.config)
    if saved and saved != now:  # the optimizer's step count carries on; the schedule is this run's
        changed = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in now if saved.get(k) != now[k])
        say(f"  schedule    {changed}: from step {start + 1} the learning rate follows this run's warm-up and "
            f"cosine, not the checkpoint's run's (an uninterrupted run of {now['steps']} steps differs before it too)")
    return step, state, start, position


def _train(p: Setup, out) -> TrainResult:
    c = p.config
    say = functools.partial(print, file=out, flush=True)
    learning_rate = optim.schedule(c.lr, c.steps, _warmup(c))  # the update of optimizer step i (from 0) uses (i)
    tx = optim.adamw(learning_rate)
    step, state, start, position = _start(p, tx, say)
    stream = p.split.train
    if p.checkpoints and p.data.tokenizer and is_main_process():
        p.data.tokenizer.save(p.checkpoints.directory)  # beside the checkpoints: resume and generate read it
    batch_sharding = p.plan.batch_sharding
    # Held-out batches of one micro-batch's rows: an evaluation keeps no activations for a backward.
    micro_rows, tokens = c.batch_size // c.grad_accum, c.batch_size * p.seq_len
    flops_per_step = flops_per_token(p.model, p.seq_len) * tokens
    peak = device_peak(jax.devices(), p.precision.compute, c.peak_tflops)
    log_every = c.log_every or max(1, c.steps // 10)
    traced = _traced(c, start)
    losses, times, saved_at, evaluated, records, held_out, skipped = [], [], None, {}, [], None, []
    routed = {}  # step -> router statistics of a mixture of experts, on that step's batch
    router_stats = _router_stats(step) if getattr(p.model, "experts", 0) else None
    begin = time.perf_counter()
    bar = tqdm(range(start, c.steps), initial=start, total=c.steps, desc="train", unit="step",
               dynamic_ncols=True, mininterval=0.5,  # None: no bar where stderr is no terminal
               disable=None if is_main_process() else True)
    writes = is_main_process()  # one writer of the shared files
    with bar, contextlib.closing(MetricsFile(c.metrics if writes else None, append=bool(p.record),
                                             tensorboard=c.tensorboard if writes else None)) as metrics, \
            contextlib.ExitStack() as trace:
        for index in bar:
            if traced and index == traced.start:
                trace.enter_context(jax.profiler.trace(_profile_dir(c.profile), create_perfetto_trace=True))
            tick = time.perf_counter()
            batch = stream.batch(position, c.batch_size, batch_sharding)
            state, loss = step(state, batch)  # (--grad-accum: the step runs the micro-batches itself)
            position += c.batch_size
            loss = float(loss)  # waits for the step
            seconds = time.perf_counter() - tick
            # The update of non-finite gradients is not applied (`optim.skip_nonfinite`), so the state
            # stays finite; the run stops, or goes on for --skip-nonfinite N of them in a row.
            in_a_row = int(optim.skipped(state.opt_state))
            norm = None if in_a_row else float(optim.grad_norm(state.opt_state))  # (the clip keeps it)
            if not math.isfinite(loss) or in_a_row > c.skip_nonfinite:
                raise TrainError(_not_finite(p, index + 1, loss, in_a_row, saved_at, state))
            if in_a_row:
                skipped.append(index + 1)
            if traced and index == traced[-1]:
                trace.close()
            done = index + 1
            losses.append(loss)
            times.append(seconds)
            mfu = flops_per_step / seconds / peak.flops if peak else None
            record = dict(step=done, loss=loss, lr=float(learning_rate(index)), grad_norm=norm, step_s=seconds,
                          tokens_per_s=tokens / seconds, mfu=mfu) | device_memory() | ({"skipped": True} if in_a_row else {})
            shown = f"loss {loss:.4f}  {seconds * 1e3:8.1f} ms  {tokens / seconds / 1e3:7.1f}k tok/s" + (
                f"  MFU {mfu:6.2%}" if peak else "") + ("  (gradients not finite: update skipped)" if in_a_row else "")
            if c.eval_every and (done % c.eval_every == 0 or done == c.steps):
                # The same held-out rows every time: built once, on the devices from then on.
                held_out = held_out or [p.split.eval_batch(k, micro_rows, batch_sharding)
                                        for k in range(p.split.batches)]
                evaluated[done] = _evaluate(step, state, held_out)
                record.update(eval_loss=evaluated[done], eval_perplexity=math.exp(evaluated[done]))
                shown += f"  eval {evaluated[done]:.4f}"
            logged = done % log_every == 0 or done == c.steps or index == start or done in evaluated
            if router_stats and logged:
                routed[done] = router_stats(state, batch)
                record.update(routed[done])
                load, dropped = routed[done]["expert_load"], routed[done]["dropped"]
                shown += f"  load max {max(map(max, load)):.2f} dropped {dropped:.1%}"
            metrics.write(**record)
            records.append(record)
            bar.set_postfix_str(shown, refresh=False)
            if logged:
                bar.write(f"step {done:5d}  {shown}" + ("  (compiling)" if index == start else ""), file=out)
            if p.checkpoints and (done == c.steps or (c.checkpoint_every and done % c.checkpoint_every == 0)):
                p.checkpoints.save(done, _portable(step, step.to_model_order(state)), _record(p, done, position, loss))
                saved_at = done
    if p.checkpoints:
        p.checkpoints.wait()  # the summary names a checkpoint once it is written
    summary = _summary(p, losses, times, start, time.perf_counter() - begin, peak, flops_per_step, saved_at, evaluated,
                       routed, skipped)
    say(summary)
    if c.plot and is_main_process():
        history = curves.read_metrics(c.metrics) if c.metrics else records  # a resumed run's file has it all
        curves.metrics_png(history, c.plot, title=f"jshard train {_model_flag(c)} --strategy {p.rules.name} "
                                               f"--mesh {_mesh_str(p.mesh)}")
        say(f"  plot        {c.plot}")
    return TrainResult(losses, start, summary, evaluated, [r["grad_norm"] for r in records])


def _router_stats(step: ShardedStep):
    """(state, batch) -> a mixture of experts' router statistics on the batch's rows (`Llama.
    router_stats`), outside the step: a forward under jax.jit, the compiler placing it, on the
    state's params. Means over the MoE layers but `expert_load`, one list per layer."""
    graphdef = nnx.graphdef(step.model(step.state))

    @jax.jit
    def stats(model_state, tokens):
        routed = nnx.merge(graphdef, model_state).router_stats(tokens[:, :-1])
        return dict(balance_loss=routed["balance"].mean(), dropped=routed["dropped"].mean(),
                    expert_load=routed["load"])

    def run(state: TrainState, batch) -> dict:
        found = jax.device_get(stats(nnx.state(step.model(state)), batch))
        return dict(balance_loss=float(found["balance_loss"]), dropped=float(found["dropped"]),
                    expert_load=np.round(found["expert_load"], 4).tolist())

    return run


def _evaluate(step: ShardedStep, state: TrainState, batches: list[jax.Array]) -> float:
    """The mean loss over the held-out `batches`: forward only, in the step's layouts."""
    return float(np.mean([float(step.loss(state, batch)) for batch in batches]))


def _profile_dir(directory: str) -> str:
    """--profile DIR, or DIR/process_<i> for each process of a multi-process run."""
    return directory if jax.process_count() == 1 else os.path.join(directory, f"process_{jax.process_index()}")


def _traced(config: TrainConfig, start: int) -> range:
    """The step indices --profile traces: PROFILE_STEPS after the compiling one, where there are."""
    first = start + 1 if config.steps - start > 1 else start
    return range(first, min(first + PROFILE_STEPS, config.steps)) if config.profile else range(0)


def _record(p: Setup, step: int, position: int, loss: float) -> dict:
    """The JSON saved with a checkpoint: what resuming needs, and what it was saved under."""
    return dict(step=step, data_position=position, model=_model_identity(p.model), family=p.model.family,
                seed=p.seed, loss=loss, strategy=p.rules.name, mesh=_mesh_str(p.mesh), batch_size=p.config.batch_size,
                seq_len=p.seq_len, precision=p.config.precision, data=p.data.identity, eval_split=p.config.eval_split,
                tokenizer=p.data.tokenizer_identity, schedule=_schedule(p.config))


def _schedule(c: TrainConfig) -> dict:
    """The learning-rate schedule's inputs (warm-up, then cosine over `steps`)."""
    return dict(steps=c.steps, lr=c.lr, warmup=_warmup(c))


def _not_finite(p: Setup, step: int, loss: float, in_a_row: int, saved_at: int | None, state) -> str:
    """The line a run stops with at its first non-finite loss, or at non-finite gradients (more
    than --skip-nonfinite in a row; their updates were not applied): nothing after it is saved.
    `state`: after that step, whose non-finite update was not applied."""
    c = p.config
    kept = (f"the last checkpoint, step {saved_at or p.record['step']} in {c.checkpoint_dir}, is kept"
            if saved_at or p.record else "no checkpoint was written")
    if step == (p.record["step"] + 1 if p.record else 1) and not math.isfinite(loss):  # before any update
        started = (f"checkpoint step {p.record['step']}" if p.record else c.init_from) or "the random init"
        if all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(state.params)):  # the forward overflowed
            fix = "--precision fp32, or other weights" if c.precision != "fp32" else "other weights or data"
            return (f"step {step}: the loss is {loss} at the first step, before any update, though the params it "
                    f"started from ({started}) are finite: the forward overflows in {c.precision}; training stopped, "
                    f"{kept}. Fix: {fix}.")
        return (f"step {step}: the loss is {loss} at the first step, before any update: the params it started from "
                f"({started}) are not finite; training stopped, {kept}. Fix: start from another checkpoint (delete "
                "this one to resume from the one before), or from other weights.")
    resume = "; --resume continues from the one kept" if saved_at or p.record else ""
    if math.isfinite(loss):  # a finite loss whose gradients are not: their update was not applied
        what = (f"the gradients are not finite (the loss, {loss:.4f}, is); their update was not applied"
                if in_a_row == 1 else f"the gradients were not finite {in_a_row} steps in a row (--skip-nonfinite "
                                      f"{c.skip_nonfinite}); none of those updates was applied")
        go_on = "" if c.skip_nonfinite else "; or --skip-nonfinite N to skip up to N such steps in a row and go on"
        return (f"step {step}: {what}; training stopped, {kept}, nothing after it saved. Fix: a lower --lr (it is "
                f"{c.lr}){', --precision fp32' if c.precision != 'fp32' else ''}{go_on}{resume}.")
    return (f"step {step}: the loss is {loss} after the updates before it; training stopped, {kept}, nothing after it "
            f"saved. Fix: a lower --lr (it is {c.lr}){', --precision fp32' if c.precision != 'fp32' else ''}"
            f"{resume}.")


def _model_flag(c: TrainConfig) -> str:
    return f"--init-from {c.init_from}" if c.init_from else f"--model {c.model}"


def _mesh_str(mesh) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh_shape(mesh).items() if v > 1) or "one device"


def _summary(p: Setup, losses, times, start, wall, peak, flops_per_step, saved_at, evaluated, routed, skipped) -> str:
    c = p.config
    steady = times[1:] or times  # the first step compiles
    step_s = statistics.median(steady)
    tokens = c.batch_size * p.seq_len
    last = losses[-min(10, len(losses)):]
    lines = [
        "",
        f"summary of jshard train {_model_flag(c)} --strategy {p.rules.name} --mesh {_mesh_str(p.mesh)}",
        f"  steps       {start + 1}..{start + len(losses)} of {c.steps}, {len(losses) * tokens / 1e3:.1f} k tokens "
        f"({c.batch_size} × {p.seq_len} per step)",
        f"  loss        {losses[0]:.4f} at step {start + 1} -> {losses[-1]:.4f} at step {start + len(losses)} "
        f"(mean of the last {len(last)}: {statistics.fmean(last):.4f}; "
        f"uniform over the vocab: {math.log(p.model.vocab):.4f})",
        f"  time        {wall:.1f} s in all, first step (compiling) {times[0]:.2f} s, then {step_s * 1e3:.1f} ms "
        f"per step (median), {tokens / step_s / 1e3:.1f} k tokens/s",
    ]
    if evaluated:
        first, last_step = min(evaluated), max(evaluated)
        lines.append(f"  eval        loss {evaluated[last_step]:.4f}, perplexity {math.exp(evaluated[last_step]):.2f} at "
                     f"step {last_step} on {p.split.batches} × {c.batch_size // c.grad_accum} held-out rows"
                     + (f" (step {first}: {evaluated[first]:.4f})" if first != last_step else ""))
    if routed:
        at = max(routed)
        load = np.asarray(routed[at]["expert_load"])
        lines.append(f"  experts     load per expert (of {p.model.top_k} choices per token) {load.min():.3f}..{load.max():.3f} "
                     f"(uniform {1 / p.model.experts:.3f}), {routed[at]['dropped']:.1%} of choices dropped, balance loss "
                     f"{routed[at]['balance_loss']:.4f} (1 = balanced) at step {at}, on its batch")
    if peak:
        lines.append(f"  MFU         {flops_per_step / step_s / peak.flops:.2%}: {flops_per_step / step_s / 1e9:.2f} "
                     f"GFLOP/s of model FLOPs (6·N + attention) over a peak of {peak.flops / 1e9:.1f} GFLOP/s")
        lines.append(f"  peak        {peak.source}")
    else:
        lines.append("  MFU         not known for this device: give its peak with --peak-tflops")
    if skipped:
        lines.append(f"  skipped     {len(skipped)} update(s), their gradients not finite (--skip-nonfinite "
                     f"{c.skip_nonfinite}): step(s) {', '.join(map(str, skipped[:10]))}{' ...' if len(skipped) > 10 else ''}")
    if saved_at:
        lines.append(f"  checkpoint  step {saved_at} in {p.checkpoints.directory} (resume with --resume)")
    if c.metrics:
        lines.append(f"  metrics     {c.metrics} (one JSON object per step)")
    if c.tensorboard:
        lines.append(f"  tensorboard {c.tensorboard} (the same numbers as scalars: tensorboard --logdir {c.tensorboard})")
    if c.profile:
        traced = _traced(c, start)
        lines.append(f"  profile     {c.profile} (jax.profiler trace of steps {traced.start + 1}..{traced[-1] + 1}: "
                     "*.xplane.pb for TensorBoard's profile plugin, perfetto_trace.json.gz for ui.perfetto.dev)")
    return "\n".join(lines)
