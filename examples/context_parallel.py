"""Context parallelism on two CPU processes: a tiny Llama-like model (Hugging Face transformers,
random weights, ``attn_implementation="transformer_fast"``) trained for a few steps, each process
holding half of every sequence.

    torchrun --standalone --nproc_per_node 2 examples/context_parallel.py
    torchrun --standalone --nproc_per_node 2 examples/context_parallel.py --mode ulysses --steps 5

Each step, every rank takes its shard of the batch's token ids (``shard_sequence``: with the
head-tail layout rank r holds chunks r and 2w-1-r of 2w, which balances causal attention) and the
global positions of those rows (``shard_positions``, for RoPE), and runs the model inside
``context_parallel``: every attention layer then attends over the whole sequence. The labels are
shifted over the whole sequence before sharding (a model's own ``labels=`` shifts within the
shard), the loss is summed over the shard's tokens and divided by the batch's token count, and
the parameter gradients are summed over the ranks (an all-reduce, as DDP does with its own
averaging). Rank 0 also trains an identical copy in one process on the whole sequences and
prints both losses; the run fails (exit code 1) if they differ by more than ``--tolerance``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from transformer_fast.distributed import context_parallel, shard_positions, shard_sequence


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64, help="whole-sequence length (a multiple of 2 x processes)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--mode", choices=("ring", "all_gather", "ulysses"), default="ring")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss difference accepted")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    return p.parse_args(argv)


def build_model():
    try:
        import transformers
    except ImportError:
        sys.exit("this example needs Hugging Face transformers (pip install transformers)")
    import transformer_fast.integrations.huggingface as tf_hf
    tf_hf.register()
    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      attention_dropout=0.0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="transformer_fast")


def make_batch(step, args, vocab):
    """Token ids (B, N) and next-token targets shifted over the whole sequence (-100: no target)."""
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(step))
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    return ids, targets


def token_loss(model, ids, targets, count, **kwargs):
    """The summed cross-entropy of these rows' tokens over the batch's token count."""
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / count


def train_one_process(model, args):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        ids, targets = make_batch(step, args, model.config.vocab_size)
        loss = token_loss(model, ids, targets, int((targets != -100).sum()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_context_parallel(model, args, group):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    positions = shard_positions(args.seq_len, group)[None]  # this rank's rows' global positions
    losses = []
    for step in range(args.steps):
        ids, targets = make_batch(step, args, model.config.vocab_size)
        count = int((targets != -100).sum())
        with context_parallel(group, mode=args.mode):
            loss = token_loss(model, shard_sequence(ids, group, dim=1), shard_sequence(targets, group, dim=1), count,
                              position_ids=positions)
        loss.backward()
        for p in model.parameters():  # each rank's gradient covers its tokens: the sum is the whole batch's
            dist.all_reduce(p.grad, group=group)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total := loss.detach().clone(), group=group)
        losses.append(float(total))
    return losses


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = build_model()
        reference = train_one_process(copy.deepcopy(model), args) if rank == 0 else None
        losses = train_context_parallel(model, args, dist.group.WORLD)
        dist.barrier()  # every rank done with the group before any leaves it
        if rank != 0:
            return 0
        worst = 0.0
        for step, (ours, ref) in enumerate(zip(losses, reference)):
            difference = abs(ours - ref) / abs(ref)
            worst = max(worst, difference)
            print(f"step {step}: loss {ours:.6f} on {world} processes ({args.mode}), {ref:.6f} in one process "
                  f"(relative difference {difference:.1e})", flush=True)
        if worst > args.tolerance:
            print(f"FAILED: the context-parallel loss differs from the one-process loss by {worst:.1e} "
                  f"(> {args.tolerance:.0e})", flush=True)
            return 1
        print(f"the context-parallel loss matches the one-process loss (largest relative difference {worst:.1e})",
              flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Not sys.exit: gloo's worker threads may still be freeing a finished collective's tensors,
    # which takes the GIL, and a thread that asks for it while the interpreter shuts down aborts
    # the process ("terminate called without an active exception", pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
