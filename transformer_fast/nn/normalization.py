"""Drop-in ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` running the fused norm kernels, with the
residual add fused in: ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``, as
the Transformer layers (``transformer.py``) use them. Nested-tensor inputs run torch's
implementation."""
from __future__ import annotations

from torch import nn

from ..layer_norm import layer_norm, rms_norm
from ._drop_in import NotScriptable, adopt, calls_forward_alone

__all__ = ["LayerNorm", "RMSNorm"]


def _nested_norm(module, cls, input, residual):
    """torch's own norm on nested tensors (the kernels take strided ones), with the residual added."""
    h = input if residual is None else input + residual
    y = cls.forward(module, h)
    return y if residual is None else (y, h)


class LayerNorm(NotScriptable, nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` (same constructor, parameters and state dict) running the fused
    kernel; ``forward(x, residual=None)`` returns ``(y, x + residual)`` when given a residual."""

    def forward(self, input, residual=None):
        if getattr(input, "is_nested", False):
            return _nested_norm(self, nn.LayerNorm, input, residual)
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, residual=residual)


class RMSNorm(NotScriptable, nn.RMSNorm):
    """Drop-in ``torch.nn.RMSNorm`` (same constructor, parameters and state dict) running the fused
    kernel; ``forward(x, residual=None)`` returns ``(y, x + residual)`` when given a residual."""

    def forward(self, input, residual=None):
        if getattr(input, "is_nested", False):
            return _nested_norm(self, nn.RMSNorm, input, residual)
        return rms_norm(input, self.normalized_shape, self.weight, self.eps, residual=residual)


def adopt_norm(norm):
    """Our fused LayerNorm/RMSNorm in place of a torch.nn one (anything else is left alone)."""
    if type(norm) is nn.LayerNorm:
        return adopt(norm, LayerNorm)
    if type(norm) is nn.RMSNorm:
        return adopt(norm, RMSNorm)
    return norm


def norm_add(norm, x, residual):
    """(norm(x + residual), x + residual), the add fused into the kernel for our norms. A norm with
    hooks or an overridden forward is called as torch calls it: on the sum, returning a tensor."""
    if calls_forward_alone(norm, LayerNorm.forward) or calls_forward_alone(norm, RMSNorm.forward):
        return norm(x, residual=residual)
    h = x + residual
    return norm(h), h
