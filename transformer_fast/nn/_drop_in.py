"""What the drop-in modules share: turning a torch.nn module into ours in place, the attention
kinds they take, whether calling a module runs its forward alone, and refusing torch.jit.script
clearly."""
from torch.nn.modules import module as _torch_module

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


def calls_forward_alone(module, forward):
    """Whether calling ``module`` would run ``forward`` and nothing else (no override of it, no
    module hooks), so that calling a fused variant of it in its place cannot be observed."""
    m = _torch_module
    return (type(module).forward is forward
            and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                     or module._backward_pre_hooks or m._global_forward_hooks or m._global_forward_pre_hooks
                     or m._global_backward_hooks or m._global_backward_pre_hooks))
