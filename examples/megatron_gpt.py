"""Minimal Megatron-core GPT pretraining recipe.

Launch with torchrun, e.g.::

    torchrun --nproc-per-node 8 examples/megatron_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

The model is a GPTModel built from Megatron-core's local (non Transformer
Engine) layer spec, optionally with MoE layers (``--num-experts``). Training
data is synthetic and deterministic: sample ``i`` of the global sample stream
is generated from ``--seed`` and ``i`` only, and each data-parallel rank
consumes its own slice of every global batch, so two runs with the same
arguments see exactly the same tokens.

After every iteration the ranks on the last pipeline stage with tensor
parallel rank 0 print::

    step N | loss <repr(float)> | grad_norm <repr(float)> | step_time_ms <ms>

With ``--log-all-ranks`` every rank also prints its grad norm and a checksum of
its parameter shard::

    rank R iter N | grad_norm <repr(float)> | param_checksum <repr(float)>
"""

import argparse
import os
import random
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Megatron-core GPT pretraining (synthetic data)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--vocab-size", type=int, default=128)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
                   default=None, help="default: aux_loss when --moe-aux-loss-coeff > 0, else none")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="tokens beyond capacity factor x fair share per expert are dropped (default: dropless)")
    g.add_argument(
        "--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="alltoall"
    )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="default: 4 micro-batches per data-parallel rank",
    )
    g.add_argument("--train-iters", type=int, default=3)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--replicate-data", action="store_true",
                   help="every data-parallel replica draws the same samples (replicas stay identical), "
                        "independent of the data-parallel size")
    g.add_argument("--log-all-ranks", action="store_true",
                   help="every rank also prints its grad norm and a parameter checksum each step")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- setup


def initialize_distributed(args):
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo",
        rank=rank,
        world_size=world_size,
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )


def set_random_seed(seed):
    # Same scheme as Megatron-LM: different seeds per pipeline stage, and
    # tensor/expert-parallel aware CUDA RNG streams.
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_config(args):
    kwargs = {}
    if args.num_experts:
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type
            or ("aux_loss" if args.moe_aux_loss_coeff > 0 else "none"),
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=False,
        )
        if args.moe_expert_capacity_factor is not None:
            kwargs["moe_expert_capacity_factor"] = args.moe_expert_capacity_factor
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        **kwargs,
    )


def build_model(args, config):
    layer_spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


# --------------------------------------------------------------------------- data


def synthetic_sample(seed, index, seq_length, vocab_size):
    """Deterministic sample ``index``: noisy arithmetic sequences mod vocab."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = torch.randint(0, vocab_size, (1,), generator=g)
    stride = torch.randint(1, 8, (1,), generator=g)
    tokens = (start + stride * torch.arange(seq_length + 1)) % vocab_size
    noise = torch.rand(seq_length + 1, generator=g) < 0.05
    tokens = torch.where(noise, torch.randint(0, vocab_size, (seq_length + 1,), generator=g), tokens)
    return tokens


def first_sample(args, num_microbatches: int, iteration: int, dp_rank: int) -> int:
    """Index, in the global sample stream, of a data-parallel rank's first sample of an iteration.

    Each replica takes its own slice of every global batch. With ``--replicate-data`` every
    replica takes the same ``micro-batch size x micro-batches`` samples per iteration, from a
    stream that does not depend on the data-parallel size: a replica sees the same tokens in a
    world of 8 ranks as in one of 8,192 (for the same per-replica batch)."""
    per_dp = args.micro_batch_size * num_microbatches
    if args.replicate_data:
        return iteration * per_dp
    return iteration * args.global_batch_size + dp_rank * per_dp


def data_iterator(args, num_microbatches, iteration):
    base = first_sample(args, num_microbatches, iteration, parallel_state.get_data_parallel_rank())
    device = torch.cuda.current_device()
    position_ids = torch.arange(args.seq_length).unsqueeze(0).expand(args.micro_batch_size, -1)
    causal = torch.tril(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool))
    attention_mask = (~causal).view(1, 1, args.seq_length, args.seq_length)
    for mb in range(num_microbatches):
        first = base + mb * args.micro_batch_size
        samples = torch.stack(
            [
                synthetic_sample(args.seed, first + i, args.seq_length, args.vocab_size)
                for i in range(args.micro_batch_size)
            ]
        )
        batch = {
            "tokens": samples[:, :-1].contiguous(),
            "labels": samples[:, 1:].contiguous(),
            "loss_mask": torch.ones(args.micro_batch_size, args.seq_length, dtype=torch.float),
            "position_ids": position_ids.contiguous(),
            "attention_mask": attention_mask,
        }
        if args.context_parallel_size > 1:
            from megatron.core.utils import get_batch_on_this_cp_rank

            batch = get_batch_on_this_cp_rank(batch)
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# --------------------------------------------------------------------------- step


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.cat([torch.sum(losses.view(-1) * loss_mask).view(1), loss_mask.sum().view(1)])
    if parallel_state.get_context_parallel_world_size() > 1:
        dist.all_reduce(loss, group=parallel_state.get_context_parallel_group())
    loss = loss[0] / loss[1]
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iter, model):
    batch = next(data_iter)
    output_tensor = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output_tensor, partial(loss_func, batch["loss_mask"])


def reduce_loss(losses_reduced):
    """Average the reported loss over micro-batches and data-parallel ranks."""
    loss = torch.stack([x["lm loss"] for x in losses_reduced]).mean()
    dp_group = parallel_state.get_data_parallel_group()
    dist.all_reduce(loss, group=dp_group)
    return (loss / dist.get_world_size(group=dp_group)).item()


def main(argv=None):
    args = parse_args(argv)
    # Megatron's tensor-parallel layers want one CUDA work queue so that
    # communication and compute overlap stays ordered (Megatron-LM scripts
    # export the same); it must be set before CUDA is initialised.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    initialize_distributed(args)
    set_random_seed(args.seed)

    dp_size = parallel_state.get_data_parallel_world_size()
    if args.global_batch_size is None:
        args.global_batch_size = 4 * args.micro_batch_size * dp_size
    assert args.global_batch_size % (args.micro_batch_size * dp_size) == 0, (
        f"global batch {args.global_batch_size} not divisible by "
        f"micro batch {args.micro_batch_size} x data parallel {dp_size}"
    )
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp_size)

    config = build_config(args)
    model = build_model(args, config)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.95,
            clip_grad=args.clip_grad,
            bf16=False,
            fp16=False,
            params_dtype=torch.float32,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        [model],
    )
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads

    is_logging_rank = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    forward_backward = get_forward_backward_func()

    for iteration in range(args.train_iters):
        torch.cuda.synchronize()
        start = time.perf_counter()

        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data_iterator(args, num_microbatches, iteration),
            model=model,
            num_microbatches=num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        torch.cuda.synchronize()
        step_time_ms = (time.perf_counter() - start) * 1000.0

        step = iteration + 1
        if args.log_all_ranks:
            with torch.no_grad():
                checksum = sum(float(p.double().sum()) for p in model.parameters())
            sys.stdout.write(f"rank {dist.get_rank()} iter {step} | grad_norm {grad_norm!r} "
                             f"| param_checksum {checksum!r}\n")
            sys.stdout.flush()
        if parallel_state.is_pipeline_last_stage():
            loss = reduce_loss(losses_reduced)
            if is_logging_rank and (step % args.log_interval == 0 or step == args.train_iters):
                # One write per line so lines from concurrent ranks never interleave.
                sys.stdout.write(
                    f"step {step} | loss {loss!r} | grad_norm {grad_norm!r} "
                    f"| step_time_ms {step_time_ms:.1f}\n"
                )
                sys.stdout.flush()

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
