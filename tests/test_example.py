"""examples/train_seq2seq.py: a few steps of a tiny model, eager, compiled and under DDP."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_seq2seq.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))

import train_seq2seq  # noqa: E402

TINY = ["--steps", "4", "--batch-size", "8", "--d-model", "16", "--nhead", "2", "--encoder-layers", "1",
        "--decoder-layers", "1", "--dim-feedforward", "24", "--eval-size", "20", "--max-len", "6",
        "--warmup", "2", "--threads", "1"]


def test_batches_are_reversals():
    args = train_seq2seq.parse_args(["--min-len", "1", "--max-len", "7", "--symbols", "5"])
    src, decoder_input, target = train_seq2seq.make_batch(64, args, torch.Generator().manual_seed(3))
    assert src.shape == (64, 7) and decoder_input.shape == target.shape == (64, 8)
    lengths = (src != train_seq2seq.PAD).sum(1)
    assert lengths.min() >= 1 and lengths.max() <= 7 and len(set(lengths.tolist())) > 3
    for b in range(64):
        n = int(lengths[b])
        assert (src[b, :n] >= train_seq2seq.FIRST_TOKEN).all() and (src[b, n:] == train_seq2seq.PAD).all()
        expected = src[b, :n].flip(0).tolist()
        assert target[b].tolist() == expected + [train_seq2seq.EOS] + [train_seq2seq.PAD] * (7 - n)
        assert decoder_input[b].tolist() == [train_seq2seq.BOS] + expected + [train_seq2seq.PAD] * (7 - n)


def _check_outputs(out_dir, attention, result, steps=4):
    assert 0.0 <= result["held_out_exact_sequence_accuracy"] <= 1.0
    assert result["steps"] == steps
    with open(os.path.join(out_dir, f"result_{attention}.json")) as f:
        saved = json.load(f)
    assert len(saved["losses"]) == steps and all(x > 0 for x in saved["losses"])
    with open(os.path.join(out_dir, f"loss_{attention}.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_example_runs(attention, tmp_path, capsys):
    result = train_seq2seq.main(TINY + ["--attention", attention, "--out", str(tmp_path)])
    _check_outputs(tmp_path, attention, result)
    assert "held-out exact-sequence accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_example_runs_compiled(attention, backend, tmp_path):
    """aot_eager traces forward and backward through dynamo and AOTAutograd (the custom ops' fake
    kernels included) in seconds; inductor also generates code (minutes on 2 cores: slow)."""
    torch._dynamo.reset()
    result = train_seq2seq.main(TINY + ["--attention", attention, "--compile", "--compile-backend", backend,
                                        "--out", str(tmp_path)])
    assert result["compiled"]
    _check_outputs(tmp_path, attention, result)


def test_example_runs_under_ddp(tmp_path):
    proc = subprocess.run([sys.executable, EXAMPLE, *TINY, "--ddp", "2", "--batch-size", "8", "--no-progress",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out exact-sequence accuracy" in proc.stdout
    with open(tmp_path / "result_softmax.json") as f:
        result = json.load(f)
    assert result["processes"] == 2
    _check_outputs(tmp_path, "softmax", result)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_example_learns_reversal(attention, tmp_path):
    """The full default run: >= 95% held-out exact-sequence accuracy."""
    result = train_seq2seq.main(["--attention", attention, "--no-progress", "--out", str(tmp_path)])
    assert result["held_out_exact_sequence_accuracy"] >= 0.95


# ------------------------------------------------------------------------------------------------
# examples/context_parallel.py
# ------------------------------------------------------------------------------------------------
CONTEXT_PARALLEL_COMMAND = ["torchrun", "--standalone", "--nproc_per_node", "2", "examples/context_parallel.py"]


def test_context_parallel_example_runs_under_torchrun():
    """The README's command, as it stands there (torchrun --standalone picks a free port itself),
    with gloo kept on the loopback interface; the example exits 1 if its loss leaves the
    one-process loss."""
    pytest.importorskip("transformers")
    import signal
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = ([torchrun] if os.path.exists(torchrun) else [sys.executable, "-m", "torch.distributed.run"]) + \
        CONTEXT_PARALLEL_COMMAND[1:]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the two processes it started
        out, err = proc.communicate()
        pytest.fail(f"the example did not finish within 300 s:\n{out[-2000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    assert out.count("in one process (relative difference") == 3
    assert "the context-parallel loss matches the one-process loss" in out


def test_readme_shows_the_context_parallel_command():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert " ".join(CONTEXT_PARALLEL_COMMAND) in f.read()
