"""PrismLLM launcher: a drop-in torchrun replacement that emulates large distributed training."""
