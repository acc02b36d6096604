"""Models whose params and activations carry logical axis names."""

from jshard.models.gpt import GPT, GPT_SIZES, PRECISIONS, GPTConfig, gpt_loss
from jshard.models.mlp import DeepMLP, MLPConfig, mlp_loss
from jshard.models.stack import StagedLoss, scan_layers, stack_layers

__all__ = ["GPT", "GPT_SIZES", "PRECISIONS", "GPTConfig", "gpt_loss", "DeepMLP", "MLPConfig", "mlp_loss", "StagedLoss", "scan_layers", "stack_layers"]
