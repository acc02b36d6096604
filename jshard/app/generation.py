"""`jshard generate`: text from a `jshard train` checkpoint, on any mesh, with a KV cache.

    jshard generate --checkpoint-dir runs/a --prompt "The " --max-tokens 40 --temperature 0.8 --top-k 40
    jshard generate --checkpoint-dir runs/a --prompt "The " --num-samples 8 --strategy dp --mesh data=8 --fake-devices 8
    jshard generate --checkpoint-dir runs/a --prompt "The " --strategy tp --mesh tensor=4 --fake-devices 4

One run: check every input before any device work (the checkpoint, its model and tokenizer,
the prompt, the sampling, the strategy and mesh) -> restore only the params, each straight
into its shards under the strategy's rules -> prefill: the prompt through the model in one
call, filling the KV cache -> decode: one token per step inside one `lax.fori_loop`, each
step one token's work (`--no-cache`: each step runs the model over the whole window again,
the baseline the cache is measured against) -> print the samples and the time per token.

Prefill and decode are each `jax.jit` of the global computation, compiled once, as the
compiler-placed training step (`parallel/compiled.py`): params, prompts and cache are laid
out by the rules, the layers constrain their activations by their logical names, and XLA's
partitioner places the collectives. Under dp the samples split over `data`; under tp the
heads split over `tensor`, the cache's with them, so each device keeps the keys and values
of its own heads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding

import jshard
from jshard.app import hf
from jshard.app import tokenizer as tokenizers
from jshard.app.checkpoint import Checkpoints, model_of
from jshard.app.config import write_json
from jshard.app.startup import start_devices
from jshard.distributed import is_main_process
from jshard.layout import Layout
from jshard.mesh import format_mesh, mesh_shape, mesh_sizes, mesh_text
from jshard.models import DecoderConfig, decoder
from jshard.parallel.step_plan import make_plan
from jshard.rules import PRESET_PARTS, ShardingError

FAKE_DEVICES = 1  # one prompt needs no split; give more to try dp or tp on a CPU
MAX_TOKENS = 200  # when --max-tokens is not given, or fewer where the model's seq_len ends first
# Presets generation refuses, why, and what to run instead.
NOT_FOR_GENERATION = {
    "pp": ("pp splits the layers into pipeline stages, and one token at a time leaves no micro-batches to "
           "fill them", None),
    "sp": ("sp splits the sequence, and a decode step holds one token", "tp"),
    "cp": ("cp splits each sequence over devices, and a decode step holds one token", None),
    "cp-gather": ("cp-gather splits each sequence over devices, and a decode step holds one token", None),
    "cp-a2a": ("cp-a2a splits each sequence over devices, and a decode step holds one token", None),
}


class GenerateError(ValueError):
    """Generation that cannot start as asked. Raised before any device work."""


@dataclasses.dataclass
class GenerateConfig:
    """Everything a generation depends on; `jshard generate`'s flags mirror it."""

    checkpoint_dir: str | None  # a `jshard train` run's; None: --init-from's
    prompt: str
    max_tokens: int | None = None  # None: MAX_TOKENS, or as many as the model's seq_len leaves
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = None  # None: every token of the vocab
    seed: int = 0
    num_samples: int = 1
    strategy: str = "dp"
    mesh: str | None = None  # None: the strategy's default mesh over the devices
    fake_devices: int | None = None  # None: XLA_FLAGS's count, else FAKE_DEVICES
    cache: bool = True  # False: --no-cache
    step: int | None = None  # None: the latest
    json: str | None = None
    init_from: str | None = None  # a Hugging Face model directory instead of a checkpoint (jshard.app.hf)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each next token is picked from the logits."""

    max_tokens: int
    temperature: float = 0.0  # 0: the most likely token (greedy)
    top_k: int | None = None  # only the k most likely tokens (None: all)
    seed: int = 0  # the same seed draws the same tokens


@dataclasses.dataclass
class Generated:
    tokens: np.ndarray  # (samples, max_tokens) int32: the new tokens, after the prompt
    prefill_s: float  # the prompt's one call, which also picks the first new token
    decode_s: float  # the other max_tokens - 1 tokens
    compile_s: float  # both programs

    @property
    def per_token_s(self) -> float | None:
        steps = self.tokens.shape[1] - 1
        return self.decode_s / steps if steps else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.size / (self.prefill_s + self.decode_s)


# -- sampling, on the devices --------------------------------------------------------------


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """Next tokens (batch,) from last-position logits (batch, vocab): the most likely at
    temperature 0, else drawn from softmax(logits / temperature) over the top_k most likely."""
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k is not None:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


def _with_cache(batch: int, length: int, steps: int, pick):
    """Prefill and decode step over a KV cache; the carry is (new tokens so far, cache)."""

    def prefill(model, prompts, key):
        logits, cache = model.decode(prompts, model.init_cache(batch, length + steps), 0)
        tokens = jnp.zeros((batch, steps), jnp.int32)
        return tokens.at[:, 0].set(pick(logits[:, -1], key, 0)), cache

    def step(model, key, i, carry):  # token i - 1 in, token i out: one token's work
        tokens, cache = carry
        logits, cache = model.decode(lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1), cache, length + i - 1)
        return tokens.at[:, i].set(pick(logits[:, -1], key, i)), cache

    return prefill, step, lambda carry: carry[0]


def _without_cache(batch: int, length: int, steps: int, pick):
    """Prefill and decode step without a cache: the carry is the window, prompt then new
    tokens (zeros until written; causal attention keeps them from the logits read)."""

    def prefill(model, prompts, key):
        window = jnp.zeros((batch, length + steps), jnp.int32).at[:, :length].set(prompts)
        return window.at[:, length].set(pick(model(window)[:, length - 1], key, 0))

    def step(model, key, i, window):  # the whole window again, for one token
        last = lax.dynamic_index_in_dim(model(window), length + i - 1, axis=1, keepdims=False)
        return lax.dynamic_update_slice_in_dim(window, pick(last, key, i)[:, None], length + i, axis=1)

    return prefill, step, lambda window: window[:, length:]


def check_fits(prompt_tokens: int, max_tokens: int, seq_len: int) -> None:
    """The prompt and the new tokens fit in the model's longest sequence."""
    if prompt_tokens + max_tokens > seq_len:
        fixes = [f"--max-tokens {seq_len - prompt_tokens} or less" if prompt_tokens < seq_len else None,
                 f"a prompt of at most {seq_len - max_tokens} tokens" if max_tokens < seq_len else None]
        fix = ", or ".join(f for f in fixes if f)
        raise GenerateError(
            f"the prompt ({prompt_tokens} tokens) and --max-tokens {max_tokens} make {prompt_tokens + max_tokens} "
            f"tokens, more than the model's seq_len of {seq_len} (the longest sequence it was built for). "
            f"Fix: {fix}.")


def generate(model: nnx.Module, prompts: np.ndarray, sampling: Sampling, mesh, rules: jshard.Rules,
             cache: bool = True) -> Generated:
    """`sampling.max_tokens` new tokens after each row of `prompts` (samples, prompt tokens),
    by a GPT or Llama whose params are placed on `mesh` by `rules` (`load_model`)."""
    batch, length = prompts.shape
    steps = sampling.max_tokens
    check_fits(length, steps, model.config.seq_len)
    graphdef, params = nnx.split(model)  # jshard's decoders hold Params only

    def pick(logits, key, i):  # token i's draw: the same whether or not the cache is used
        return sample(logits, jax.random.fold_in(key, i), sampling.temperature, sampling.top_k)

    first, step, new_tokens = (_with_cache if cache else _without_cache)(batch, length, steps, pick)

    def prefill(params, prompts, key):
        return first(nnx.merge(graphdef, params), prompts, key)

    def decode(params, carry, key):
        def body(i, loop):
            model, carry = loop
            return model, step(model, key, i, carry)

        # The model rides in nnx's loop carry: a module from outside a JAX loop cannot be used inside it.
        return new_tokens(nnx.fori_loop(1, steps, body, (nnx.merge(graphdef, params), carry))[1])

    host = prompts
    rows = NamedSharding(mesh, rules.spec(("batch", "seq"), host.shape, mesh, "activation"))
    prompts = jax.make_array_from_callback(host.shape, rows, lambda index: host[index])  # each process its rows
    key = jax.random.key(sampling.seed)
    begin = time.perf_counter()
    with jshard.activate(mesh, rules):  # traced under the rules: layers and cache constrain by name
        prefill = jax.jit(prefill).lower(params, prompts, key).compile()
    compiled = time.perf_counter() - begin
    carry = jax.block_until_ready(prefill(params, prompts, key))
    prefill_s = time.perf_counter() - begin - compiled
    begin = time.perf_counter()
    with jshard.activate(mesh, rules):  # the tokens come back whole: every process can read them
        decode = jax.jit(decode, out_shardings=NamedSharding(mesh, jax.P())).lower(params, carry, key).compile()
    compiled += time.perf_counter() - begin
    begin = time.perf_counter()
    tokens = np.asarray(jax.block_until_ready(decode(params, carry, key)))
    return Generated(tokens, prefill_s, time.perf_counter() - begin, compiled)


# -- checks, before any device work --------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """A checked generation: which params, onto which mesh, from which prompt."""

    config: GenerateConfig
    directory: str
    step: int
    record: dict
    model: DecoderConfig
    tokenizer: tokenizers.ByteTokenizer | tokenizers.BPETokenizer
    prompt: np.ndarray  # the prompt's token ids
    sampling: Sampling
    mesh: jax.sharding.Mesh
    rules: jshard.Rules
    abstract: nnx.Module  # the model's shapes and shardings, nothing allocated


def _check_values(c: GenerateConfig) -> None:
    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for flag, value, optional in (("--max-tokens", c.max_tokens, True), ("--num-samples", c.num_samples, False),
                                  ("--fake-devices", c.fake_devices, True), ("--step", c.step, True)):
        if not (is_int(value) and value > 0) and not (optional and value is None):
            raise GenerateError(f"{flag} must be a positive int, got {value!r}")
    if not is_int(c.seed) or c.seed < 0:
        raise GenerateError(f"--seed must be an int >= 0, got {c.seed!r}")
    if not (isinstance(c.temperature, (int, float)) and math.isfinite(c.temperature) and c.temperature >= 0):
        raise GenerateError(f"--temperature must be a number >= 0 (0: always the most likely token), got "
                            f"{c.temperature!r}. Fix: e.g. --temperature 0.8.")
    if c.top_k is not None and not (is_int(c.top_k) and c.top_k > 0):
        raise GenerateError(f"--top-k must be a positive int (leave it out to sample from every token), got "
                            f"{c.top_k!r}. Fix: e.g. --top-k 40.")
    if not c.prompt:
        raise GenerateError('--prompt is empty: the model needs at least one token to continue. Fix: e.g. '
                            '--prompt "The ".')


def _open(c: GenerateConfig) -> tuple[Checkpoints, int]:
    """The run's checkpoints and the step to load; refuses a directory without one."""
    directory = os.path.abspath(c.checkpoint_dir)
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise GenerateError(f"--checkpoint-dir {directory} {what}. "
                            "Fix: point it at the directory `jshard train --checkpoint-dir DIR` wrote.")
    checkpoints = Checkpoints(directory)
    steps = checkpoints.steps()
    if not steps:
        checkpoints.close()
        raise GenerateError(f"--checkpoint-dir {directory} holds no checkpoint. Fix: point it at the directory "
                            "`jshard train --checkpoint-dir DIR` wrote, after its first save.")
    if c.step is not None and c.step not in steps:
        checkpoints.close()
        raise GenerateError(f"--step {c.step}: {directory} holds step{'s' * (len(steps) > 1)} "
                            f"{', '.join(map(str, steps))}. Fix: --step {steps[-1]} (the latest, also the default).")
    return checkpoints, steps[-1] if c.step is None else c.step


def _imported(directory: str):
    """(directory, step 0, model, tokenizer, record) of a Hugging Face model directory."""
    directory = os.path.abspath(directory)
    try:
        hf_config = hf.read_config(directory)
        model = hf.model_config(hf_config, os.path.join(directory, hf.CONFIG))
        tokenizer = tokenizers.load(directory)
    except (hf.HFError, tokenizers.TokenizerError) as e:
        raise GenerateError(f"--init-from {e}") from None
    if tokenizer.kind == "bytes" and model.vocab > tokenizer.vocab_size:  # ids past a byte would print as nothing
        raise GenerateError(f"--init-from {directory}: no {tokenizers.FILE}, and its vocab of {model.vocab} is not "
                            f"bytes' {tokenizer.vocab_size}: its tokens cannot be read as text. Fix: put the model's "
                            f"{tokenizers.FILE} in {directory}.")
    return directory, 0, model, tokenizer, {"model": dataclasses.asdict(model), "hf": hf_config["model_type"]}


def _describe(identity: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in identity.items())


def _tokenizer(directory: str, record: dict, step: int):
    """The run's tokenizer (`tokenizer.json` beside its checkpoints, or bytes), which must be
    the one its record names (a record without one is of a bytes run)."""
    try:
        tokenizer = tokenizers.load(directory)
    except tokenizers.TokenizerError as e:
        raise GenerateError(str(e)) from None
    saved = record.get("tokenizer", tokenizers.ByteTokenizer().identity())
    if saved.get("kind") not in tokenizers.KINDS:  # a run on token ids (--data FILE.bin): no text to read
        raise GenerateError(f"the checkpoint (step {step}) was trained on token ids ({_describe(saved)}), with no "
                            "tokenizer jshard can encode a text prompt with. Fix: generate from a run trained on "
                            f"text (--tokenizer {' or '.join(tokenizers.KINDS)}).")
    if tokenizer.identity() != saved:
        where = os.path.join(directory, tokenizers.FILE)
        found = f"{where} is {_describe(tokenizer.identity())}" if os.path.exists(where) else \
            f"{directory} has no {tokenizers.FILE}, which means bytes"
        fix = f"put the run's {tokenizers.FILE} back in {directory}" if saved.get("kind") != "bytes" else \
            f"delete {where}: the run used bytes"
        raise GenerateError(f"the checkpoint (step {step}) was trained with the tokenizer {_describe(saved)}, but "
                            f"{found}: its ids would mean other text. Fix: {fix}.")
    return tokenizer


def _prompt(c: GenerateConfig, tokenizer, vocab: int) -> np.ndarray:
    ids = tokenizer.encode(c.prompt)
    outside = np.flatnonzero(ids >= vocab)
    if outside.size:
        at = int(outside[0])
        shown, hint = tokenizer.decode(ids[at:at + 1]), ""
        if tokenizer.kind == "bytes":  # the character the byte is part of: alone, it may not decode
            shown = c.prompt[int(np.searchsorted(np.cumsum([len(ch.encode()) for ch in c.prompt]), at, "right"))]
            hint = f": with bytes as tokens this model reads bytes below {vocab}" + " (ASCII text)" * (vocab == 128)
        raise GenerateError(f"--prompt: token {at + 1} of {len(ids)} ({shown!r}, id {ids[at]}) is outside the model's "
                            f"vocab of {vocab} (ids 0..{vocab - 1}). Fix: a prompt without it{hint}.")
    return ids


def _rules(c: GenerateConfig) -> jshard.Rules:
    rules = jshard.preset(c.strategy)
    parts = rules.name.split("+")
    for part, (why, instead) in NOT_FOR_GENERATION.items():
        if part in parts:
            kept = {p for p in parts if p not in NOT_FOR_GENERATION} | ({instead} - {None})
            fix = "+".join(p for p in PRESET_PARTS if p in kept) or "dp"
            raise GenerateError(f"--strategy {c.strategy}: generation runs dp, zero1-3 (fsdp) and tp and their "
                                f"combinations; {why}. Fix: --strategy {fix}.")
    return rules


def _mesh(c: GenerateConfig, rules: jshard.Rules, model: DecoderConfig):
    """The mesh, plan, model and its abstract module: --mesh's, else the strategy's default mesh
    over the most devices that split the model (4 heads under tp on 8 devices: 4) and whose batch
    shards split --num-samples (one prompt on 8 devices under dp: one device), since samples are
    the only thing dp splits. A multi-process run keeps every device (each process must hold part
    of the mesh). An imported model's vocabulary is padded where the mesh splits it unevenly
    (`Layout.model`); a checkpoint's table is as it was saved."""
    counts = [jax.device_count()]
    if c.mesh is None and jax.process_count() == 1:
        counts = [n for n in range(jax.device_count(), 0, -1) if jax.device_count() % n == 0]
    found, refused = None, None
    for n in counts:  # the plan makes every check of the layouts: a dim that does not divide raises
        mesh = jshard.make_mesh(jax.devices()[:n], **mesh_sizes(c.mesh, rules, n))
        layout = Layout.of(rules, mesh)
        runs = layout.model(model) if c.init_from else model
        abstract = nnx.eval_shape(lambda: decoder(runs, nnx.Rngs(0)))
        try:
            plan = make_plan(abstract, layout, mesh)
        except ShardingError as e:  # a default mesh the model does not split: a smaller one may
            if len(counts) == 1:
                raise
            refused = refused or e
            continue
        found = mesh, plan, runs, abstract
        if c.num_samples % plan.data_shards == 0:
            break
    if found is None:
        raise refused
    return found


def set_up(c: GenerateConfig) -> Setup:
    """Check every input; raises before any device work (a GenerateError, or the mesh's,
    rules' or checkpoint's own error)."""
    _check_values(c)
    start_devices(c.fake_devices, FAKE_DEVICES)
    rules = _rules(c)
    if (c.checkpoint_dir is None) == (c.init_from is None):
        raise GenerateError("generate from --checkpoint-dir DIR (a jshard run) or --init-from DIR (a Hugging Face "
                            "model): one of them. Fix: give exactly one.")
    if c.init_from:
        directory, step, model, tokenizer, record = _imported(c.init_from)
    else:
        checkpoints, step = _open(c)
        directory = checkpoints.directory
        try:
            record = checkpoints.record(step)
        finally:
            checkpoints.close()
        model = model_of(record, os.path.join(directory, str(step)))
        tokenizer = _tokenizer(directory, record, step)
    if c.top_k is not None and c.top_k > model.vocab:
        raise GenerateError(f"--top-k {c.top_k} is more than the model's vocab of {model.vocab}. Fix: --top-k "
                            f"{model.vocab} or less, or leave it out to sample from every token.")
    prompt = _prompt(c, tokenizer, model.vocab)
    max_tokens = c.max_tokens or max(1, min(MAX_TOKENS, model.seq_len - len(prompt)))
    check_fits(len(prompt), max_tokens, model.seq_len)
    mesh, plan, model, abstract = _mesh(c, rules, model)
    if c.num_samples % plan.data_shards:
        raise GenerateError(
            f"--num-samples {c.num_samples} does not split over the {plan.data_shards} batch shards of {rules.name} "
            f"on {format_mesh(mesh_shape(mesh))} ({'×'.join(plan.batch_axes)}). Fix: make --num-samples a "
            f"multiple of {plan.data_shards}, or split the model instead of the samples (--strategy tp).")
    cache = jax.eval_shape(lambda: abstract.init_cache(c.num_samples, len(prompt) + max_tokens))  # nothing allocated
    rules.spec(("layers", *cache.names), cache.k.shape, mesh, "activation", where="the KV cache")
    sampling = Sampling(max_tokens, float(c.temperature), c.top_k, c.seed)
    return Setup(c, directory, step, record, model, tokenizer, prompt, sampling, mesh, rules, abstract)


# -- the run ---------------------------------------------------------------------------------


def _devices(mesh) -> str:
    """'1 × cpu', or '1 of 8 × cpu' where the samples fill fewer devices than there are."""
    used = f"{mesh.devices.size} of " if mesh.devices.size < jax.device_count() else ""
    return f"{used}{jax.device_count()} × {jax.devices()[0].device_kind}"


def load_model(setup: Setup) -> nnx.Module:
    """The checkpoint's model with its params restored straight into their shards (no optimizer state)."""
    params = nnx.state(setup.abstract, nnx.Param)
    shardings = jshard.shardings(params, setup.mesh, setup.rules)
    like = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params, shardings)
    if setup.config.init_from:  # each device's blocks read from the safetensors
        return nnx.merge(nnx.graphdef(setup.abstract), hf.load_params(setup.directory, setup.model, like))
    with Checkpoints(setup.directory) as checkpoints:
        restored = checkpoints.restore_params(setup.step, like)
    return nnx.merge(nnx.graphdef(setup.abstract), restored)


@dataclasses.dataclass
class GenerateResult:
    texts: list[str]  # each sample: the prompt and its continuation
    generated: Generated
    report: dict  # what --json writes


def run_generation(c: GenerateConfig, out=None) -> GenerateResult:
    """Run `c`; prints the set-up, the samples and the timing to `out` (default: stdout, on
    process 0 only)."""
    s = set_up(c)

    def say(line):
        if is_main_process():
            print(line, file=out or sys.stdout, flush=True)

    m, sampling = s.model, s.sampling
    kv = f" ({m.kv_heads} kv)" if hasattr(m, "kv_heads") else ""
    say(f"jshard generate: {m.family} ({m.layers} layers, embed {m.embed}, {m.heads} heads{kv}, vocab {m.vocab}) "
        f"from {s.directory} step {s.step}, {s.tokenizer.kind} tokenizer")
    say(f"  {c.num_samples} sample(s) of {len(s.prompt)} prompt + {sampling.max_tokens} new tokens, "
        f"temperature {sampling.temperature:g}, top-k {sampling.top_k or 'all'}, seed {sampling.seed}, "
        f"{'KV cache' if c.cache else 'no cache'}; {s.rules.name} on {mesh_text(mesh_shape(s.mesh))} "
        f"({_devices(s.mesh)})")
    model = load_model(s)
    generated = generate(model, np.tile(s.prompt, (c.num_samples, 1)), sampling, s.mesh, s.rules, c.cache)
    texts = [s.tokenizer.decode(np.concatenate([s.prompt, row])) for row in generated.tokens]
    for i, text in enumerate(texts):
        say(f"--- sample {i + 1}\n{text}")
    per_token = generated.per_token_s
    say(f"generated {sampling.max_tokens} tokens × {c.num_samples} samples in "
        f"{generated.prefill_s + generated.decode_s:.2f} s: prefill {generated.prefill_s * 1e3:.1f} ms, "
        + (f"{per_token * 1e3:.2f} ms per token" if per_token is not None else "no decode step")
        + f" ({'cache' if c.cache else 'no cache'}), {generated.tokens_per_s:.0f} tokens/s "
        f"(compiling {generated.compile_s:.1f} s)")
    report = dict(checkpoint=s.directory, step=s.step, family=m.family, model=s.record["model"],
                  tokenizer=s.tokenizer.identity(), strategy=s.rules.name, mesh=format_mesh(mesh_shape(s.mesh)),
                  devices=s.mesh.devices.size, prompt=c.prompt, prompt_tokens=s.prompt.tolist(),
                  **dataclasses.asdict(sampling), num_samples=c.num_samples, cache=c.cache, samples=texts,
                  tokens=generated.tokens.tolist(), prefill_ms=generated.prefill_s * 1e3,
                  per_token_ms=per_token and per_token * 1e3, tokens_per_s=generated.tokens_per_s,
                  compile_s=generated.compile_s)
    if is_main_process():
        write_json(c.json, report)
    return GenerateResult(texts, generated, report)
