"""transformer_fast: fused attention, LayerNorm and linear-attention kernels for PyTorch.

Every kernel exists in Triton (CUDA), in a C++ extension (CPU) and as a plain PyTorch reference;
``available_backends()`` says which work here and why not. The functions are drop-ins for their
``torch.nn.functional`` counterparts, the modules for their ``torch.nn`` ones.
"""
from ._dispatch import available_backends
from .attention import scaled_dot_product_attention
from .layer_norm import layer_norm, rms_norm
from .linear_attention import LinearAttentionState, linear_attention, linear_attention_step
from .modules import (LayerNorm, MultiheadAttention, RMSNorm, Transformer, TransformerDecoder,
                      TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer)
from .convert import convert

__version__ = "0.1.0"

__all__ = [
    "available_backends",
    "scaled_dot_product_attention",
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
    "convert",
]
