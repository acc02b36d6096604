"""Generate the Hugging Face reference fixtures under tests/hf/fixtures/.

Run from the repository root with the side venv that has torch + transformers:

    .venv-hf/bin/python tests/hf/make_fixtures.py

For each model family this writes tests/hf/fixtures/<family>/ with

  config.json, generation_config.json   from model.save_pretrained (float32)
  model.safetensors                      (llama: sharded, model-0000X-of-0000N
                                          .safetensors + model.safetensors.index.json)
  tokenizer.json                         one shared byte-level BPE (vocab 320)
                                         trained on jshard/app/corpus.txt
  reference.npz                          ids, logits, loss, prompt, greedy,
                                         greedy_min_margin (smallest top1-top2
                                         logit gap along the greedy path)
                                         (+ loss_with_aux for mixtral if it differs)
  versions.json                          torch / transformers / safetensors ... + date

Everything is deterministic (torch.manual_seed(0) per family, numpy
default_rng(0) for the ids), so a second run on the same CPU gives byte-identical
files except for the date in versions.json (on another, reference.npz's floats may
differ in their last bits: same_fixtures.py compares within 1e-5).  No file is downloaded: models are built from
config objects, never from hub names.

Notes on what transformers 5.x saves (verified with transformers 5.24.0):
  * rope settings are saved as a single "rope_parameters" dict with rope_theta
    inside it; there is no top-level "rope_theta" and no "rope_scaling" key.
    llama's config.json holds
      "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0,
                          "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 32,
                          "rope_theta": 500000.0, "rope_type": "llama3"}
    and the others {"rope_theta": <theta>, "rope_type": "default"}.
    (Older 4.x configs instead have top-level "rope_theta" plus an optional
    "rope_scaling" dict; an importer should accept both.)
  * "head_dim" is saved explicitly for llama/mistral/qwen3/mixtral.
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

import safetensors
import tokenizers
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "jshard" / "app" / "corpus.txt"
OUT = Path(__file__).resolve().parent / "fixtures"

VOCAB = 320
GPT2_VOCAB = 50257  # the released GPT-2's
SEQ = 24
PROMPT_LEN = 8
NEW_TOKENS = 16

# bos/eos/pad are all None: generate() then never stops early on an eos and
# always returns exactly NEW_TOKENS new tokens.
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

COMMON = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    initializer_range=0.02,
    **NO_SPECIAL,
)


def _llama_like(config_class, theta, kv_heads=2, eps=1e-5, tied=False, rope=None, **extra):
    """A Llama-family config: COMMON sizes, 4 heads, plain rotary at `theta` unless `rope`."""
    return config_class(**COMMON, num_attention_heads=4, num_key_value_heads=kv_heads, rms_norm_eps=eps,
                        tie_word_embeddings=tied,
                        rope_parameters=rope or {"rope_type": "default", "rope_theta": theta}, **extra)


def _families():
    """name -> (model class, config, save_pretrained kwargs)."""
    # transformers 5.x names rotary settings rope_parameters; the legacy rope_theta=...,
    # rope_scaling={...} give the same config.json.
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return {
        "llama": (LlamaForCausalLM, _llama_like(LlamaConfig, 500000.0, rope=llama3), {"max_shard_size": "200KB"}),
        "llama-tied": (LlamaForCausalLM, _llama_like(LlamaConfig, 10000.0, kv_heads=4, tied=True), {}),
        "mistral": (MistralForCausalLM, _llama_like(MistralConfig, 10000.0, sliding_window=None), {}),
        "qwen2": (Qwen2ForCausalLM, _llama_like(Qwen2Config, 1e6, eps=1e-6, tied=True, use_sliding_window=False), {}),
        "qwen3": (Qwen3ForCausalLM, _llama_like(Qwen3Config, 1e6, eps=1e-6, head_dim=32,  # != hidden / heads = 16
                                                attention_bias=False, use_sliding_window=False), {}),
        "mixtral": (MixtralForCausalLM, _llama_like(MixtralConfig, 1e6, num_local_experts=4, num_experts_per_tok=2,
                                                    sliding_window=None), {}),
        "gpt2": (
            GPT2LMHeadModel,
            GPT2Config(
                n_layer=2,
                n_embd=64,
                n_head=4,
                n_positions=128,
                n_inner=None,  # 4 * n_embd = 256
                vocab_size=VOCAB,
                activation_function="gelu_new",
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                layer_norm_epsilon=1e-5,
                initializer_range=0.02,
                tie_word_embeddings=True,
                **NO_SPECIAL,
            ),
            {},
        ),
        # GPT-2's own vocabulary (50257, odd: no tensor axis divides it), on a model small enough
        # to commit; its logits are not kept (2 x 24 x 50257 floats), its loss and greedy tokens are.
        "gpt2-vocab": (
            GPT2LMHeadModel,
            GPT2Config(n_layer=1, n_embd=16, n_head=4, n_positions=64, n_inner=None, vocab_size=GPT2_VOCAB,
                       activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       layer_norm_epsilon=1e-5, initializer_range=0.02, tie_word_embeddings=True, **NO_SPECIAL),
            {},
        ),
    }


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def perturb(model: torch.nn.Module) -> None:
    """Norm weights -> 1 + 0.1*randn, every bias -> 0.1*randn (in place).

    Uses the global torch RNG, so it is deterministic after manual_seed.
    """
    owner = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = mod
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in type(owner[name]).__name__.lower()
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif is_norm and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))


def next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    v = logits.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, v).double(), ids[:, 1:].reshape(-1)
    ).float()


def make_family(name, cls, config, save_kwargs, tok_json: str, versions: dict):
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = cls(config).to(torch.float32)
    perturb(model)
    model.eval()

    vocab = config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, (2, SEQ)).astype(np.int32)
    t_ids = torch.tensor(ids, dtype=torch.long)
    prompt = ids[:1, :PROMPT_LEN].copy()
    t_prompt = torch.tensor(prompt, dtype=torch.long)

    with torch.no_grad():
        logits = model(t_ids).logits.float()
        hf_loss = model(t_ids, labels=t_ids).loss.float()
        own_loss = next_token_ce(logits, t_ids)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out_gen = model.generate(
                t_prompt,
                attention_mask=torch.ones_like(t_prompt),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
    gen = out_gen.sequences
    # Smallest top-1 minus top-2 logit gap along the greedy path: how robust
    # the greedy reference is to fp32 rounding differences in another impl.
    step_logits = torch.stack(out_gen.logits, 1).float()  # (1, NEW, V)
    top2 = step_logits.topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    for w in caught:
        print(f"  [{name}] generate warning: {w.message}", file=sys.stderr)
    greedy = gen[:, PROMPT_LEN:].numpy().astype(np.int32)
    assert greedy.shape == (1, NEW_TOKENS), greedy.shape
    assert np.array_equal(gen[:, :PROMPT_LEN].numpy(), prompt)

    ref = dict(
        ids=ids,
        **(dict(logits=logits.numpy().astype(np.float32)) if vocab == VOCAB else {}),
        prompt=prompt.astype(np.int32),
        greedy=greedy,
        greedy_min_margin=np.float32(margin),
    )
    if name == "mixtral":
        # Plain next-token CE; with output_router_logits=False (default) the
        # transformers .loss is the same plain CE (no router aux term).
        ref["loss"] = np.float32(own_loss.item())
        if abs(hf_loss.item() - own_loss.item()) > 1e-6:
            ref["loss_with_aux"] = np.float32(hf_loss.item())
    else:
        ref["loss"] = np.float32(hf_loss.item())
        assert abs(hf_loss.item() - own_loss.item()) < 1e-5, (hf_loss, own_loss)
    print(
        f"{name}: loss={ref['loss']:.6f} hf_loss={hf_loss.item():.6f} "
        f"own_ce={own_loss.item():.6f} greedy={greedy[0].tolist()} "
        f"min_margin={margin:.2e}"
    )

    model.save_pretrained(out, **save_kwargs)
    if vocab == VOCAB:  # (the shared tokenizer's ids: another vocabulary's model has none)
        (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    # np.savez (uncompressed) is byte-deterministic: zip entries get a fixed
    # timestamp.
    np.savez(out / "reference.npz", **ref)
    (out / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")


def main():
    global OUT
    if len(sys.argv) > 1:  # another folder, e.g. to diff against the committed fixtures (.ci/run)
        OUT = Path(sys.argv[1])
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "date": datetime.date.today().isoformat(),
    }
    torch.use_deterministic_algorithms(True)
    tok = train_tokenizer()
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = OUT / ".tokenizer.json.tmp"
    tok.save(str(tmp))
    tok_json = tmp.read_text(encoding="utf-8")
    tmp.unlink()
    for name, (cls, config, save_kwargs) in _families().items():
        make_family(name, cls, config, save_kwargs, tok_json, versions)


if __name__ == "__main__":
    main()
