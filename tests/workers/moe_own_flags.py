"""A megatron-core MoE recipe with flag names of its own (not Megatron-LM's), for checking that
MoE routing statistics never depend on recognising a flag: ``--experts 16 --ep 16 --pp 2``.
``integration.flags.ep=--ep integration.flags.pp=--pp`` render ``target.parallel`` into them.

``--hot-expert E --hot-bias B`` (or ``PRISM_TEST_HOT_EXPERT`` / ``PRISM_TEST_HOT_BIAS``) add ``B``
to every router's logit of expert ``E``: a planted skew, so expert ``E`` receives most tokens.
The model, data and training loop are the bundled ``examples/megatron_gpt.py``'s.
"""

import argparse
import os
import runpy
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt.py"


def parse(argv):
    p = argparse.ArgumentParser(description="megatron-core MoE GPT with its own flag names")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--same-data", action="store_true", help="every data-parallel replica on the same data")
    p.add_argument("--hot-expert", type=int, default=int(os.environ.get("PRISM_TEST_HOT_EXPERT", -1)))
    p.add_argument("--hot-bias", type=float, default=float(os.environ.get("PRISM_TEST_HOT_BIAS", 4.0)))
    return p.parse_args(argv)


def plant_skew(expert: int, bias: float) -> None:
    """Every router adds ``bias`` to expert ``expert``'s logit (before top-k)."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    gating = TopKRouter.gating

    def skewed(self, input):
        logits = gating(self, input)
        shift = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        shift[expert] = bias
        return logits + shift

    TopKRouter.gating = skewed


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.hot_expert >= 0:
        plant_skew(a.hot_expert, a.hot_bias)
    args = ["--tensor-model-parallel-size", a.tp, "--pipeline-model-parallel-size", a.pp,
            "--expert-model-parallel-size", a.ep, "--num-experts", a.experts, "--moe-router-topk", a.topk,
            "--num-layers", a.layers, "--micro-batch-size", a.mbs, "--train-iters", a.steps]
    if a.same_data:
        args.append("--replicate-data")
    if a.gbs is not None:
        args += ["--global-batch-size", a.gbs]
    sys.argv = [str(RECIPE), *map(str, args)]
    runpy.run_path(str(RECIPE), run_name="__main__")


if __name__ == "__main__":
    main()
