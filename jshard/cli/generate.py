"""`jshard generate`: its flags, and a `GenerateConfig` from them; the run is `jshard.app.generation`'s."""

from __future__ import annotations

import argparse
import dataclasses

from jshard.app import generation
from jshard.cli import flags
from jshard.app.generation import FAKE_DEVICES as GENERATE_FAKE_DEVICES
from jshard.app.generation import MAX_TOKENS, GenerateConfig


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="sample text from a checkpoint, with a KV cache",
                                 description=generation.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = GenerateConfig("", "")
    add = parser.add_argument
    add("--checkpoint-dir", metavar="DIR", help="a `jshard train --checkpoint-dir` directory")
    add("--init-from", metavar="DIR", help="a Hugging Face model directory (config.json, safetensors, "
                                           "tokenizer.json) instead of a checkpoint (docs/checkpoints.md)")
    add("--prompt", required=True, help="the text to continue")
    add("--max-tokens", type=int, metavar="N",
        help=f"new tokens per sample (default: {MAX_TOKENS}, or what the model's seq_len leaves after the prompt)")
    add("--temperature", type=float, default=defaults.temperature, metavar="T",
        help=f"softmax temperature; 0 = always the most likely token (default: {defaults.temperature})")
    add("--top-k", type=int, metavar="K", help="sample among the k most likely tokens (default: all)")
    add("--seed", type=int, default=defaults.seed, metavar="N",
        help=f"the sampling's random key (default: {defaults.seed})")
    add("--num-samples", type=int, default=defaults.num_samples, metavar="N",
        help=f"samples from the one prompt, a batch split over the batch axes (default: {defaults.num_samples})")
    add("--step", type=int, metavar="N", help="the checkpoint's step (default: the latest)")
    add("--no-cache", dest="cache", action="store_false",
        help="no KV cache: every token runs the model over the whole window (to measure the cache's gain)")
    flags.add_strategy(parser, defaults.strategy)
    flags.add_mesh(parser)
    flags.add_fake_devices(parser, GENERATE_FAKE_DEVICES)
    flags.add_json(parser, "the samples, their token ids and the timings")
    parser.set_defaults(run=run)


def run(args) -> int:
    fields = {f.name for f in dataclasses.fields(GenerateConfig)}
    generation.run_generation(GenerateConfig(**{k: v for k, v in vars(args).items() if k in fields}))
    return 0
