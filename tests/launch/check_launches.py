"""Checks, without a GPU, that the Triton ops' CUDA kernels launch directly (kernels/_launch.py)
and packed (csrc/launch/triton_launch.cpp) exactly as through Triton's own `JITFunction.run`.

    python -m launch.check_launches [--triton-launcher]     (from tests/; tests/test_direct_launch.py runs it)

Runs what the dispatcher runs for each op on a GPU (transformer_fast/_device_kernels.py: the op's
kernel and its Triton launcher) on small CPU tensors, with the kernels compiled for sm_90 and
launched into a recording driver (recording_driver.py). Makes every call both ways and compares
what reached the launcher: the same compiled kernel, grid, stream and arguments (new outputs
compared by dtype, shape, strides and alignment); then, for calls that vary every way the launch
plans depend on (dropout seeds, masks, packed sequences, splits, strides, alignment), that a plan
made by a twin call (the same signature, other tensors and seed) launches each call as a plan of
its own would, input tensors compared by identity; then that each packed launch passes the CUDA
driver what Triton's launcher would for the same launch: the kernel, grid, block, shared memory,
stream, and every parameter's bytes as Triton's signature types them (the types' sizes from
Triton's own table). `--triton-launcher` compares the packed launches with what Triton's own
launcher (its C code, built against the recording CUDA library) passes the driver. The first call
of each op compiles its kernels (seconds; Triton keeps them on disk). Exits 1 on a difference."""
import argparse
import os
import struct
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be jit functions, not interpreter objects
os.environ.setdefault("TRANSFORMER_FAST_TILE", "0")  # one candidate tile per autotuned kernel: no timing runs

import torch  # noqa: E402

from launch.recording_driver import STREAM, launches, library, library_launches, recording_driver  # noqa: E402


def _calls():
    """(name, op kernel call) for the ops the models call most, as the CUDA key runs them."""
    from transformer_fast import _device_kernels

    kernel = lambda name: _device_kernels.op_kernel(name, "triton", "cuda")  # noqa: E731
    attn_fwd, attn_bwd = kernel("attention_forward"), kernel("attention_backward")
    ln_fwd, ln_bwd = kernel("layer_norm_forward"), kernel("layer_norm_backward")
    lin_fwd = kernel("linear_attention_forward")
    q = torch.randn(1, 2, 64, 64)
    qt = torch.randn(1, 64, 2, 64).transpose(1, 2)  # (B, N, H, D) as models lay it out
    pad = torch.zeros(1, 64, dtype=torch.bool)
    out, lse = attn_fwd(q, q, q, None, None, True, 0.125, 0.0, None)
    x, r, w, b = torch.randn(64, 256), torch.randn(64, 256), torch.randn(256), torch.randn(256)
    y, h, mean, rstd = ln_fwd(x, r, w, b, 1e-5, False)
    return {
        "attention forward": lambda: attn_fwd(q, q, q, None, None, True, 0.125, 0.0, None),
        "attention forward, (B, N, H, D), key padding": lambda: attn_fwd(qt, qt, qt, None, pad, False, 0.125, 0.0, None),
        "attention backward": lambda: attn_bwd(q, q, q, q, out, lse, None, None, True, 0.125, 0.0, None, False),
        "layer_norm forward, residual": lambda: ln_fwd(x, r, w, b, 1e-5, False),
        "layer_norm backward": lambda: ln_bwd(x, None, h, w, b, mean, rstd, 1e-5, False),
        "rms_norm forward": lambda: ln_fwd(x, None, w, None, 1e-5, True),
        "linear attention forward, causal": lambda: lin_fwd(q, q, q, None, True, 1e-6, None, None, False),
    }


def _set_direct(on, native=False):
    from transformer_fast.kernels import _launch

    for launch in _launch.CompiledLaunch.instances:
        launch.direct, launch.native = on, native


def _drop_compiled():
    from transformer_fast.kernels import _launch

    for plans in _launch.Plans.instances:
        plans.clear()
    for launch in _launch.CompiledLaunch.instances:
        launch.forget()
        getattr(launch.kernel, "device_caches", {}).clear()


def _plan_cases():
    """{name: make}: make(instance) -> (call, its input tensors, its dropout seed or None). The two
    instances of a case share their call signature (kernels/_launch.py) but not their tensors or
    seed: a launch plan made by one must launch the other with the other's. The seeds differ from
    every other argument, so that a launch's arguments show whether it got the call's."""
    from transformer_fast import _device_kernels

    kernel = lambda name: _device_kernels.op_kernel(name, "triton", "cuda")  # noqa: E731
    attn_fwd, attn_bwd = kernel("attention_forward"), kernel("attention_backward")
    ln_fwd, ln_bwd = kernel("layer_norm_forward"), kernel("layer_norm_backward")
    randn = torch.randn

    def dropout(seeds):
        def make(i):
            q, k, v = randn(1, 2, 40, 24), randn(1, 2, 40, 24), randn(1, 2, 40, 24)
            seed = torch.tensor(seeds[i])  # as the op takes it
            return lambda: attn_fwd(q, k, v, None, None, True, 0.2, 0.1, seed), (q, k, v), seeds[i]
        return make

    def masked_decode(i):  # GQA packing, a bool mask and key padding, split keys
        q, k, v = randn(2, 4, 1, 32), randn(2, 2, 100, 32), randn(2, 2, 100, 32)
        mask, pad = torch.rand(2, 4, 1, 100) > 0.2, torch.rand(2, 100) > 0.8
        return lambda: attn_fwd(q, k, v, mask, pad, False, 0.2, 0.0, None, num_splits=3), (q, k, v, mask, pad), None

    def features(i):  # window, softcap, ALiBi, sinks; q with an odd address
        q = randn(1, 3 * 17 * 24 + 1)[0, 1:].view(1, 3, 17, 24)
        k, v = randn(1, 3, 30, 24), randn(1, 3, 30, 20)
        alibi, sinks = torch.rand(1, 3), randn(3)
        return (lambda: attn_fwd(q, k, v, None, None, False, 0.2, 0.0, None, (7, 2), 30.0, alibi, sinks),
                (q, k, v, alibi, sinks), None)

    def packed(i):
        q, k, v = randn(30, 4, 16), randn(41, 2, 16), randn(41, 2, 16)
        cu_q, cu_k = torch.tensor([0, 12, 30], dtype=torch.int32), torch.tensor([0, 20, 41], dtype=torch.int32)
        return (lambda: attn_fwd(q, k, v, None, None, False, 0.25, 0.0, None, cu_seq_q=cu_q, cu_seq_k=cu_k,
                                 max_q=18, max_k=21), (q, k, v, cu_q, cu_k), None)

    def backward(seeds):
        def make(i):
            q, k, v, do = (randn(2, 17, 2, 24).transpose(1, 2) for _ in range(4))
            mask = randn(2, 2, 17, 33)
            kk, vv = randn(2, 2, 33, 24), randn(2, 2, 33, 24)
            seed = torch.tensor(seeds[i])
            out, lse = attn_fwd(q, kk, vv, mask, None, False, 0.2, 0.1, seed)
            return (lambda: attn_bwd(do, q, kk, vv, out, lse, mask, None, False, 0.2, 0.1, seed, True),
                    (do, q, kk, vv, out, lse, mask), seeds[i])
        return make

    def packed_backward(i):
        q, k, v, do = randn(30, 4, 16), randn(41, 2, 16), randn(41, 2, 16), randn(30, 4, 16)
        cu_q, cu_k = torch.tensor([0, 12, 30], dtype=torch.int32), torch.tensor([0, 20, 41], dtype=torch.int32)
        out, lse = attn_fwd(q, k, v, None, None, False, 0.25, 0.0, None, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=18, max_k=21)
        return (lambda: attn_bwd(do, q, k, v, out, lse, None, None, False, 0.25, 0.0, None, False, cu_seq_q=cu_q,
                                 cu_seq_k=cu_k, max_q=18, max_k=21, compute_delta=True), (do, q, k, v, out, lse),
                None)

    def norm_strided_weight(i):  # a weight read through a contiguous copy each call
        x, r = randn(33, 96), randn(33, 96)
        w, b = randn(192)[::2], randn(96).bfloat16()
        return lambda: ln_fwd(x, r, w, b, 1e-5, False), (x, r, w, b), None

    def rms_backward(i):
        dy, dh, h = randn(33, 5000), randn(33, 5000), randn(33, 5000)
        rstd = torch.rand(33) + 0.5
        return lambda: ln_bwd(dy, dh, h, None, None, rstd, rstd, 1e-5, True), (dy, dh, h, rstd), None

    def norm_backward(i):
        dy, h, w, b = randn(70, 300), randn(70, 300), randn(300), randn(300)
        mean, rstd = randn(70), torch.rand(70) + 0.5
        return lambda: ln_bwd(dy, None, h, w, b, mean, rstd, 1e-5, False), (dy, h, w, b, mean, rstd), None

    lin_fwd, lin_bwd = kernel("linear_attention_forward"), kernel("linear_attention_backward")

    def linear_causal_state(i):  # a carried state in and out
        q, k, v = randn(1, 2, 40, 16), randn(1, 2, 40, 16), randn(1, 2, 40, 24)
        S, z = randn(1, 2, 16, 24), torch.rand(1, 2, 16)
        return lambda: lin_fwd(q, k, v, None, True, 1e-6, S, z, True), (q, k, v, S, z), None

    def linear_causal_backward(i):  # the final state's gradient for S only: zeros stand in for z's
        q, k, v, do = randn(1, 2, 40, 16), randn(1, 2, 40, 16), randn(1, 2, 40, 24), randn(1, 2, 40, 24)
        S, z, dS = randn(1, 2, 16, 24), torch.rand(1, 2, 16), randn(1, 2, 16, 24)
        return (lambda: lin_bwd(do, q, k, v, None, True, 1e-6, S, z, dS, None), (do, q, k, v, S, z, dS), None)

    def linear_padded(i):  # not causal, (B, N, H, D) strides, key padding: forward and backward
        q, k, v, do = (randn(2, 33, 2, 16).transpose(1, 2) for _ in range(4))
        pad = torch.rand(2, 33) > 0.7

        def call():
            lin_fwd(q, k, v, pad, False, 1e-6, None, None, False)
            lin_bwd(do, q, k, v, pad, False, 1e-6, None, None, None, None)
        return call, (q, k, v, do, pad), None

    return {
        "attention forward, dropout seeds 123457, 654321": dropout((123457, 654321)),
        "attention forward, dropout seeds 16 x 77777, x 88888": dropout((16 * 77777, 16 * 88888)),
        "attention forward, dropout seed 1": dropout((1, 1)),
        "attention forward, dropout seeds 2^40 + 3, + 19": dropout((2 ** 40 + 3, 2 ** 40 + 19)),
        "attention forward, GQA decode, masks, 3 splits": masked_decode,
        "attention forward, window, softcap, ALiBi, sinks": features,
        "attention forward, packed": packed,
        "attention backward, (B, N, H, D), float mask, dropout, dS": backward((765431, 876543)),
        "attention backward, packed, delta": packed_backward,
        "layer_norm forward, strided fp32 weight, bf16 bias": norm_strided_weight,
        "layer_norm backward, 70 rows of 300": norm_backward,
        "rms_norm backward, dh, no weight, looped rows": rms_backward,
        "linear attention forward, causal, state in and out": linear_causal_state,
        "linear attention backward, causal, dS_F only": linear_causal_backward,
        "linear attention, key padding, forward + backward": linear_padded,
    }


def _forget_plans():
    from transformer_fast.kernels import _launch

    for plans in _launch.Plans.instances:
        plans.clear()


def _comparable(arg, inputs):
    """A launch argument as compared: an input tensor by which input it is, a new one by its
    dtype, shape, strides and address mod 16."""
    if isinstance(arg, torch.Tensor):
        if arg.data_ptr() in inputs:
            return "input", inputs[arg.data_ptr()]
        return "new", arg.dtype, tuple(arg.shape), arg.stride(), arg.data_ptr() % 16
    return arg


def _same(theirs, ours, inputs):
    return len(theirs) == len(ours) and all(
        a[0] is b[0] and a[1:4] == b[1:4] and
        [_comparable(x, inputs) for x in a[4]] == [_comparable(x, inputs) for x in b[4]] for a, b in zip(theirs, ours))


def _inputs(tensors):
    return {t.data_ptr(): i for i, t in enumerate(tensors)}


def check(calls):
    """0 when every call reaches the launcher the same way directly as through Triton's run, and
    every planned launch is the launch a plan made for that very call would be."""
    failures = 0
    for name, call in calls.items():
        recorded = {}
        for direct in (False, True, True):  # Triton's run; then an entry is made; then direct
            _set_direct(direct)
            launches.clear()
            call()
            recorded[direct] = list(launches)
        theirs, ours = recorded[False], recorded[True]
        same = _same(theirs, ours, {})
        direct = sum(not launch[5] for launch in ours)
        print(f"{name:<50} {len(ours)} launches, {direct} direct: {'same' if same else 'DIFFERENT'}")
        failures += not same or direct != len(ours)
    for name, make in _plan_cases().items():
        (call, tensors, seed), (twin, _, _) = make(0), make(1)
        _forget_plans()
        _set_direct(False)
        launches.clear()
        call()  # a plan made for this call, launched through Triton's run
        theirs = list(launches)
        _forget_plans()
        _set_direct(True)
        twin()  # the plan and its direct launch made by the twin
        twin()
        launches.clear()
        call()
        ours = list(launches)
        same = _same(theirs, ours, _inputs(tensors))
        if seed is not None and seed != 1:  # each launch that takes the seed takes the call's
            same = same and all(any(type(a) is int and a == seed for a in launch[4])
                                for launch in ours if len(launch[4]) > 20)
        direct = sum(not launch[5] for launch in ours)
        print(f"{name:<50} {len(ours)} launches, {direct} direct, planned by its twin: "
              f"{'same' if same else 'DIFFERENT'}")
        failures += not same or direct != len(ours)
    cases = dict(calls)
    cases.update({name: make(0)[0] for name, make in _plan_cases().items()})
    return failures + check_packed(cases)


# The sizes of the C types Triton's launcher packs a parameter as (its ty_to_cpp); a float type's
# value is packed in its own width (Triton's pack_fp32 and extractors).
_C_SIZES = {"CUdeviceptr": 8, "int8_t": 1, "int16_t": 2, "int32_t": 4, "int64_t": 8, "uint8_t": 1, "uint16_t": 2,
            "uint32_t": 4, "uint64_t": 8}


def _triton_param_bytes(ty, arg):
    """A parameter as the kernel reads it, from Triton's signature type `ty` and the launch's `arg`."""
    from triton.backends.nvidia.driver import ty_to_cpp

    if ty in ("fp32", "f32"):
        return struct.pack("<f", float(arg))
    c_type = ty_to_cpp(ty)
    if c_type == "CUdeviceptr":
        return struct.pack("<Q", 0 if arg is None else arg.data_ptr())
    size = _C_SIZES[c_type]
    return int(arg).to_bytes(8, "little", signed=c_type.startswith("int"))[:size]


def _same_as_triton(recorded, theirs):
    """Whether a launch recorded by the CUDA library (`recorded`) passes what Triton's launcher
    was handed for the same launch (`theirs`, from the recording launcher)."""
    launcher, grid, stream, function, args = theirs[:5]
    function_, grid_, block, shared, stream_, params, attrs = recorded
    meta = launcher.metadata
    types = list(launcher.src.signature.values())
    expected = [_triton_param_bytes(ty, arg) for ty, arg in zip(types, args) if ty != "constexpr"]
    expected += [bytes(8), bytes(8)]  # the scratch pointers: none
    wanted = (function, tuple(grid), (32 * meta.num_warps, 1, 1), meta.shared, stream, 0)
    if (function_, grid_, block, shared, stream_, attrs) != wanted or len(types) != len(args):
        return False
    return params is not None and len(params) == 8 * len(expected) and all(
        params[8 * i:8 * i + len(e)] == e for i, e in enumerate(expected))


def _same_as_triton_launcher(ours, theirs, types):
    """Whether two recorded launches, ours (packed) and Triton's launcher's, pass the same: the
    same kernel, grid, block, shared memory, stream, no launch attributes, and each parameter's
    bytes up to its size in Triton's table (its launcher's slots are as narrow as that)."""
    from triton.backends.nvidia.driver import ty_to_cpp

    sizes = [4 if ty in ("fp32", "f32") else _C_SIZES[ty_to_cpp(ty)] for ty in types if ty != "constexpr"] + [8, 8]
    if ours[:5] != theirs[:5] or ours[6] != 0 or theirs[6] != 0 or ours[5] is None or theirs[5] is None:
        return False
    return len(ours[5]) == len(theirs[5]) == 8 * len(sizes) and all(
        ours[5][8 * i:8 * i + n] == theirs[5][8 * i:8 * i + n] for i, n in enumerate(sizes))


def check_packed(cases, triton_launcher=False):
    """0 when every planned launch of every case, packed, passes the CUDA driver what Triton's
    launcher gets for it: each packed launch is made, then the same launch (the same tensors)
    through the compiled kernel's launcher, and the two compared (with `triton_launcher`, what
    Triton's own launcher passed the recording library; else what the recording launcher was given,
    as Triton's signature types it)."""
    from transformer_fast.kernels import _launch

    lib = library()
    pairs = []
    planned = _launch.CompiledLaunch.launch_planned

    def both(self, plan, tensors, seed):
        direct, packed = plan.direct, plan.packed_launch
        if packed is None or not self.native:
            return planned(self, plan, tensors, seed)
        compiled, grid, tail = direct[:3]
        n_params = sum(ty != "constexpr" for ty in compiled.src.signature.values()) + 2
        lib.recording_set_param_count(compiled.function, n_params)
        lib.recording_clear()
        if packed.num_params != n_params or not packed.launch(tensors, seed):
            pairs.append(False)
            return planned(self, plan, tensors, seed)
        recorded = library_launches()
        launches.clear()
        compiled.run(grid[0], grid[1], grid[2], STREAM, compiled.function, compiled.packed_metadata, None, None, None,
                     *plan.args(tensors, seed), *tail)
        types = list(compiled.src.signature.values())
        if triton_launcher:
            recorded = library_launches()
            same = len(recorded) == 2 and _same_as_triton_launcher(recorded[0], recorded[1], types)
        else:
            same = len(recorded) == 1 and _same_as_triton(recorded[0], launches[-1])
        pairs.append(same)
        return True

    failures = 0
    for name, call in cases.items():
        _forget_plans()
        _set_direct(True, native=True)
        for _ in range(3):  # the plans and tiles; their direct launches; their packed launches
            call()
        pairs.clear()
        _launch.CompiledLaunch.launch_planned = both
        try:
            call()
        finally:
            _launch.CompiledLaunch.launch_planned = planned
        same = bool(pairs) and all(pairs)
        print(f"{name:<50} {len(pairs)} launches packed: {'same' if same else 'DIFFERENT'}")
        failures += not same
    _set_direct(True)
    return failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--triton-launcher", action="store_true",
                        help="launch through Triton's own launcher (C, built against the recording library)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with recording_driver(args.triton_launcher):
        try:
            calls = _calls()
            if args.triton_launcher:  # no recording launcher: the packed launches only
                cases = dict(calls)
                cases.update({name: make(0)[0] for name, make in _plan_cases().items()})
                return 1 if check_packed(cases, triton_launcher=True) else 0
            return 1 if check(calls) else 0
        finally:  # drop the compiled kernels while the driver that loaded them is active
            _drop_compiled()


if __name__ == "__main__":
    sys.exit(main())
