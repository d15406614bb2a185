"""Minimal DeepSpeed pipeline-parallel GPT recipe: a ``deepspeed.pipe.PipelineModule`` trained
by DeepSpeed's pipeline engine (``engine.train_batch``).

Launch it the way DeepSpeed jobs are launched, e.g.::

    deepspeed --num_gpus 8 examples/deepspeed_pipe.py --deepspeed_config examples/ds_configs/pipe.json

The number of pipeline stages is the DeepSpeed config's ``pipeline.stages`` (what
``prism-launch integration.kind=deepspeed target.parallel.pp=N`` renders); the remaining
ranks are data-parallel replicas. Micro-batch size and the number of micro-batches per step
(``gradient_accumulation_steps``) come from the config. Training data is synthetic and
deterministic: sample ``i`` of the global sample stream depends on ``--seed`` and ``i``
only; each data-parallel replica consumes its own slice of every global batch. Layer
weights are seeded per layer, so the model is the same whatever the stage partition.

After every step rank 0 prints (the pipeline engine hands every rank the loss of its last
stage, averaged over micro-batches and data-parallel replicas)::

    step N | loss <repr(float)> | grad_norm <repr(float)> | step_time_ms <ms>

With ``--log-all-ranks`` every rank prints its values and a checksum of its stage's parameters::

    rank R iter N | loss <repr> | grad_norm <repr> | param_checksum <repr>
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
from deepspeed.pipe import LayerSpec, PipelineModule


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DeepSpeed pipeline-parallel GPT pretraining (synthetic data)")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    p.add_argument("--num-layers", type=int, default=4)
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


class Embed(nn.Module):
    def __init__(self, vocab, seq, hidden):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


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


class Head(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def synthetic_sample(seed, index, seq_length, vocab_size):
    """Deterministic sample ``index``: noisy arithmetic sequences mod vocab."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = torch.randint(0, vocab_size, (1,), generator=g)
    stride = torch.randint(1, 8, (1,), generator=g)
    tokens = (start + stride * torch.arange(seq_length + 1)) % vocab_size
    noise = torch.rand(seq_length + 1, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab_size, (seq_length + 1,), generator=g), tokens)


def batches(args, first, micro, accum, device):
    for mb in range(accum):
        samples = torch.stack([synthetic_sample(args.seed, first + mb * micro + i, args.seq_length, args.vocab_size)
                               for i in range(micro)])
        yield samples[:, :-1].to(device), samples[:, 1:].to(device)


def main(argv=None):
    args = parse_args(argv)
    deepspeed.init_distributed()
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    stages = int(ds_config.get("pipeline", {}).get("stages", 1))
    torch.manual_seed(args.seed)
    layers = [LayerSpec(Embed, args.vocab_size, args.seq_length, args.hidden_size),
              *[LayerSpec(Block, args.hidden_size, args.num_attention_heads) for _ in range(args.num_layers)],
              LayerSpec(Head, args.hidden_size, args.vocab_size)]
    model = PipelineModule(layers=layers, num_stages=stages, loss_fn=loss_fn, partition_method="uniform",
                           seed_layers=True, base_seed=args.seed)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])

    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()
    dp_rank, dp_size = engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size()
    global_batch = micro * accum * dp_size
    rank = dist.get_rank()
    if rank == 0:
        print(f"pipeline stages {stages} | dp {dp_size} | micro {micro} | micro-batches {accum}", flush=True)

    for iteration in range(args.train_iters):
        start = time.perf_counter()
        first = iteration * global_batch + dp_rank * micro * accum
        loss = float(engine.train_batch(data_iter=batches(args, first, micro, accum, engine.device)))
        grad_norm = float(engine.get_global_grad_norm())
        step_ms = (time.perf_counter() - start) * 1000.0
        step = iteration + 1
        if args.log_all_ranks:
            with torch.no_grad():
                checksum = sum(float(p.double().sum()) for p in engine.module.parameters())
            sys.stdout.write(f"rank {rank} iter {step} | loss {loss!r} | grad_norm {grad_norm!r} "
                             f"| param_checksum {checksum!r}\n")
            sys.stdout.flush()
        if rank == 0:
            sys.stdout.write(f"step {step} | loss {loss!r} | grad_norm {grad_norm!r} | step_time_ms {step_ms:.1f}\n")
            sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
