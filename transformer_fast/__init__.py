"""transformer_fast: fused attention, LayerNorm and linear-attention kernels for PyTorch.

Every kernel exists in Triton (CUDA), in a C++ extension (CPU) and as a plain PyTorch reference;
``available_backends()`` says which work here and why not. The functions are drop-ins for their
``torch.nn.functional`` counterparts, the modules for their ``torch.nn`` ones.
"""
from . import _build

_C, _reason = _build.load()
if _C is None:
    raise ImportError(f"transformer_fast needs its C++ extension, which registers the ops: {_reason}")

from . import _device_kernels, _plain_torch  # noqa: E402
from ._backends import available_backends  # noqa: E402
from .attention import AuxRequest, scaled_dot_product_attention, varlen_attn  # noqa: E402
from .layer_norm import layer_norm, rms_norm  # noqa: E402
from .linear_attention import LinearAttentionState, linear_attention, linear_attention_step  # noqa: E402
from .nn import (  # noqa: E402
    LayerNorm, MultiheadAttention, RMSNorm, Seq2SeqTransformer, Transformer, TransformerDecoder,
    TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer, convert)

_plain_torch.register()
_device_kernels.register()
from .distributed import sharding as _sharding  # noqa: E402,F401  DTensor rules, registered once DTensor loads

__version__ = "0.1.0"

__all__ = [
    "available_backends",
    "scaled_dot_product_attention",
    "varlen_attn",
    "AuxRequest",
    "layer_norm",
    "rms_norm",
    "LayerNorm",
    "RMSNorm",
    "linear_attention",
    "linear_attention_step",
    "LinearAttentionState",
    "MultiheadAttention",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
    "Seq2SeqTransformer",
    "convert",
]
