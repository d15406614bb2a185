"""What the GPU benches share: where upstream Megatron-LM's ``pretrain_gpt.py`` is, and the
check that this machine can run it."""

from __future__ import annotations

import sys
from pathlib import Path

MODEL_84M = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--micro-batch-size", "2", "--bf16", "--lr", "1e-4",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192", "--transformer-impl",
             "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
             "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--log-interval", "1", "--eval-interval",
             "1000", "--eval-iters", "1"]
"""The 84M-parameter GPT of the GPU benches (4 layers, hidden 1024, seq 1024, bf16, local layers)
without its parallel layout."""


def pretrain_gpt(mlm: str) -> Path | None:
    """``pretrain_gpt.py`` under ``mlm`` on a machine with CUDA, or None after saying what is
    missing (Megatron-LM's training code: ``../shared/tools/gpu-stack.sh``, then
    ``source .mlm/activate.sh``; or a GPU)."""
    script = Path(mlm) / "pretrain_gpt.py"
    if not script.exists():
        print(f"no {script}: prepare Megatron-LM's training code with ../shared/tools/gpu-stack.sh and "
              "source .mlm/activate.sh", file=sys.stderr)
        return None
    import torch

    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return None
    return script
