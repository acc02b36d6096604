"""Models whose params and activations carry logical axis names.

Two decoders, each with its config and named sizes beside it (`gpt.py`, `llama.py`); both
expose `embed`, `blocks` and `logits`, so `gpt_loss` trains and pipelines either. `SIZES`
holds every named size, for every command's `--model`; `decoder(config, rngs)` builds the
model a config describes.
"""

from jshard.models.gpt import GPT, GPT_SIZES, GPTConfig, gpt_loss
from jshard.models.llama import LLAMA_SIZES, Llama, LlamaConfig
from jshard.models.mlp import DeepMLP, MLPConfig, mlp_loss
from jshard.models.stack import StagedLoss, scan_layers, stack_layers

SIZES = {**GPT_SIZES, **LLAMA_SIZES}
DecoderConfig = GPTConfig | LlamaConfig
DECODERS = {GPTConfig: GPT, LlamaConfig: Llama}


def decoder(config, rngs):
    """The decoder (GPT or Llama) that `config` describes."""
    return DECODERS[type(config)](config, rngs=rngs)


__all__ = ["DECODERS", "DecoderConfig", "GPT", "GPT_SIZES", "LLAMA_SIZES", "SIZES", "GPTConfig", "Llama", "LlamaConfig",
           "decoder", "gpt_loss", "DeepMLP", "MLPConfig", "mlp_loss", "StagedLoss", "scan_layers", "stack_layers"]
