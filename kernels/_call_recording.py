"""What one op call's launchers make and launch, recorded for its native call
(transformer_fast/_native_calls.py)."""
import contextlib
import threading


class CallRecording:
    """What one op call's launchers made, for its native call (transformer_fast/_native_calls.py):
    `news` (kind, the new tensor, the tensor copied or None) in order, `launches` (packed launch,
    tensors, seed) in order, and `complete`, False once anything launched otherwise. The launchers
    of a native op make every tensor they launch with or return through the helpers of
    _new_tensors.py and change them only by launches: a recording cannot see anything else."""

    SCRATCH, ZEROS, OUTPUT, COPY = range(4)  # csrc/launch/native_calls.cpp's NewKind

    def __init__(self):
        self.news, self.launches, self.complete = [], [], True


_thread = threading.local()


def recording():
    """The calling thread's CallRecording, or None (almost always)."""
    return getattr(_thread, "recording", None)


@contextlib.contextmanager
def record_call():
    """Records, inside, what this thread's launchers make (a CallRecording)."""
    _thread.recording = rec = CallRecording()
    try:
        yield rec
    finally:
        _thread.recording = None
