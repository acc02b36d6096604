"""Hugging Face checkpoints in and out: a released model's directory as a jshard model, and back.

A directory in the Hugging Face layout (`config.json`, `model.safetensors` or shards listed in
`model.safetensors.index.json`, `tokenizer.json`) is read where it lies; nothing is downloaded.

    config.json  ──`model_config`──►  LlamaConfig (every field it cannot express refused by name)
    safetensors  ──`WEIGHTS` table──►  each param read block by block into its shards

The mapping is one table (`weights`): per jshard param, the Hugging Face tensors it is made of
and how (`Read`: a torch Linear's (out, in) matrix transposed to jshard's (in..., out...) dims;
`Stack`: several tensors, or the layers, or the experts, on one dim). Loading reads each block
this process's devices hold of a param, through memory maps of the files (`numpy.memmap`: lazy
views, so a block of a transposed matrix reads the pages it needs, not the tensor), converted to
the param's dtype part by part into one buffer, and puts it on its device before reading the
next (`_placed`): the host holds one block at a time. `export` walks the same table backwards and writes safetensors with
the `safetensors` library (the format's reference writer).

Rotary embeddings need no permutation: Hugging Face's Llama weights are laid out for the
rotate-half pairing (i, i + head_dim/2) that `jshard.models.llama.rotary` uses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import jax
import ml_dtypes
from flax import nnx
import numpy as np

from jshard.app.checkpoint import Checkpoints, model_of
from jshard.layout import Layout
from jshard.models import DecoderConfig, GPTConfig, LlamaConfig, decoder
from jshard.placement import shardings

CONFIG, INDEX, SINGLE, TOKENIZER = "config.json", "model.safetensors.index.json", "model.safetensors", "tokenizer.json"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "gpt2")  # config.json's model_type
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
# Buffers some checkpoints hold, derived and not read: rotary frequencies, GPT-2's causal masks.
UNUSED = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class HFError(ValueError):
    """A Hugging Face directory jshard cannot read or a model it cannot write; nothing was loaded."""


# -- config.json ↔ jshard's model config ---------------------------------------------------------


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise HFError(f"{directory}: no {CONFIG}. Fix: point it at a Hugging Face model directory "
                      f"(config.json, model.safetensors, tokenizer.json), e.g. one `huggingface-cli download` wrote.")
    with open(path) as f:
        return json.load(f)


def model_config(hf: dict, where: str = CONFIG) -> DecoderConfig:
    """jshard's config of a Hugging Face config.json; HFError naming the first field jshard's
    models cannot express."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise HFError(f"{where}: model_type {family!r} is not one jshard imports. Fix: use a model of "
                      f"{', '.join(FAMILIES)}.")

    def refuse(field, why, fix="use a checkpoint without it"):
        raise HFError(f"{where}: {field} = {hf.get(field)!r}: {why}. Fix: {fix}.")

    try:
        return _gpt_config(hf, refuse) if family == "gpt2" else _llama_config(hf, family, refuse)
    except HFError:
        raise
    except KeyError as e:
        raise HFError(f"{where}: no field {e}. Fix: a complete config.json of a {family} model.") from None
    except (ValueError, TypeError) as e:  # a field of the wrong type, or sizes that do not fit
        raise HFError(f"{where}: {e}") from None


def _check_ints(hf: dict, refuse, *fields) -> None:
    for field in fields:
        if field in hf and hf[field] is not None and (not isinstance(hf[field], int) or hf[field] < 1):
            refuse(field, "a size must be a positive integer", "correct config.json")


def _llama_config(hf: dict, family: str, refuse) -> LlamaConfig:
    _check_ints(hf, refuse, "vocab_size", "max_position_embeddings", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "num_hidden_layers", "head_dim", "num_local_experts",
                "num_experts_per_tok")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "jshard's Llama MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "jshard's Llama MLP has no biases")
    if family in ("llama", "mistral") and hf.get("attention_bias"):
        refuse("attention_bias", "it adds a bias to the output projection, which jshard's Llama has not")
    if family == "qwen3" and hf.get("attention_bias"):
        refuse("attention_bias", "jshard's Qwen3 attention has no biases")
    if hf.get("sliding_window") and (family != "qwen2" or hf.get("use_sliding_window")) \
            and hf["sliding_window"] < hf["max_position_embeddings"]:
        refuse("sliding_window", "jshard's attention is full causal attention, not a sliding window")
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        refuse("rope_scaling", f"rope type {kind!r}; jshard knows Llama 3's (llama3) and plain rotary")
    scaling = None
    if kind == "llama3":
        scaling = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                   int(rope["original_max_position_embeddings"]))
    heads, embed = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or embed // heads
    experts = dict(experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], capacity_factor=None,
                   balance_loss=float(hf.get("router_aux_loss_coef", 0.01))) if family == "mixtral" else {}
    return LlamaConfig(
        vocab=hf["vocab_size"], seq_len=hf["max_position_embeddings"], embed=embed, heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads, mlp=hf["intermediate_size"],
        layers=hf["num_hidden_layers"], rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=scaling, tied_head=bool(hf.get("tie_word_embeddings", False)),
        head_size=None if head_dim * heads == embed else head_dim, qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), **experts)


def _gpt_config(hf: dict, refuse) -> GPTConfig:
    _check_ints(hf, refuse, "vocab_size", "n_positions", "n_embd", "n_head", "n_inner", "n_layer")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        refuse("activation_function", "jshard's GPT MLP is GELU's tanh approximation (gelu_new)")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        refuse("scale_attn_weights" if not hf.get("scale_attn_weights", True) else "scale_attn_by_inverse_layer_idx",
               "jshard's attention scales scores by 1/sqrt(head_dim) alone")
    return GPTConfig(vocab=hf["vocab_size"], seq_len=hf["n_positions"], embed=hf["n_embd"], heads=hf["n_head"],
                     mlp=hf.get("n_inner") or 4 * hf["n_embd"], layers=hf["n_layer"],
                     tied_head=bool(hf.get("tie_word_embeddings", True)), bias=True,
                     norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)))


def family_of(config: DecoderConfig) -> str:
    """The Hugging Face family that holds exactly this config's features (Mistral's models are
    Llamas: they export as llama)."""
    if isinstance(config, GPTConfig):
        return "gpt2"
    return "mixtral" if config.experts else "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel"}


def hf_config(config: DecoderConfig, dtype: str, family: str | None = None) -> dict:
    """config.json of `config` as `family` (default `family_of`); HFError where the family cannot hold it."""
    family = family or family_of(config)
    needs = family_of(config)
    if needs == "gpt2" or family == "gpt2":
        if needs != family:
            raise HFError(f"--family {family}: this model is a {config.family}, which {family} cannot hold. "
                          f"Fix: --family {needs}.")
        if not config.bias:
            raise HFError("a GPT without biases: GPT-2's Linears all have them. Fix: a GPT made with bias=True "
                          "(an imported GPT-2).")
        return dict(model_type="gpt2", architectures=[ARCHITECTURES["gpt2"]], vocab_size=config.vocab,
                    n_positions=config.seq_len, n_embd=config.embed, n_head=config.heads, n_inner=config.mlp,
                    n_layer=config.layers, layer_norm_epsilon=config.norm_epsilon, activation_function="gelu_new",
                    tie_word_embeddings=config.tied_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    torch_dtype=dtype, bos_token_id=None, eos_token_id=None)
    if needs not in (family, "llama") or (needs == "llama" and family not in ("llama", "mistral")):
        raise HFError(f"--family {family}: this model has the features of {needs} ({_features(config)}), "
                      f"which {family} cannot hold. Fix: --family {needs}.")
    if config.moe_every != 1 or (config.experts and config.capacity_factor is not None):
        raise HFError(f"a mixture of experts with moe_every={config.moe_every}, capacity_factor="
                      f"{config.capacity_factor}: Mixtral's is in every block and drops no token. Fix: train "
                      "it with moe_every 1 and capacity_factor None to export it.")
    hf = dict(model_type=family, architectures=[ARCHITECTURES[family]], vocab_size=config.vocab,
              max_position_embeddings=config.seq_len, hidden_size=config.embed, num_attention_heads=config.heads,
              num_key_value_heads=config.kv_heads, intermediate_size=config.mlp, num_hidden_layers=config.layers,
              rope_theta=config.rope_theta, rms_norm_eps=config.norm_epsilon, tie_word_embeddings=config.tied_head,
              hidden_act="silu", head_dim=config.head_dim, attention_bias=False, torch_dtype=dtype,
              bos_token_id=None, eos_token_id=None)
    if config.rope_scaling:
        factor, low, high, original = config.rope_scaling
        hf["rope_scaling"] = dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                                  original_max_position_embeddings=original)
    if family == "mixtral":
        hf |= dict(num_local_experts=config.experts, num_experts_per_tok=config.top_k,
                   router_aux_loss_coef=config.balance_loss)
    if family in ("mistral", "mixtral", "qwen2"):
        hf |= dict(sliding_window=None, use_sliding_window=False)
    return hf


def _features(config: LlamaConfig) -> str:
    named = [("experts", config.experts), ("q/k norms", config.qk_norm), ("q/k/v biases", config.qkv_bias)]
    return ", ".join(name for name, has in named if has) or "none beyond Llama's"


# -- the table: each jshard param from Hugging Face tensors ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Read:
    """One Hugging Face tensor as a jshard param (or a part of one). `inputs`: the param's
    leading dims that are a Linear's inputs, the tensor being torch's (out, in) matrix of them
    (transposed here), or with `transposed` False GPT-2's Conv1D (in, out) matrix; None: the
    tensor holds the param's elements in order (a norm's scale, a bias, an embedding table)."""
    name: str
    inputs: int | None = None
    transposed: bool = True
    # (dim, rows): the tensor holds the first `rows` along the param's `dim`, the rest of which is
    # zeros (a padded vocabulary's table or head; `DecoderConfig.vocab_rows`)
    padded: tuple[int, int] | None = None

    def view(self, tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as the param's `shape`, a view (no copy of a memory map)."""
        if self.inputs is None or not self.transposed:
            return tensor.reshape(shape)
        ins, outs = shape[:self.inputs], shape[self.inputs:]
        return tensor.reshape(*outs, *ins).transpose(*range(len(outs), len(shape)), *range(len(outs)))

    def stored(self, value: np.ndarray) -> tuple[str, np.ndarray]:
        """(name, tensor as Hugging Face stores it) of the param's `value`: `view` backwards."""
        if self.padded:
            dim, rows = self.padded
            value = value[(slice(None),) * dim + (slice(0, rows),)]
        if self.inputs is None:
            return self.name, value.reshape(-1) if value.ndim > 1 and self.name.endswith("bias") else value
        ins, outs = value.shape[:self.inputs], value.shape[self.inputs:]
        if not self.transposed:
            return self.name, value.reshape(math.prod(ins), math.prod(outs))
        moved = value.transpose(*range(self.inputs, value.ndim), *range(self.inputs))
        return self.name, moved.reshape(math.prod(outs), math.prod(ins))


@dataclasses.dataclass(frozen=True)
class Stack:
    """Parts side by side on dim `axis` of the param: k and v, gate and up, experts, layers."""
    axis: int
    parts: tuple


def _layers(n: int, make, prefix="model.layers.") -> Stack:
    return Stack(0, tuple(make(f"{prefix}{i}.") for i in range(n)))


def _padded(config: DecoderConfig, dim: int) -> tuple[int, int] | None:
    """A vocabulary dim's `Read.padded`, where the model pads its vocabulary."""
    return (dim, config.vocab) if config.vocab_rows != config.vocab else None


def weights(config: DecoderConfig) -> dict[tuple[str, ...], Read | Stack]:
    """Every param of `config`'s decoder (its path in `nnx.state`) from Hugging Face tensors."""
    if isinstance(config, GPTConfig):
        return _gpt_weights(config)
    attn, mlp = "self_attn.", "mlp."
    table = {
        ("token_embed", "embedding"): Read("model.embed_tokens.weight", padded=_padded(config, 0)),
        ("final_norm", "scale"): Read("model.norm.weight"),
        ("blocks", "attn_norm", "scale"): _layers(config.layers, lambda p: Read(p + "input_layernorm.weight")),
        ("blocks", "mlp_norm", "scale"): _layers(config.layers, lambda p: Read(p + "post_attention_layernorm.weight")),
        ("blocks", "attn", "q", "kernel"): _layers(config.layers, lambda p: Read(p + attn + "q_proj.weight", 1)),
        ("blocks", "attn", "kv", "kernel"): _layers(config.layers, lambda p: Stack(1, (
            Read(p + attn + "k_proj.weight", 1), Read(p + attn + "v_proj.weight", 1)))),
        ("blocks", "attn", "out", "kernel"): _layers(config.layers, lambda p: Read(p + attn + "o_proj.weight", 2)),
    }
    if not config.tied_head:
        table[("head", "kernel")] = Read("lm_head.weight", 1, padded=_padded(config, 1))
    if config.qkv_bias:
        table[("blocks", "attn", "q", "bias")] = _layers(config.layers, lambda p: Read(p + attn + "q_proj.bias"))
        table[("blocks", "attn", "kv", "bias")] = _layers(config.layers, lambda p: Stack(0, (
            Read(p + attn + "k_proj.bias"), Read(p + attn + "v_proj.bias"))))
    if config.qk_norm:
        table[("blocks", "attn", "q_norm", "scale")] = _layers(config.layers, lambda p: Read(p + attn + "q_norm.weight"))
        table[("blocks", "attn", "k_norm", "scale")] = _layers(config.layers, lambda p: Read(p + attn + "k_norm.weight"))
    if config.experts:  # Mixtral: w1 gate, w3 up, w2 down, per expert
        moe = "block_sparse_moe."

        def experts(p, make):
            return Stack(0, tuple(make(f"{p}{moe}experts.{e}.") for e in range(config.experts)))

        table[("blocks", "mlp", "router", "kernel")] = _layers(config.layers, lambda p: Read(p + moe + "gate.weight", 1))
        table[("blocks", "mlp", "gate_up", "kernel")] = _layers(config.layers, lambda p: experts(p, lambda e: Stack(1, (
            Read(e + "w1.weight", 1), Read(e + "w3.weight", 1)))))
        table[("blocks", "mlp", "down", "kernel")] = _layers(config.layers, lambda p: experts(
            p, lambda e: Read(e + "w2.weight", 1)))
    else:
        table[("blocks", "mlp", "gate_up", "kernel")] = _layers(config.layers, lambda p: Stack(1, (
            Read(p + mlp + "gate_proj.weight", 1), Read(p + mlp + "up_proj.weight", 1))))
        table[("blocks", "mlp", "down", "kernel")] = _layers(config.layers, lambda p: Read(p + mlp + "down_proj.weight", 1))
    return table


def _gpt_weights(config: GPTConfig) -> dict[tuple[str, ...], Read | Stack]:
    """GPT-2's: Conv1D matrices stored (in, out); c_attn's outputs are q, k, v, each heads × head_dim."""
    def layers(suffix, **read):
        return _layers(config.layers, lambda p: Read(p + suffix, **read), prefix="transformer.h.")

    table = {
        ("token_embed", "embedding"): Read("transformer.wte.weight", padded=_padded(config, 0)),
        ("pos_embed", "embedding"): Read("transformer.wpe.weight"),
        ("final_norm", "scale"): Read("transformer.ln_f.weight"),
        ("final_norm", "bias"): Read("transformer.ln_f.bias"),
        ("blocks", "attn_norm", "scale"): layers("ln_1.weight"),
        ("blocks", "attn_norm", "bias"): layers("ln_1.bias"),
        ("blocks", "mlp_norm", "scale"): layers("ln_2.weight"),
        ("blocks", "mlp_norm", "bias"): layers("ln_2.bias"),
        ("blocks", "attn", "qkv", "kernel"): layers("attn.c_attn.weight", inputs=1, transposed=False),
        ("blocks", "attn", "qkv", "bias"): layers("attn.c_attn.bias"),
        ("blocks", "attn", "out", "kernel"): layers("attn.c_proj.weight", inputs=2, transposed=False),
        ("blocks", "attn", "out", "bias"): layers("attn.c_proj.bias"),
        ("blocks", "mlp", "up", "kernel"): layers("mlp.c_fc.weight", inputs=1, transposed=False),
        ("blocks", "mlp", "up", "bias"): layers("mlp.c_fc.bias"),
        ("blocks", "mlp", "down", "kernel"): layers("mlp.c_proj.weight", inputs=1, transposed=False),
        ("blocks", "mlp", "down", "bias"): layers("mlp.c_proj.bias"),
    }
    if not config.tied_head:
        table[("head", "kernel")] = Read("lm_head.weight", 1, padded=_padded(config, 1))
    return table


def _reads(node) -> list[Read]:
    return [node] if isinstance(node, Read) else [r for part in node.parts for r in _reads(part)]


# -- safetensors files, memory-mapped ----------------------------------------------------------------


class Tensors:
    """The tensors of a directory's safetensors files by name, each a lazy memory-mapped view."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            files = [SINGLE]
        else:
            raise HFError(f"{directory}: neither {SINGLE} nor {INDEX}. Fix: a directory with the model's "
                          "safetensors (PyTorch .bin files are not read: convert them with transformers first).")
        self.where: dict[str, tuple[str, int, dict]] = {}  # name -> file, its data's first byte, entry
        for name in files:
            path = os.path.join(directory, name)
            data, header = _header(path)
            for tensor, entry in header.items():
                self.where[tensor] = (path, data, entry)
        if "wte.weight" in self.where:  # GPT-2 saved from GPT2Model (the original release): no "transformer."
            self.where = {f"transformer.{k}": v for k, v in self.where.items()}
        self._maps: dict[str, np.memmap] = {}

    def names(self) -> set[str]:
        return set(self.where)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise HFError(f"{self.directory}: no tensor {name!r} in its safetensors. Fix: a complete checkpoint "
                          "of the model config.json describes.")
        path, data, entry = self.where[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._maps[path][data + begin:data + end]
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _header(path: str) -> tuple[int, dict]:
    """A safetensors file's data start (8 bytes of length, then the header) and its table:
    name -> dtype, shape, data_offsets (from the data start)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: not a readable safetensors file ({e}). Fix: download it again.") from None
    header.pop("__metadata__", None)
    if bad := sorted({e["dtype"] for e in header.values()} - set(DTYPES)):
        raise HFError(f"{path}: tensors of dtype {', '.join(bad)}; jshard reads {', '.join(DTYPES)}. "
                      "Fix: convert the checkpoint to bf16 or fp32.")
    return 8 + size, header


def read_block(node, shape: tuple[int, ...], index: tuple[slice, ...], tensors: Tensors, dtype,
               out: np.ndarray | None = None) -> np.ndarray:
    """The block `index` of a param of `shape` made as `node` says, in `dtype`: only what the
    block needs is read, into `out` (allocated here when not given) part by part."""
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
    if out is None:
        out = np.empty([len(range(n)[s]) for s, n in zip(index, shape)], dtype)
    if isinstance(node, Read) and node.padded:
        dim, rows = node.padded
        out[...] = 0
        start, stop, _ = index[dim].indices(shape[dim])
        if start < rows:  # the block's rows that the tensor holds, read as an unpadded param's
            held = index[:dim] + (slice(start, min(stop, rows)),) + index[dim + 1:]
            read_block(dataclasses.replace(node, padded=None), shape[:dim] + (rows,) + shape[dim + 1:], held, tensors,
                       dtype, out[(slice(None),) * dim + (slice(0, min(stop, rows) - start),)])
        return out
    if isinstance(node, Read):
        tensor = tensors[node.name]
        want = math.prod(shape)
        if tensor.size != want:
            raise HFError(f"{tensors.directory}: tensor {node.name} has shape {list(tensor.shape)}, where the "
                          f"config gives {want} elements ({list(shape)}). Fix: the config.json of these weights.")
        out[...] = node.view(tensor, shape)[index]  # the view's pages read, converted on the way
        return out
    part_shape = shape[:node.axis] + shape[node.axis + 1:]
    rest = index[:node.axis] + index[node.axis + 1:]
    for i, j in enumerate(range(len(node.parts))[index[node.axis]]):
        read_block(node.parts[j], part_shape, rest, tensors, dtype, out[(slice(None),) * node.axis + (i,)])
    return out


def stored_tensors(node, value: np.ndarray) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of a param's whole `value`."""
    if isinstance(node, Read):
        return dict([node.stored(value)])
    return {k: v for j, part in enumerate(node.parts)
            for k, v in stored_tensors(part, np.take(value, j, axis=node.axis)).items()}


# -- in: a directory's params straight into their shards ----------------------------------------------


def load_params(directory: str, config: DecoderConfig, like):
    """The params of `like` (an `nnx.State` of ShapeDtypeStructs with shardings, e.g. a step's
    full params) read from `directory`'s safetensors: each device block read and converted on
    its own (`_placed`)."""
    tensors = Tensors(directory)
    table = weights(config)
    flat = dict(nnx.to_flat_state(like))
    paths = {tuple(str(k) for k in path): path for path in flat}
    if missing := sorted(set(paths) - set(table)):
        raise HFError(f"jshard's model has params the table does not map: {missing}")
    wanted = {r.name for node in table.values() for r in _reads(node)}
    if extra := sorted(n for n in tensors.names() - wanted if not n.endswith(UNUSED)):
        raise HFError(f"{directory}: tensors jshard's {family_of(config)} has no place for: {', '.join(extra[:4])}"
                      f"{' ...' if len(extra) > 4 else ''}. Fix: a checkpoint of the config's family, without "
                      "extra modules (a value head, adapters: merge or drop them first).")
    loaded = []
    for key, path in paths.items():
        leaf = flat[path]
        target = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf  # a ShapeDtypeStruct
        array = _placed(table[key], target, tensors)
        loaded.append((path, leaf.replace(array) if isinstance(leaf, nnx.Variable) else array))
    return nnx.from_flat_state(loaded)


def _placed(node, target, tensors: Tensors) -> jax.Array:
    """`target` (a ShapeDtypeStruct with a sharding) read block by block onto this process's
    devices, each block on its device before the next is read: the host holds one at a time."""
    blocks, last = [], (None, None)
    for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
        key = tuple((s.start, s.stop) for s in index)
        if key != last[0]:  # a replicated param's block is read once for all its devices
            last = key, read_block(node, target.shape, index, tensors, target.dtype)
        blocks.append(jax.device_put(last[1], device))
    return jax.make_array_from_single_device_arrays(target.shape, target.sharding, blocks)


def from_pretrained(directory: str, mesh, rules, dtype=None) -> nnx.Module:
    """The model of a Hugging Face `directory`, its params read straight into the layout
    `rules` give them on `mesh` (in `dtype`, default the params' float32); a vocabulary they
    split unevenly padded (zero rows, never a token)."""
    # (a vocabulary the layout's split does not divide: the table padded, `Layout.model`)
    config = Layout.of(rules, mesh).model(model_config(read_config(directory), os.path.join(directory, CONFIG)))
    abstract = nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    like = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, dtype or p.dtype, sharding=s), params,
                        shardings(params, mesh, rules))
    return nnx.merge(nnx.graphdef(abstract), load_params(directory, config, like))


# -- out: a model's params as a Hugging Face directory -------------------------------------------------


def export(params: dict, config: DecoderConfig, directory: str, *, dtype=np.float32, family: str | None = None,
           tokenizer: str | None = None, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write `params` (flat: path tuple -> array, whole) as a Hugging Face directory: config.json,
    safetensors (shards of at most `max_shard_bytes`, with an index when more than one) and
    `tokenizer` (a tokenizer.json path) beside them. Returns the files written."""
    from safetensors.numpy import save_file

    dtype = np.dtype(dtype)
    hf = hf_config(config, {np.float32: "float32", ml_dtypes.bfloat16: "bfloat16"}.get(dtype.type, str(dtype)), family)
    os.makedirs(directory, exist_ok=True)
    table = weights(config)
    tensors: dict[str, np.ndarray] = {}
    for key, node in table.items():
        value = np.asarray(params[key]).astype(dtype)
        tensors |= {k: np.ascontiguousarray(v) for k, v in stored_tensors(node, value).items()}
    shards, size = [[]], 0
    for name in sorted(tensors):  # (the names in order: a file is the same whatever the dict's order)
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensors[name].nbytes
    files = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    for file, names in zip(files, shards):
        save_file({n: tensors[n] for n in names}, os.path.join(directory, file), metadata={"format": "pt"})
    if len(files) > 1:
        index = dict(metadata=dict(total_size=sum(t.nbytes for t in tensors.values())),
                     weight_map={n: f for f, names in zip(files, shards) for n in names})
        _write_json(os.path.join(directory, INDEX), index)
        files.append(INDEX)
    _write_json(os.path.join(directory, CONFIG), hf)
    files.append(CONFIG)
    if tokenizer:
        shutil.copyfile(tokenizer, os.path.join(directory, TOKENIZER))
        files.append(TOKENIZER)
    return files


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def export_checkpoint(checkpoint_dir: str, to: str, *, step: int | None = None, dtype=np.float32,
                      family: str | None = None, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """`jshard export`: a `jshard train` checkpoint's params (the latest step, or `step`) as a
    Hugging Face directory `to`, its BPE tokenizer beside them. Returns the files written."""
    # Saved steps are numbered folders: refused before orbax starts (its threads outlive an error)
    steps = sorted(int(d) for d in os.listdir(checkpoint_dir) if d.isdigit()) if os.path.isdir(checkpoint_dir) else []
    if not steps or (step is not None and step not in steps):
        held = f"steps {', '.join(map(str, steps))}" if steps else "no checkpoint"
        raise HFError(f"--checkpoint-dir {checkpoint_dir} holds {held}"
                      + (f", not step {step}" if step is not None and steps else "")
                      + ". Fix: point it at a `jshard train --checkpoint-dir` run, and --step at one it saved.")
    step = steps[-1] if step is None else step
    with Checkpoints(checkpoint_dir) as checkpoints:
        record = checkpoints.record(step)
        config = model_of(record, os.path.join(checkpoints.directory, str(step)))
        hf_config(config, "float32", family)  # refuses a family that cannot hold the model, before reading
        abstract = nnx.state(nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0))), nnx.Param)
        host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=host), abstract)
        params = checkpoints.restore_params(step, like)
    flat = {tuple(str(k) for k in path): np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v)
            for path, v in nnx.to_flat_state(params)}
    tokenizer = os.path.join(checkpoint_dir, TOKENIZER)
    return export(flat, config, to, dtype=dtype, family=family, max_shard_bytes=max_shard_bytes,
                  tokenizer=tokenizer if os.path.isfile(tokenizer) else None)
