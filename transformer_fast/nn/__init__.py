"""The modules: drop-ins for ``torch.nn``'s norms (``normalization.py``), ``MultiheadAttention``
(``multihead_attention.py``) and Transformer layers and stacks (``transformer.py``), ``convert``,
which swaps them into any model (``conversion.py``), and an encoder-decoder built from them with
incremental decoding (``seq2seq.py``). ``transformer_fast`` exports all of them but
``PositionalEncoding``."""
from .conversion import convert
from .multihead_attention import MultiheadAttention
from .normalization import LayerNorm, RMSNorm
from .seq2seq import PositionalEncoding, Seq2SeqTransformer
from .transformer import (Transformer, TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
                          TransformerEncoderLayer)

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "MultiheadAttention",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
    "convert",
    "PositionalEncoding",
    "Seq2SeqTransformer",
]
