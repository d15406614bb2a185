"""Minimal DeepSpeed mixture-of-experts GPT recipe: ``deepspeed.moe.layer.MoE`` feed-forward
layers with expert parallelism, trained with ZeRO (stage from the JSON config).

Launch it the way DeepSpeed jobs are launched, e.g.::

    deepspeed --num_gpus 8 examples/deepspeed_moe.py --deepspeed_config examples/ds_configs/moe.json

DeepSpeed takes the expert-parallel size in code (``MoE(ep_size=...)``); this recipe reads it
from the config's ``moe.ep_size`` (what ``prism-launch integration.kind=deepspeed
target.parallel.ep=N`` renders), with ``--ep-size`` as an override. Experts are split over
``ep_size`` consecutive ranks; non-expert weights are data-parallel over the whole world,
expert weights over the expert-data-parallel groups. Training data is synthetic and
deterministic (sample ``i`` depends on ``--seed`` and ``i`` only).

After every step rank 0 prints::

    step N | loss <repr(float)> | grad_norm <repr(float)> | step_time_ms <ms>

With ``--log-all-ranks`` every rank prints its values and a checksum of its parameters::

    rank R iter N | loss <repr> | grad_norm <repr> | param_checksum <repr>

With ``--log-gate-counts`` every rank prints, for every forward of every MoE layer's gate, the
tokens it routed to each expert before (``exp_counts``) and after (``routed``) the capacity limit::

    gate_counts {"rank": R, "iter": N, "layer": L, "exp_counts": [...], "routed": [...], "l_aux": x}
"""

import argparse
import json
import math
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DeepSpeed MoE GPT pretraining (synthetic data)")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--num-experts", type=int, default=4)
    p.add_argument("--ep-size", type=int, default=None, help="default: the config's moe.ep_size, else 1")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--aux-loss-coeff", type=float, default=0.01)
    p.add_argument("--train-iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-all-ranks", action="store_true",
                   help="every rank prints its loss, grad norm and a parameter checksum each step")
    p.add_argument("--log-gate-counts", action="store_true",
                   help="every rank prints each gate's tokens per expert, before and after the capacity limit")
    p = deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


class Expert(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, args, ep_size):
        super().__init__()
        h = args.hidden_size
        self.heads = args.num_attention_heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.moe = MoE(hidden_size=h, expert=Expert(h), num_experts=args.num_experts, ep_size=ep_size,
                       k=args.top_k, capacity_factor=args.capacity_factor, eval_capacity_factor=args.capacity_factor,
                       min_capacity=4)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(h // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, h))
        out, aux_loss, _counts = self.moe(self.ln2(x))
        return x + out, aux_loss


class MoEGPT(nn.Module):
    def __init__(self, args, ep_size):
        super().__init__()
        self.aux_loss_coeff = args.aux_loss_coeff
        self.tok = nn.Embedding(args.vocab_size, args.hidden_size)
        self.pos = nn.Embedding(args.seq_length, args.hidden_size)
        self.blocks = nn.ModuleList(Block(args, ep_size) for _ in range(args.num_layers))
        self.ln = nn.LayerNorm(args.hidden_size)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, tokens, labels):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        aux = 0.0
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        logits = self.head(self.ln(x))
        lm_loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
        return lm_loss + self.aux_loss_coeff * aux, lm_loss


def log_gate_counts(model, rank, state):
    """Print every gate's counts as it runs (``--log-gate-counts``); ``state["iter"]``: the step."""
    def hook(layer):
        def print_counts(_gate, _inputs, output):
            exp_counts = output[-1]
            if len(output) == 7:  # sparse routes: the expert of each route, -1 where capacity dropped it
                idx = output[3].reshape(-1)
                routed = torch.bincount(idx[idx >= 0].long(), minlength=exp_counts.numel())
            else:  # the dispatch mask [tokens, experts, capacity]
                routed = output[2].sum(dim=(0, 2))
            line = {"rank": rank, "iter": state["iter"], "layer": layer, "exp_counts": exp_counts.tolist(),
                    "routed": routed.tolist(), "l_aux": float(output[0])}
            sys.stdout.write(f"gate_counts {json.dumps(line)}\n")
        return print_counts

    for i, block in enumerate(model.blocks):
        block.moe.deepspeed_moe.gate.register_forward_hook(hook(i))


def synthetic_sample(seed, index, seq_length, vocab_size):
    """Deterministic sample ``index``: noisy arithmetic sequences mod vocab."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = torch.randint(0, vocab_size, (1,), generator=g)
    stride = torch.randint(1, 8, (1,), generator=g)
    tokens = (start + stride * torch.arange(seq_length + 1)) % vocab_size
    noise = torch.rand(seq_length + 1, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab_size, (seq_length + 1,), generator=g), tokens)


def main(argv=None):
    args = parse_args(argv)
    deepspeed.init_distributed()
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    ep_size = args.ep_size or int(ds_config.get("moe", {}).get("ep_size", 1))
    torch.manual_seed(args.seed)
    model = MoEGPT(args, ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters()], "name": "parameters"})
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=groups)

    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()
    rank, world = dist.get_rank(), dist.get_world_size()
    global_batch = micro * accum * world
    state = {"iter": 0}
    if args.log_gate_counts:
        log_gate_counts(engine.module, rank, state)
    if rank == 0:
        print(f"experts {args.num_experts} | ep {ep_size} | dp {world} | micro {micro} | accumulation {accum}",
              flush=True)

    for iteration in range(args.train_iters):
        state["iter"] = iteration + 1
        start = time.perf_counter()
        losses = []
        for mb in range(accum):
            first = iteration * global_batch + rank * micro * accum + mb * micro
            samples = torch.stack([synthetic_sample(args.seed, first + i, args.seq_length, args.vocab_size)
                                   for i in range(micro)]).to(engine.device)
            loss, lm_loss = engine(samples[:, :-1], samples[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(lm_loss.detach())
        local_loss = torch.stack(losses).mean()
        global_loss = local_loss.clone()
        dist.all_reduce(global_loss)
        global_loss = (global_loss / world).item()
        grad_norm = float(engine.get_global_grad_norm())
        step_ms = (time.perf_counter() - start) * 1000.0
        step = iteration + 1
        if args.log_all_ranks:
            with torch.no_grad():
                checksum = sum(float(p.double().sum()) for p in engine.module.parameters())
            sys.stdout.write(f"rank {rank} iter {step} | loss {local_loss.item()!r} | grad_norm {grad_norm!r} "
                             f"| param_checksum {checksum!r}\n")
            sys.stdout.flush()
        if rank == 0:
            sys.stdout.write(f"step {step} | loss {global_loss!r} | grad_norm {grad_norm!r} "
                             f"| step_time_ms {step_ms:.1f}\n")
            sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
