"""What the GPU benches share: where upstream Megatron-LM's ``pretrain_gpt.py`` is, and the
check that this machine can run it."""

from __future__ import annotations

import sys
from pathlib import Path


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
