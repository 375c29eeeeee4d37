"""What the drop-in modules share: turning a torch.nn module into ours in place, the attention
kinds they take, and refusing torch.jit.script clearly."""

ATTENTION_KINDS = ("softmax", "linear")


class NotScriptable:
    """torch.jit.script cannot compile the fused ops' Python entry points: say so, and what works."""

    def __prepare_scriptable__(self):
        raise RuntimeError(f"transformer_fast.{type(self).__name__} cannot be compiled by torch.jit.script "
                           f"(its kernels are called from Python); use torch.compile or torch.export, which "
                           f"trace through them, or torch.jit.trace")


def check_attention(attention):
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    return attention


def adopt(module, cls, **attributes):
    """Turns a torch.nn module into its transformer_fast subclass `cls` in place: the parameters,
    buffers, hooks, device, dtype and train/eval mode stay exactly as they are."""
    module.__class__ = cls
    for name, value in attributes.items():
        setattr(module, name, value)
    return module
