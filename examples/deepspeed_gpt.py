"""Minimal DeepSpeed ZeRO GPT pretraining recipe (ZeRO stage 1, 2 or 3 from the JSON config).

Launch it the way DeepSpeed jobs are launched, e.g.::

    deepspeed --num_gpus 8 examples/deepspeed_gpt.py --deepspeed --deepspeed_config examples/ds_configs/zero3.json
    torchrun --nproc-per-node 8 examples/deepspeed_gpt.py --deepspeed_config examples/ds_configs/zero2.json

The model is a small decoder-only transformer; training data is synthetic and deterministic:
sample ``i`` of the global sample stream depends on ``--seed`` and ``i`` only, and each
data-parallel rank consumes its own slice of every global batch (micro-batch size and
gradient accumulation come from the DeepSpeed config).

After every step rank 0 prints::

    step N | loss <repr(float)> | grad_norm <repr(float)> | step_time_ms <ms>

With ``--log-all-ranks`` every rank prints its own values and a checksum of the parameters
it holds (its ZeRO-3 partition, or the full replica for stage 1/2)::

    rank R iter N | loss <repr> | grad_norm <repr> | param_checksum <repr>
"""

import argparse
import json
import math
import os
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DeepSpeed ZeRO GPT pretraining (synthetic data)")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--train-iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-all-ranks", action="store_true",
                   help="every rank prints its loss, grad norm and a parameter checksum each step")
    p = deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(h // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok = nn.Embedding(args.vocab_size, args.hidden_size)
        self.pos = nn.Embedding(args.seq_length, args.hidden_size)
        self.blocks = nn.ModuleList(Block(args.hidden_size, args.num_attention_heads) for _ in range(args.num_layers))
        self.ln = nn.LayerNorm(args.hidden_size)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, tokens, labels):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def synthetic_sample(seed, index, seq_length, vocab_size):
    """Deterministic sample ``index``: noisy arithmetic sequences mod vocab."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = torch.randint(0, vocab_size, (1,), generator=g)
    stride = torch.randint(1, 8, (1,), generator=g)
    tokens = (start + stride * torch.arange(seq_length + 1)) % vocab_size
    noise = torch.rand(seq_length + 1, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab_size, (seq_length + 1,), generator=g), tokens)


def micro_batch(args, first, size, device):
    samples = torch.stack([synthetic_sample(args.seed, first + i, args.seq_length, args.vocab_size)
                           for i in range(size)])
    return samples[:, :-1].to(device), samples[:, 1:].to(device)


def param_checksum(engine):
    """Sum of the parameters this rank holds (ZeRO-3: its partition, without the padding)."""
    total = 0.0
    part_rank = engine.data_parallel_group.rank()
    with torch.no_grad():
        for p in engine.module.parameters():
            if hasattr(p, "ds_tensor"):
                size = p.ds_tensor.numel()
                valid = min(max(p.ds_numel - part_rank * size, 0), size)
                local = p.ds_tensor.narrow(0, 0, valid)
            else:
                local = p
            total += float(local.double().sum())
    return total


def main(argv=None):
    args = parse_args(argv)
    local_rank_arg = args.local_rank  # as given on the command line (deepspeed.initialize fills it in)
    deepspeed.init_distributed()
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    torch.manual_seed(args.seed)
    model = GPT(args)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()
    dp_rank, dp_size = engine.data_parallel_group.rank(), engine.data_parallel_group.size()
    global_batch = micro * accum * dp_size
    rank = dist.get_rank()
    if rank == 0:
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        print(f"zero stage {stage} | dp {dp_size} | micro {micro} | accumulation {accum} "
              f"| local_rank arg {local_rank_arg}", flush=True)

    for iteration in range(args.train_iters):
        start = time.perf_counter()
        losses = []
        for mb in range(accum):
            first = iteration * global_batch + dp_rank * micro * accum + mb * micro
            tokens, labels = micro_batch(args, first, micro, engine.device)
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        local_loss = torch.stack(losses).mean()
        global_loss = local_loss.clone()
        dist.all_reduce(global_loss, group=engine.data_parallel_group)
        global_loss = (global_loss / dp_size).item()
        grad_norm = float(engine.get_global_grad_norm())
        step_ms = (time.perf_counter() - start) * 1000.0
        step = iteration + 1
        if args.log_all_ranks:
            sys.stdout.write(f"rank {rank} iter {step} | loss {local_loss.item()!r} | grad_norm {grad_norm!r} "
                             f"| param_checksum {param_checksum(engine)!r}\n")
            sys.stdout.flush()
        if rank == 0:
            sys.stdout.write(f"step {step} | loss {global_loss!r} | grad_norm {grad_norm!r} "
                             f"| step_time_ms {step_ms:.1f}\n")
            sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
