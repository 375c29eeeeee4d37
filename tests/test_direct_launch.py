"""kernels/_launch.CompiledLaunch against Triton's own JITFunction.run, without a GPU.

The kernels are compiled for real (sm_90, as the compile check does) and launched through a
recording driver: Triton's `run` and the direct launch must call the same compiled kernel's
launcher with the same grid, stream and arguments, for arguments that differ in every way
Triton specialises on (dtype, alignment, ints equal to 1, divisible by 16, wider than 32 bits)."""
import functools
import os
import random
import re
import struct
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from transformer_fast._attention_call import AttentionForwardCall
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from transformer_fast.kernels._launch import CompiledLaunch, LaunchPlan, _pack_params  # noqa: E402

TESTS = Path(__file__).resolve().parent  # on sys.path (conftest.py): the `launch` helpers
from launch.gpu_ops import public_ops  # noqa: E402
from launch.recording_driver import STREAM, library, library_launches, recording_driver  # noqa: E402


def scaled_copy(X, Y, stride_x, stride_y, n, alpha, flag, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs * stride_x, mask=offs < n).to(tl.float32)
    if flag:
        x = x * alpha
    tl.store(Y + offs * stride_y, x * SCALE, mask=offs < n)


_PATCHABLE = (tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base, tl.condition, tl.dtype)
# triton.language as collected, before any test ran a kernel under the interpreter
_PRISTINE = {(owner, name): value for owner in _PATCHABLE for name, value in vars(owner).items()}


def _from_interpreter(value):
    """Whether `value` is one of the interpreter's replacements (a function of its module; not the
    jit functions, which are InterpretedFunction objects in this process)."""
    fn = value.func if isinstance(value, functools.partial) else value
    return (isinstance(fn, types.FunctionType) and fn.__module__ == "triton.runtime.interpreter") or value is print


def _unpatch_language():
    """Puts back what Triton's interpreter left patched in triton.language (its device-function
    calls patch without restoring), which would make a real compile here fail inside the
    interpreter's operators ("'value' object has no attribute 'dtype'"); warns naming it."""
    leaked = [(owner, name) for owner in _PATCHABLE for name, value in list(vars(owner).items())
              if _from_interpreter(value)]
    for owner, name in leaked:
        if (owner, name) in _PRISTINE:
            setattr(owner, name, _PRISTINE[owner, name])
        else:
            delattr(owner, name)
    if leaked:
        warnings.warn(f"triton.language was left patched by Triton's interpreter ({len(leaked)} members, e.g. "
                      f"{leaked[0][1]}); restored before compiling for sm_90")


@pytest.fixture
def recording():
    _unpatch_language()
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
    result = subprocess.run([sys.executable, "-m", "launch.check_launches"], cwd=TESTS,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": same") == 44, result.stdout  # 22 direct, 22 packed


def test_native_calls_replay_what_the_python_kernels_launch():
    """Native calls (csrc/launch/native_calls.cpp) of attention and the norms, each made from a recipe
    recorded from a twin call (the same signature, other tensors and seed), through the dispatcher
    (twin ops' CPU kernels): the Python kernel's launches, parameter bytes included, and its
    results, running no Python; calls that differ from a recorded one only in shared addresses or
    the seed's class run the Python kernel; its ValueError reaches the caller. A process of its
    own, as above."""
    result = subprocess.run([sys.executable, "-m", "launch.check_native_calls"], cwd=TESTS,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("native: same") == 16 and result.stdout.count("Python kernel") == 2, result.stdout
    # with TRANSFORMER_FAST_ATOMIC_DQ: the preprocess, dK/dV and the float32 sum's conversion (no dQ kernel)
    assert re.search(r"dQ added atomically +attention_backward +3 launches native: same", result.stdout), result.stdout
    assert result.stdout.rstrip().endswith("layer_norm_forward   ValueError"), result.stdout


def _packed_copy(recording):
    """A CompiledLaunch of scaled_copy with packed launches on, and a plan for it whose `n` is the
    "seed" (the argument that changes from call to call)."""
    launch = CompiledLaunch(JITFunction(scaled_copy))
    launch.direct = launch.native = True
    plan = LaunchPlan((4,), (1, 1, 64, 0.5, True), dict(BLOCK=16, SCALE=2), seed_at=2)
    return launch, plan


def test_packed_launch_passes_the_plan_with_each_calls_tensors_and_seed(recording):
    launch, plan = _packed_copy(recording)
    lib = library()
    x, y = torch.empty(64), torch.empty(64)
    launch.run(plan, (x, y), 64)  # through Triton's run: compiles; the plan keeps the kernel
    assert recording[-1][5] and plan.packed_launch is None  # packed at its second launch only
    launch.run(plan, (x, y), 64)
    compiled, packed = plan.direct[0], plan.packed_launch
    assert packed is not None
    lib.recording_set_param_count(compiled.function, packed.num_params)
    lib.recording_clear()
    n_recorded = len(recording)
    a, b = torch.empty(64), torch.empty(80)[16:]
    launch.run(plan, (a, b), 80)  # packed: the driver's cuLaunchKernel, no launcher
    assert len(recording) == n_recorded
    (function, grid, block, shared, stream, params, attributes), = library_launches()
    block_x, shared_bytes = 32 * compiled.metadata.num_warps, compiled.metadata.shared
    wanted = (compiled.function, (4, 1, 1), (block_x, 1, 1), shared_bytes, STREAM, 0)
    assert (function, grid, block, shared, stream, attributes) == wanted
    # X, Y, stride_x, stride_y (1: a constexpr to Triton, not passed), n, alpha, flag; two scratch pointers
    slots = [params[i:i + 8] for i in range(0, len(params), 8)]
    assert slots == [struct.pack("<Q", a.data_ptr()), struct.pack("<Q", b.data_ptr()), struct.pack("<q", 80),
                     struct.pack("<f", 0.5) + bytes(4), struct.pack("<q", 1), bytes(8), bytes(8)]
    assert packed.pack((a, b), 80) == params


def test_packed_launch_falls_back_refuses_and_reports(recording):
    from transformer_fast import _build

    launch, plan = _packed_copy(recording)
    lib = library()
    x, y = torch.empty(64), torch.empty(64)
    for _ in range(2):
        launch.run(plan, (x, y), 64)
    packed = plan.packed_launch
    n_recorded = len(recording)
    lib.recording_set_context(None)  # a thread without a CUDA context: Triton's launcher sets one up
    try:
        launch.run(plan, (x, y), 64)
    finally:
        lib.recording_set_context(1)
    assert len(recording) == n_recorded + 1 and not recording[-1][5]
    lib.recording_set_launch_result(700)
    try:
        with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
            launch.run(plan, (x, y), 64)
    finally:
        lib.recording_set_launch_result(0)
    with pytest.raises(TypeError, match="argument 1 must be a tensor"):
        packed.launch((x, 3), 64)
    with pytest.raises(ValueError, match="tensor 1 of a launch given 1"):
        packed.launch((x,), 64)
    functions = (1, 1, 0)
    with pytest.raises(ValueError, match="slots of 8 bytes"):
        _build.extension().PackedLaunch(1, (1, 1, 1), 32, 0, bytes(12), [], -1, functions, 0, STREAM)
    with pytest.raises(ValueError, match="seed_param 3"):
        _build.extension().PackedLaunch(1, (1, 1, 1), 32, 0, bytes(16), [], 3, functions, 0, STREAM)
    with pytest.raises(ValueError, match="tensor parameter"):
        _build.extension().PackedLaunch(1, (1, 1, 1), 32, 0, bytes(16), [(2, 0)], -1, functions, 0, STREAM)
    compiled = plan.direct[0]
    for change in (dict(num_ctas=2), dict(launch_pdl=True), dict(global_scratch_size=64), dict(shared=229 * 1024)):
        meta = compiled.metadata._replace(**change)
        twin = types.SimpleNamespace(metadata=meta, src=compiled.src, run=compiled.run)
        assert _pack_params(launch.kernel, twin, plan, 2) is None, change  # launched through Triton's launcher
    assert _pack_params(launch.kernel, compiled, plan, 2) is not None


def test_signature_covers_what_it_keys_and_refuses_the_rest():
    """csrc/launch/launch_signature.cpp: equal for arguments Triton compiles alike only where the fields
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


def test_launch_plan_signature_tells_apart_what_launchers_read():
    """csrc/launch/launch_signature.cpp's launch_plan_signature, the key of the launch plans: equal
    only for calls alike in every dtype, device, size, stride, address mod 16 and value; None for
    what it cannot describe (the launcher then plans the call afresh)."""
    from transformer_fast import _build

    signature = _build.extension().launch_plan_signature
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


def _launch_plans():
    """Every LaunchPlan the launchers hold (inside their plans' namespaces too)."""
    from transformer_fast.kernels import _launch

    def parts(plan):
        if isinstance(plan, _launch.LaunchPlan):
            return [plan]
        if isinstance(plan, types.SimpleNamespace):
            return [p for value in vars(plan).values() for p in parts(value)]
        if isinstance(plan, (tuple, list)):
            return [p for value in plan for p in parts(value)]
        return []
    return [p for plans in _launch.Plans.instances for plan in plans.plans.values() for p in parts(plan)]


def _set_launches(launches, direct, native):
    from transformer_fast.kernels import _launch

    for plans in _launch.Plans.instances:  # plans keep their packed launch (or none) from when they were made
        plans.clear()
    for launch in launches:
        launch.direct, launch.native = direct, native


@pytest.mark.gpu
def test_gpu_direct_launches_give_tritons_results():
    """On a GPU: attention (forward and backward), LayerNorm and linear attention give bitwise the
    results of launches through Triton's run when launched directly, and do launch directly."""
    from transformer_fast.kernels import _launch
    from transformer_fast.kernels import attention as ka

    run, _ = public_ops()
    launches = list(_launch.CompiledLaunch.instances)
    default = [(launch.direct, launch.native) for launch in launches]
    if _launch._DIRECT:  # unless TRANSFORMER_FAST_DIRECT_LAUNCH=0, on by default on a GPU
        assert all(direct for direct, _ in default), "direct launches are off on this GPU"
    try:
        _set_launches(launches, False, False)
        through_run = run()
        _set_launches(launches, True, False)
        run()  # makes the entries
        direct = run()
    finally:
        for launch, (on, native) in zip(launches, default):
            launch.direct, launch.native = on, native
    assert ka.launch_fwd.compiled.entries and ka.launch_dq.compiled.entries and ka.launch_preprocess.entries
    for i, (a, b_) in enumerate(zip(direct, through_run)):
        assert torch.equal(a, b_), f"result {i} differs between direct launches and Triton's run"


@pytest.mark.gpu
def test_gpu_packed_launches_give_tritons_results():
    """On a GPU, with packed launches (csrc/launch/triton_launch.cpp): bitwise the results of launches
    through Triton's run, packed launches made for every op, and launched on the current stream:
    a side stream, and a CUDA graph's capture (where a launch on another stream fails) replayed."""
    from transformer_fast.kernels import _launch
    from transformer_fast.kernels import attention as ka

    run, _ = public_ops()
    launches = list(_launch.CompiledLaunch.instances)
    default = [(launch.direct, launch.native) for launch in launches]
    try:
        _set_launches(launches, False, False)
        through_run = run()
        _set_launches(launches, True, True)
        run()  # makes the entries, the plans and their packed launches
        packed = run()
        made = _launch_plans()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = run()
        torch.cuda.current_stream().wait_stream(side)
        q = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16)
        # planned and packed before capture
        ka.attention_forward(AttentionForwardCall(q, q, q, None, None, True, 0.125, 0.0, 0))
        expected = ka.attention_forward(AttentionForwardCall(q, q, q, None, None, True, 0.125, 0.0, 0))[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ka.attention_forward(AttentionForwardCall(q, q, q, None, None, True, 0.125, 0.0, 0))[0]
        graph.replay()
        torch.cuda.synchronize()
    finally:
        for launch, (on, native) in zip(launches, default):
            launch.direct, launch.native = on, native
    assert made and all(plan.packed_launch is not None for plan in made), \
        "a planned launch was not packed"
    for i, (a, b_, c) in enumerate(zip(packed, through_run, on_side)):
        assert torch.equal(a, b_), f"result {i} differs between packed launches and Triton's run"
        assert torch.equal(c, b_), f"result {i} differs on a side stream"
    assert torch.equal(captured, expected)


@pytest.mark.gpu
def test_gpu_native_calls_give_the_python_kernels_results(tmp_path):
    """On a GPU, in two processes, native calls on and off (TRANSFORMER_FAST_NATIVE_LAUNCH): attention
    (with dropout) and the norms, forward and backward through the public functions, bitwise the
    same; with them on, every call of the attention and norm ops made from a recipe, on a side stream
    and in a replayed CUDA graph too (tests/launch/check_native_calls.gpu_results)."""
    saved = {}
    for native in ("1", "0"):
        path = tmp_path / f"native_{native}.pt"
        env = {**os.environ, "TRANSFORMER_FAST_NATIVE_LAUNCH": native, "TRANSFORMER_FAST_TILE": "0"}
        env.pop("TRITON_INTERPRET", None)
        result = subprocess.run([sys.executable, "-m", "launch.check_native_calls", "--gpu-results",
                                 str(path)], cwd=TESTS, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        saved[native] = torch.load(path)
    on, off = saved["1"], saved["0"]
    # per round: attention forward and backward twice (causal; dropout), LayerNorm and RMSNorm
    # forward and backward
    assert on["replayed"] == dict(attention_forward=2, attention_backward=2, layer_norm_forward=2,
                                  layer_norm_backward=2), on["replayed"]
    assert all(n >= 1 for n in on["recipes"].values()), on["recipes"]
    assert not any(off["recipes"].values()) and not any(off["replayed"].values()), off
    for i, (a, b_) in enumerate(zip(on["results"], off["results"])):
        assert torch.equal(a, b_), f"result {i} differs between native calls and the Python kernels"
    assert torch.equal(on["on_side"], off["results"][0]) and torch.equal(on["captured"], off["results"][0])
