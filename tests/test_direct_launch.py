"""kernels/_launch.CompiledLaunch against Triton's own JITFunction.run, without a GPU.

The kernels are compiled for real (sm_90, as the compile check does) and launched through a
recording driver: Triton's `run` and the direct launch must call the same compiled kernel's
launcher with the same grid, stream and arguments, for arguments that differ in every way
Triton specialises on (dtype, alignment, ints equal to 1, divisible by 16, wider than 32 bits)."""
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from transformer_fast.kernels._launch import CompiledLaunch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` is run from the repository root, not installed
from benchmarks.tools.recording_driver import recording_driver  # noqa: E402


def scaled_copy(X, Y, stride_x, stride_y, n, alpha, flag, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs * stride_x, mask=offs < n).to(tl.float32)
    if flag:
        x = x * alpha
    tl.store(Y + offs * stride_y, x * SCALE, mask=offs < n)


@pytest.fixture
def recording():
    with recording_driver() as launches:
        yield launches


def _calls(seed):
    """Argument sets that vary what Triton specialises on: a base call, then variants that each
    differ from it in one such way (so a key that missed it would launch the base's kernel), each
    made twice; then random mixtures, each pattern repeated."""
    base = torch.empty(64, dtype=torch.float32)
    base16 = torch.empty(64, dtype=torch.float16)
    first = ((base, base, 16, 1, 33, 2.0, True), dict(BLOCK=16, SCALE=2, num_warps=1))
    variants = [((0, base[1:]),), ((0, base16),), ((0, base16[8:]),), ((1, base[4:]),), ((2, 17),), ((2, 1),),
                ((2, 2 ** 31 + 16),), ((2, -2 ** 31 - 16),), ((2, 2 ** 63 + 16),), ((3, 16),), ((4, 1),),
                ((4, 16),), ((5, 0.5),), ((6, False),), (("BLOCK", 32),), (("SCALE", 1),), (("num_warps", 2),)]
    calls = [first, first]
    for changes in variants:
        args, kwargs = list(first[0]), dict(first[1])
        for where, value in changes:
            if isinstance(where, int):
                args[where] = value
            else:
                kwargs[where] = value
        calls += [(tuple(args), kwargs)] * 2 + [first]
    rng = random.Random(seed)
    mixed = []
    for _ in range(20):
        args = (rng.choice([base, base[1:], base16, base16[8:]]), rng.choice([base, base[4:], base[3:]]),
                rng.choice([1, 2, 16, 17, 2 ** 31 + 16]), 1, rng.choice([1, 16, 33]), rng.choice([0.5, 2.0]),
                rng.choice([True, False]))
        mixed.append((args, dict(BLOCK=rng.choice([16, 32]), SCALE=rng.choice([1, 2]), num_warps=rng.choice([1, 2]))))
    return calls + mixed + mixed


def test_direct_launch_calls_what_triton_would(recording):
    jit = JITFunction(scaled_copy)
    launch = CompiledLaunch(jit)
    launch.direct = True  # the package turns it off under the interpreter, which tests run under
    direct = 0
    for args, kwargs in _calls(0):
        grid = lambda meta: (triton.cdiv(args[4], meta["BLOCK"]),)  # noqa: E731
        launch(grid, *args, **kwargs)
        ours = recording[-1]
        jit.run(*args, grid=grid, warmup=False, **kwargs)
        theirs = recording[-1]
        assert theirs[5], "Triton's own run passes its launch hooks"
        direct += not ours[5]
        assert ours[0] is theirs[0], "not the kernel Triton compiled for these arguments"
        assert ours[1:5] == theirs[1:5]
    assert direct >= 1 + 2 * len(_calls(0)) // 5  # the repeats, at least
    assert len(launch.entries) > 18


def test_hooks_and_keyword_runtime_arguments_go_through_triton(recording):
    jit = JITFunction(scaled_copy)
    launch = CompiledLaunch(jit)
    launch.direct = True
    x = torch.empty(64)
    args = (x, x, 1, 1, 64, 2.0, True)
    for _ in range(2):
        launch((4,), *args, BLOCK=16, SCALE=1)
    assert not recording[-1][5] and len(launch.entries) == 1

    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        launch((4,), *args, BLOCK=16, SCALE=1)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert recording[-1][5], "a launch hook is installed: the launch must go through Triton"

    jit.pre_run_hooks.append(lambda *a, **k: seen.append("pre-run"))
    try:
        launch((4,), *args, BLOCK=16, SCALE=1)
    finally:
        jit.pre_run_hooks.clear()
    assert recording[-1][5] and "pre-run" in seen

    for _ in range(2):  # `flag`, a run-time argument, by name: never kept
        launch((4,), *args[:6], flag=True, BLOCK=16, SCALE=1)
        assert recording[-1][5]
    for _ in range(2):  # None (a constexpr to Triton): not keyed on here, so always through Triton
        launch((4,), x, x, 1, 1, 64, 2.0, None, BLOCK=16, SCALE=1)
        assert recording[-1][5]
    launch.forget()
    launch((4,), *args, BLOCK=16, SCALE=1)
    assert recording[-1][5] and len(launch.entries) == 1


def test_package_launchers_launch_directly_what_triton_would():
    """The package's own launchers (attention forward and backward, LayerNorm, RMSNorm, linear
    attention) with their real kernels, as the CUDA key runs them: directly and through Triton's
    run, the same launches; and launched through a plan made by a twin call (the same signature,
    other tensors and dropout seed), what a plan of their own would launch. A process of its own:
    the kernels must be jit functions, which they are not under this process's TRITON_INTERPRET=1."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.tools.launch_overhead_triton", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": same") == 22, result.stdout


def test_signature_covers_what_it_keys_and_refuses_the_rest():
    """csrc/launch_signature.cpp: equal for arguments Triton compiles alike only where the fields
    it keys agree; None (the launch goes through Triton) for what it does not cover."""
    from transformer_fast import _build

    signature = _build.extension().triton_launch_signature
    x = torch.empty(8)
    assert signature((x, 16, 0.5, True)) == signature((torch.empty(8), 32, 2.0, False))  # aligned, 0 mod 16
    assert signature((x, 16)) != signature((x[1:], 16))  # alignment
    assert signature((x, 16)) != signature((x.half(), 16))  # dtype
    for a, b in ((1, 17), (16, 17), (16, 2 ** 31 + 16), (2 ** 31 + 16, 2 ** 63 + 16), (-16, -2 ** 31 - 16),
                 (1, True), (1, 1.0)):
        assert signature((x, a)) != signature((x, b)), (a, b)

    class Subclass(torch.Tensor):
        pass

    for other in (None, (1, 2), 2 ** 64, -2 ** 63 - 1, x.as_subclass(Subclass), torch.float32, "s"):
        assert signature((x, other)) is None, other
    assert signature((torch.nn.Parameter(x), 1)) == signature((x, 1))
    assert signature(()) == b""


def test_call_signature_tells_apart_what_launchers_read():
    """csrc/launch_signature.cpp's call_signature, the key of the launch plans: equal only for calls
    alike in every dtype, device, size, stride, address mod 16 and value; None for what it cannot
    describe (the launcher then plans the call afresh)."""
    from transformer_fast import _build

    signature = _build.extension().call_signature
    x = torch.empty(4, 6)
    base = (x, None, 1, 0.5, True, (3, -1))
    assert signature(base) == signature((torch.empty(4, 6), None, 1, 0.5, True, (3, -1)))
    variants = [(torch.empty(6, 4),), (torch.empty(4, 6).t().contiguous().t(),), (torch.empty(4, 6).double(),),
                (torch.empty(25)[1:].view(4, 6),), (torch.empty(4, 6, 1),), (torch.empty(4, 6, device="meta"),),
                (x, x), (x, None, 2), (x, None, True), (x, None, 1, 0.25), (x, None, 1, 1), (x, None, 1, 0.5, False),
                (x, None, 1, 0.5, True, (3, 1)), (x, None, 1, 0.5, True, [3, -1, 0]), (x, None, 1, 0.5, True, (3,)),
                ((x, None), 1)]
    others = [signature(v + base[len(v):]) for v in variants]
    assert signature(base) not in others and len(set(others)) == len(others)
    assert signature((x, ((1, 2), 3))) != signature((x, ((1,), 2, 3)))  # nesting is part of it
    for unsupported in ("s", torch.float32, 2 ** 63, object()):
        assert signature((x, unsupported)) is None, unsupported


@pytest.mark.gpu
def test_gpu_direct_launches_give_tritons_results():
    """On a GPU: attention (forward and backward), LayerNorm and linear attention give bitwise the
    results of launches through Triton's run when launched directly, and do launch directly."""
    import transformer_fast as tf
    from transformer_fast.kernels import _launch
    from transformer_fast.kernels import attention as ka

    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    x, r = torch.randn(2, 300, 96, device="cuda"), torch.randn(2, 300, 96, device="cuda")
    w, b = (torch.randn(96, device="cuda", requires_grad=True) for _ in range(2))
    xg = x.clone().requires_grad_()

    def run():
        for t in (q, k, v, w, b, xg):
            t.grad = None
        out = tf.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().square().sum().backward()
        y, h = tf.layer_norm(xg, (96,), w, b, residual=r)
        (y * h).sum().backward()
        lin = tf.linear_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
        return [t.clone() for t in (out, q.grad, k.grad, v.grad, y, h, xg.grad, w.grad, b.grad, lin)]

    launches = list(_launch.CompiledLaunch.instances)
    default = [launch.direct for launch in launches]
    if _launch._DIRECT:  # unless TRANSFORMER_FAST_DIRECT_LAUNCH=0, on by default on a GPU
        assert all(default), "direct launches are off on this GPU"
    try:
        for launch in launches:
            launch.direct = False
        through_run = run()
        for launch in launches:
            launch.direct = True
        run()  # makes the entries
        direct = run()
    finally:
        for launch, on in zip(launches, default):
            launch.direct = on
    assert ka.launch_fwd.compiled.entries and ka.launch_dq.compiled.entries and ka.launch_preprocess.entries
    for i, (a, b_) in enumerate(zip(direct, through_run)):
        assert torch.equal(a, b_), f"result {i} differs between direct launches and Triton's run"
