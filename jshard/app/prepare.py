"""A training run's set-up: every input checked before any device work (`set_up`): the model,
the layout and its plan, the checkpoint a run resumes, the data and its split.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from flax import nnx

import jshard
from jshard.app import data, hf
from jshard.app import tokenizer as tokenizers
from jshard.app.checkpoint import CheckpointError, Checkpoints
from jshard.app.config import model_config
from jshard.app.startup import start_devices
from jshard.app.train_config import (AUTO, EVAL_BATCHES, FAKE_DEVICES, PIPELINE_MICROBATCHES, SEQ_LEN,
                                     CheckpointConfig, DataConfig, EvalConfig, TrainConfig, TrainError, check)
from jshard.mesh import mesh_sizes
from jshard.models import DecoderConfig, decoder, gpt_loss
from jshard.nn.attn import attention_implementation
from jshard.parallel import Plan, make_plan
from jshard.parallel.step_plan import step_mesh
from jshard.planner import search as plan_search
from jshard.planner.hardware import KINDS, hardware_of
from jshard.precision import precision


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


def model_identity(model: DecoderConfig) -> dict:
    """What a checkpoint must match to be this model's: the architecture, not how it computes."""
    return {k: v for k, v in dataclasses.asdict(model).items() if k not in ("dtype", "remat", "attention")}


def set_up(config: TrainConfig) -> Setup:
    """Check every input and the checkpoint dir; raises before any device work."""
    check(config)
    start_devices(config.layout.fake_devices, FAKE_DEVICES)
    m, lay, rows = config.model, config.layout, config.data.batch_size
    overrides = m.overrides()
    if _tokenizer_kind(config) == "bpe" and not m.init_from:  # the model's vocab is the BPE's size: the one it was trained with
        overrides.setdefault("vocab", _resumed(config.checkpoint, "vocab") or tokenizers.BPE_VOCAB)
    policy = precision(lay.precision, lay.grad_reduce)
    if m.init_from:  # the model the directory's config.json describes
        try:
            model = dataclasses.replace(hf.model_config(hf.read_config(m.init_from), m.init_from),
                                        remat=lay.remat, **overrides)
        except hf.HFError as e:
            raise TrainError(f"--init-from {e}") from None
        config = config.replace(model=os.path.basename(os.path.normpath(m.init_from)))
    else:
        model = model_config(m.model, overrides, remat=lay.remat)  # computes in the step's precision
    try:
        attention_implementation(model.attention, policy.compute, model.head_dim)
    except ValueError as e:
        raise TrainError(f"--attention {model.attention}: {e}") from None
    seq_len = config.data.seq_len or min(SEQ_LEN, model.seq_len)
    if seq_len > model.seq_len and not hasattr(model, "rope_theta"):  # a learned position table ends at seq_len
        raise TrainError(
            f"--seq-len {seq_len} is longer than model {config.model.model!r} takes ({model.seq_len}, its position "
            f"embeddings). Fix: --seq-len {model.seq_len} or less, or a larger --model."
        )
    # Rotary positions are computed, not looked up: the model takes what the run asks (and memory holds).
    model = dataclasses.replace(model, seq_len=max(seq_len, model.seq_len))
    auto = None
    if lay.strategy == AUTO:
        config, auto = _auto_layout(config, dataclasses.replace(model, seq_len=seq_len))
        lay = config.layout
    layout = lay.on(mesh_sizes(lay.mesh, jshard.preset(lay.strategy), jax.device_count()))
    model = layout.model(model)  # a vocabulary the layout's split does not divide: its table padded,
    if resumed_multiple := _resumed(config.checkpoint, "vocab_multiple"):  # a resumed run's as its checkpoint's was
        model = dataclasses.replace(model, vocab_multiple=resumed_multiple)
    # The step's plan, on the model's shapes: every check of the strategy, mesh and batch, once.
    plan = make_plan(nnx.eval_shape(lambda: decoder(model, nnx.Rngs(0))), layout, step_mesh(layout),
                     loss_fn=gpt_loss, default_microbatches=PIPELINE_MICROBATCHES)
    plan.check_batch(rows, seq_len, rows_name="TrainConfig.batch_size", seq_name="TrainConfig.seq_len",
                     name_accum=True)
    checkpoints, record = _checkpoints(config, model)
    seed = config.data.seed if config.data.seed is not None else (record["seed"] if record else 0)
    try:
        tokens = _data(config, model, record)
        split = _split(config.data, config.eval, tokens, seq_len, seed, record, rows // lay.grad_accum)
    except Exception:
        if checkpoints:
            checkpoints.close()
        raise
    return Setup(config, model, seq_len, plan, checkpoints, record, seed, tokens, split, auto)


def _checkpoints(config: TrainConfig, model: DecoderConfig) -> tuple[Checkpoints | None, dict | None]:
    """The run's checkpoints (None without a checkpoint dir), and the record of the one it resumes."""
    c = config.checkpoint
    if not c.checkpoint_dir:
        return None, None
    checkpoints = Checkpoints(c.checkpoint_dir)
    try:
        # The tokenizer's kind too: ids of another tokenizer would mean nothing to this model.
        kind = _tokenizer_kind(config)
        if config.data.data and config.data.data.endswith(data.TOKEN_FILES) and not (config.model.init_from
                                                                                     and kind == "bpe"):
            kind = "ids"  # (an imported model's token file holds its tokenizer's ids: the run keeps that tokenizer)
        record = checkpoints.check({"model": model_identity(model), "tokenizer": {"kind": kind}}, bool(c.resume))
        if record and record["step"] >= config.optimizer.steps:
            raise TrainError(
                f"--resume: the checkpoint in {checkpoints.directory} is at step {record['step']}, and --steps "
                f"is {config.optimizer.steps}: nothing to train. Fix: raise --steps above {record['step']}."
            )
    except Exception:
        checkpoints.close()
        raise
    return checkpoints, record


def _auto_layout(config: TrainConfig, model: DecoderConfig) -> tuple[TrainConfig, str]:
    """`config` with the search's best layout for `model` on this run's devices (the planner's
    profile of their kind: `plan.search`): strategy, mesh, accumulation, pipeline; and a line
    saying what was picked. Its remat is the run's own (`--remat`)."""
    lay = config.layout
    fixed = [f for f in ("mesh", "schedule", "microbatches", "virtual") if getattr(lay, f) is not None]
    if fixed:
        raise TrainError(f"TrainConfig.strategy auto chooses the layout, but TrainConfig.{fixed[0]} "
                         f"{getattr(lay, fixed[0])} fixes part of it. Fix: drop TrainConfig.{fixed[0]}, or name a "
                         "strategy (e.g. dp+tp).")
    if lay.grad_accum != 1:
        raise TrainError(f"TrainConfig.strategy auto chooses the accumulation, but TrainConfig.grad_accum "
                         f"{lay.grad_accum} fixes it. Fix: drop TrainConfig.grad_accum, or name a strategy.")
    hw = hardware_of(jax.devices()[0])
    if hw is None:
        raise TrainError(f"TrainConfig.strategy auto: the planner has no profile of a {jax.devices()[0].device_kind}. "
                         f"Fix: name a strategy and TrainConfig.mesh (profiles: {', '.join(KINDS)}, CPU).")
    best, line = plan_search.pick(model, jax.device_count(), hw, config.data.batch_size, lay.precision,
                                  lay.grad_reduce, lay.remat)
    picked = best.layout
    config = config.replace(strategy=picked.strategy, mesh=picked.mesh_text, grad_accum=picked.grad_accum,
                            schedule=picked.schedule, microbatches=picked.microbatches, virtual=picked.virtual)
    return config, f"auto: {line}"


def _tokenizer_kind(config: TrainConfig) -> str:
    """--tokenizer, or where not given: a resumed run's (a BPE beside its checkpoints), else bytes."""
    if config.data.tokenizer:
        return config.data.tokenizer
    if config.model.init_from:  # the imported model's own
        return "bpe" if os.path.exists(os.path.join(config.model.init_from, tokenizers.FILE)) else "bytes"
    c = config.checkpoint
    saved = c.resume and os.path.exists(os.path.join(c.checkpoint_dir, tokenizers.FILE))
    return "bpe" if saved else "bytes"


def _resumed(config: CheckpointConfig, field: str):
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
    d, init_from, checkpoint_dir = config.data, config.model.init_from, config.checkpoint.checkpoint_dir
    beside = checkpoint_dir if record else init_from  # a resumed run's, or the imported model's
    saved = tokenizers.load(beside) if beside and kind == "bpe" else None
    try:
        tokens = data.load(d.data, kind, model.vocab, saved, d.text_field)
    except (data.DataError, tokenizers.TokenizerError) as e:
        raise TrainError(str(e)) from None
    trained = record and record.get("tokenizer", tokenizers.ByteTokenizer().identity())
    if trained and tokens.tokenizer_identity != trained:
        raise TrainError(
            f"--resume: the checkpoint in {checkpoint_dir} was trained with tokenizer {trained}, this run "
            f"would use {tokens.tokenizer_identity}. Fix: resume with --tokenizer {trained['kind']} and the "
            f"{tokenizers.FILE} the run saved beside its checkpoints, or start afresh in another --checkpoint-dir."
        )
    if tokens.max_id >= model.vocab and init_from:
        raise TrainError(
            f"--data {d.data}: token id {tokens.max_id} is outside the vocab of {init_from} "
            f"({model.vocab}: ids 0..{model.vocab - 1}). Fix: ids made by that model's tokenizer, or another model."
        )
    if tokens.max_id >= model.vocab:
        raise TrainError(
            f"--data {d.data or data.CORPUS}: token id {tokens.max_id} is outside the model's vocab of "
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


def _split(config: DataConfig, evaluation: EvalConfig, tokens: data.Data, seq_len: int, seed: int,
           record: dict | None, rows: int) -> data.Split:
    """Held-out and training tokens; an evaluation needs --eval-batches × `rows` held-out windows."""
    fraction = record.get("eval_split", config.eval_split) if record else config.eval_split
    if record and fraction != config.eval_split:
        raise TrainError(f"--resume: the checkpoint held out --eval-split {fraction}, this run {config.eval_split}; "
                         f"the training rows would differ. Fix: --eval-split {fraction}.")
    try:
        split = data.split(tokens.tokens, seq_len, seed, fraction)
    except data.DataError as e:
        raise TrainError(f"--seq-len {seq_len}: {e}") from None
    batches = evaluation.eval_batches or max(1, min(EVAL_BATCHES, split.eval_windows // rows))
    if evaluation.eval_every and split.eval_windows < batches * rows:
        raise TrainError(
            f"--eval-every: the held-out split ({config.eval_split:g} of {len(tokens.tokens):,} tokens = "
            f"{len(split.eval):,}) holds {split.eval_windows} rows of {seq_len + 1} tokens; {batches} batch"
            f"{'es' if batches > 1 else ''} of {rows} rows need{'' if batches > 1 else 's'} {batches * rows}. Fix: "
            + ("fewer --eval-batches, " if batches > 1 else "") + "a larger --eval-split, a shorter --seq-len, "
            "a smaller --batch-size, or more data."
        )
    return dataclasses.replace(split, batches=batches)
