"""transformer_fast/_native_calls.recipe: what a recorded call becomes, and every call it must
leave to the Python kernel (anything a recipe cannot replay). The recipes' replay against the
Python kernels, compiled kernels and launches included, is checked by
tests/launch/check_native_calls.py (run by tests/test_direct_launch.py)."""
import types

import torch

from transformer_fast._native_calls import recipe
from transformer_fast.kernels._call_recording import CallRecording, record_call
from transformer_fast.kernels._new_tensors import contiguous, new_output, new_scratch

PACKED = types.SimpleNamespace(seed_param=3)  # a packed launch that takes the seed
UNSEEDED = types.SimpleNamespace(seed_param=-1)


def _recorded(launch_with):
    """A call of (x, w, 0.5, seed 7) that makes an output, a zeroed working tensor and a copy of
    w's strided view, and launches `launch_with(x, w, out, scratch, copy)` packed; results (out, an
    empty tensor)."""
    x, w = torch.randn(4, 8), torch.randn(16)[::2]
    with record_call() as rec:
        out = new_output((4, 8), torch.float32, x.device)
        scratch = new_scratch((3,), torch.float32, x.device, zero=True)
        copy = contiguous(w)
        rec.launches.append((PACKED, launch_with(x, w, out, scratch, copy), 7))
    return rec, (x, w, 0.5, 7), (out.view(2, 16), x.new_empty(0))


def test_a_recorded_call_becomes_its_recipe():
    rec, args, results = _recorded(lambda x, w, out, scratch, copy: (x, copy, out, scratch, x))
    news, launches, described = recipe(rec, args, results, seed=7)
    kinds = [(n[0], n[1], n[2].dtype, n[3:]) for n in news]
    assert kinds == [(CallRecording.OUTPUT, [4, 8], torch.float32, (-1, [], [])),
                     (CallRecording.ZEROS, [3], torch.float32, (-1, [], [])),
                     (CallRecording.COPY, [8], torch.float32, (1, [8], [2]))]
    assert launches == [(PACKED, [(False, 0), (True, 2), (True, 0), (True, 1), (False, 0)])]
    (view, view_sizes, view_strides, offset, _), (empty, empty_sizes, _, _, template) = described
    assert (view, view_sizes, view_strides, offset) == (0, [2, 16], [16, 1], 0)
    assert (empty, empty_sizes, template.dtype) == (-1, [0], torch.float32)


def test_what_a_recipe_cannot_replay_stays_with_the_python_kernel():
    stranger = torch.randn(8)  # made outside the helpers
    cases = {
        "a tensor from elsewhere": _recorded(lambda x, w, out, scratch, copy: (x, stranger)),
        "an address inside a new tensor": _recorded(lambda x, w, out, scratch, copy: (x, out[1:])),
    }
    for name, (rec, args, results) in cases.items():
        assert recipe(rec, args, results, seed=7) is None, name
    rec, args, results = _recorded(lambda x, w, out, scratch, copy: (x, out))
    assert recipe(rec, args, results, seed=8) is None, "a launch given another seed than the call's"
    unseeded = CallRecording()
    unseeded.news, unseeded.launches = rec.news, [(UNSEEDED, rec.launches[0][1], 0)]
    assert recipe(unseeded, args, results, seed=8) is not None, "a launch that takes no seed"
    rec.complete = False
    assert recipe(rec, args, results, seed=7) is None, "a launch that was not packed"
    rec, args, results = _recorded(lambda x, w, out, scratch, copy: (x, out))
    assert recipe(rec, args, (torch.randn(2, 16),), seed=7) is None, "a result made elsewhere"
    assert recipe(rec, args, (args[0],), seed=7) is None, "a result that is an argument"
    assert recipe(rec, args, (results[0].view(torch.int32),), seed=7) is None, "a view in another dtype"
    no_launch = CallRecording()
    no_launch.news = rec.news
    assert recipe(no_launch, args, results, seed=7) is None, "a call without launches"


def test_a_copy_must_be_of_an_argument_from_its_start():
    x, w = torch.randn(4, 8), torch.randn(17)
    for source in (torch.randn(16)[::2], w[1:][::2], w.view(torch.int32)[::2]):
        with record_call() as rec:
            copy = contiguous(source)
            rec.launches.append((UNSEEDED, (x, copy), 0))
        assert recipe(rec, (x, w), (), seed=0) is None


def test_recording_is_off_outside_a_recorded_call():
    with record_call() as rec:
        new_output((2,), torch.float32, torch.device("cpu"))
    new_output((2,), torch.float32, torch.device("cpu"))
    contiguous(torch.randn(4)[::2])
    assert len(rec.news) == 1
