"""Trains transformer_fast's encoder-decoder Transformer to reverse token sequences, on the CPU.

Each example is a random sequence of ``--min-len``..``--max-len`` tokens; the target is the same
sequence reversed, then EOS. Sequences are right-padded to a fixed length (so ``--compile`` sees
one shape). The held-out accuracy is the fraction of held-out sequences that greedy, cached
decoding (``model.generate``) reproduces exactly, EOS included.

    python examples/train_seq2seq.py --attention softmax --out runs/softmax
    python examples/train_seq2seq.py --attention linear --out runs/linear
    python examples/train_seq2seq.py --ddp 2            # 2 gloo processes (or run it under torchrun)
    python examples/train_seq2seq.py --compile          # torch.compile the training forward

Writes ``<out>/loss_<attention>.png`` (the training loss curve) and ``<out>/result_<attention>.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from transformer_fast import Seq2SeqTransformer

PAD, BOS, EOS = 0, 1, 2
FIRST_TOKEN = 3  # ids FIRST_TOKEN.. are the sequence symbols


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=["softmax", "linear"], default="softmax")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size (split over DDP processes)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps, then cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--nhead", type=int, default=4)
    p.add_argument("--encoder-layers", type=int, default=2)
    p.add_argument("--decoder-layers", type=int, default=2)
    p.add_argument("--dim-feedforward", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--norm-first", action="store_true", help="pre-LayerNorm layers")
    p.add_argument("--symbols", type=int, default=10, help="distinct sequence symbols")
    p.add_argument("--min-len", type=int, default=3)
    p.add_argument("--max-len", type=int, default=10)
    p.add_argument("--eval-size", type=int, default=500, help="held-out sequences")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores / processes)")
    p.add_argument("--ddp", type=int, default=1, metavar="N",
                   help="spawn N processes training with DistributedDataParallel (gloo)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--out", default="runs/seq2seq", help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        p.error(f"need 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    if args.batch_size % args.ddp:
        p.error(f"--batch-size {args.batch_size} must be divisible by --ddp {args.ddp}")
    return args


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
def make_batch(n, args, generator):
    """src (n, max_len), decoder input (n, max_len + 1) = BOS + reversed, target (n, max_len + 1)
    = reversed + EOS, all right-padded with PAD."""
    L = args.max_len
    lengths = torch.randint(args.min_len, L + 1, (n,), generator=generator)
    symbols = torch.randint(FIRST_TOKEN, FIRST_TOKEN + args.symbols, (n, L), generator=generator)
    position = torch.arange(L)
    valid = position[None, :] < lengths[:, None]
    src = torch.where(valid, symbols, PAD)
    # reversed[b, t] = src[b, length_b - 1 - t] for t < length_b
    source_index = (lengths[:, None] - 1 - position[None, :]).clamp(min=0)
    reversed_ = torch.where(valid, src.gather(1, source_index), PAD)
    target = torch.cat([reversed_, torch.full((n, 1), PAD)], 1)
    target[torch.arange(n), lengths] = EOS
    decoder_input = torch.cat([torch.full((n, 1), BOS), reversed_], 1)
    return src, decoder_input, target


@torch.no_grad()
def exact_sequence_accuracy(model, src, target, batch_size=250):
    """Fraction of sequences whose greedy decoding equals target (up to and with EOS)."""
    correct = 0
    for i in range(0, src.shape[0], batch_size):
        s, t = src[i:i + batch_size], target[i:i + batch_size]
        out = model.generate(s, t.shape[1], BOS, EOS)[:, 1:]
        out = F.pad(out, (0, t.shape[1] - out.shape[1]), value=PAD)
        correct += int((out == t).all(1).sum())
    return correct / src.shape[0]


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def build_model(args):
    return Seq2SeqTransformer(
        FIRST_TOKEN + args.symbols, pad_id=PAD, d_model=args.d_model, nhead=args.nhead,
        num_encoder_layers=args.encoder_layers, num_decoder_layers=args.decoder_layers,
        dim_feedforward=args.dim_feedforward, dropout=args.dropout, norm_first=args.norm_first,
        attention=args.attention, max_len=args.max_len + 2)


def learning_rate(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def save_loss_curve(losses, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, alpha=0.5, label="loss")
    window = max(1, len(losses) // 50)
    if len(losses) >= window > 1:
        smooth = torch.tensor(losses).unfold(0, window, 1).mean(1).tolist()
        ax.plot(range(window, len(losses) + 1), smooth, lw=1.5, label=f"mean of {window}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(args, rank=0, world_size=1):
    """Trains (one process of) the run; returns the result dict on rank 0 (None elsewhere)."""
    distributed = world_size > 1
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    threads = args.threads or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    model = build_model(args)
    step_model = model
    if distributed:
        step_model = torch.nn.parallel.DistributedDataParallel(model)
    if args.compile:
        step_model = torch.compile(step_model, backend=args.compile_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                  weight_decay=args.weight_decay)
    data = torch.Generator().manual_seed(args.seed * 1000 + 1 + rank)  # each rank its own stream
    local_batch = args.batch_size // world_size

    losses = []
    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, desc=f"{args.attention} attention", unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        src, decoder_input, target = make_batch(local_batch, args, data)
        logits = step_model(src, decoder_input)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=PAD)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.detach()
        if distributed:
            dist.all_reduce(value)
            value /= world_size
        losses.append(value.item())
        if progress is not None:
            progress.update(1)
            if step % 10 == 0 or step == args.steps - 1:
                progress.set_postfix(loss=f"{losses[-1]:.4f}")
    train_seconds = time.perf_counter() - start
    if progress is not None:
        progress.close()
    if rank != 0:
        return None

    held_out = torch.Generator().manual_seed(10_000_019 + args.seed)  # never a training stream
    src, _, target = make_batch(args.eval_size, args, held_out)
    model.eval()
    accuracy = exact_sequence_accuracy(model, src, target)
    result = dict(attention=args.attention, steps=args.steps, batch_size=args.batch_size,
                  processes=world_size, compiled=args.compile, final_loss=losses[-1],
                  held_out_exact_sequence_accuracy=accuracy, held_out_sequences=args.eval_size,
                  train_seconds=round(train_seconds, 1), threads_per_process=threads)
    os.makedirs(args.out, exist_ok=True)
    save_loss_curve(losses, os.path.join(args.out, f"loss_{args.attention}.png"),
                    f"reversal, {args.attention} attention: held-out accuracy {accuracy:.1%}")
    with open(os.path.join(args.out, f"result_{args.attention}.json"), "w") as f:
        json.dump(dict(result, losses=losses), f)
    print(f"held-out exact-sequence accuracy ({args.attention} attention, {args.steps} steps, "
          f"{train_seconds:.0f} s): {accuracy:.4f}", flush=True)
    return result


# ------------------------------------------------------------------------------------------------
# Processes
# ------------------------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_without_interpreter_shutdown(code):
    """Ends a process that used gloo once its work is done. gloo's worker threads may still be
    freeing a finished collective's tensors, which takes the GIL; a thread that asks for the GIL
    while the interpreter shuts down aborts the process with "terminate called without an active
    exception" (pytorch/pytorch#190489; 4 of 58 runs of this example with --ddp 2 did)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawned_worker(rank, args, world_size, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()
    exit_without_interpreter_shutdown(0)


def main(argv=None):
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun
        dist.init_process_group("gloo")
        try:
            return train(args, dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
    if args.ddp > 1:
        mp.spawn(_spawned_worker, args=(args, args.ddp, _free_port()), nprocs=args.ddp, join=True)
        return None
    return train(args)


if __name__ == "__main__":
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun
        exit_without_interpreter_shutdown(0)
