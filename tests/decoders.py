"""The decoders every strategy and schedule is tested on, small enough for 8 fake CPU
devices: a GPT, and a Llama whose 8 query heads share 4 KV heads (so under tensor=4 each
device holds 2 query heads and their 1 KV head); and for expert parallelism that Llama with
a mixture of 8 experts in each block, top-2 routed at capacity factor 1 (so that rows drop
choices), its load-balancing gradient weighted 0.1 (so that a wrong one shows)."""

import dataclasses

from flax import nnx

from jshard.models import GPTConfig, LlamaConfig, decoder

CONFIGS = {
    "gpt": GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=2),
    "llama": LlamaConfig(vocab=64, seq_len=16, embed=32, heads=8, kv_heads=4, mlp=64, layers=2),
    "moe": LlamaConfig(vocab=64, seq_len=16, embed=32, heads=8, kv_heads=4, mlp=32, layers=2, experts=8, top_k=2,
                       capacity_factor=1.0, balance_loss=0.1),
}


def make(name: str, seed: int, **fields):
    """A fresh decoder `name`, its config's `fields` replaced (e.g. layers=4)."""
    return decoder(dataclasses.replace(CONFIGS[name], **fields), nnx.Rngs(seed))
