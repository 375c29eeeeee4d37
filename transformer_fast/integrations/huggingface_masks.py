"""The masks of the Hugging Face integration (``huggingface.py``): ``build_attention_mask``, transformers'
``AttentionMaskInterface`` function for ``attn_implementation="transformer_fast"``, and the tags it
sets on the masks it returns for ``attention_forward`` to read. How and why masks are built this
way: the docstring of ``huggingface.py``."""
from __future__ import annotations

import importlib

import torch

# Imported once here, not where a mask is built: torch 2.11's Dynamo cannot import from
# transformers' lazy top-level module while tracing, and broke the graph there.
try:
    from transformers import masking_utils as mu
except ImportError:  # transformers < 4.53 builds its masks itself; or no transformers (register() says so)
    mu = None
try:
    from transformers.utils.import_utils import is_tracing as _hf_is_tracing
except ImportError:  # pragma: no cover - older transformers
    _hf_is_tracing = None

# Attributes set on the masks build_attention_mask returns (read by attention_forward).
_WINDOW_TAG = "_transformer_fast_window"  # (left, right): the mask lies inside this bottom-right window
_PACKED_TAG = "_transformer_fast_packed"  # (cu_seqlens int32, max_len, window): block-diagonal packed sequences

def _supports(cls, implementation):
    return getattr(cls, f"_supports_{implementation}", False) is True  # a property (old composite models): unknown


_SDPA_FAMILIES = {}  # config class -> _family_supports_sdpa's answer


@torch.compiler.assume_constant_result  # torch.compile calls it while tracing: no graph break at the import
def _family_supports_sdpa(config_cls) -> bool:
    """Whether every model class of ``config_cls``'s family (the ``modeling_*`` module beside its
    ``configuration_*`` module) supports sdpa, so that its attention modules' ``is_causal`` is what
    sdpa reads when a mask is left out. Unknown (no such module): False."""
    if config_cls not in _SDPA_FAMILIES:
        _SDPA_FAMILIES[config_cls] = _every_model_class_supports_sdpa(config_cls)
    return _SDPA_FAMILIES[config_cls]


def _every_model_class_supports_sdpa(config_cls):
    config_module = config_cls.__module__
    modeling = config_module.replace(".configuration_", ".modeling_")
    if modeling == config_module:
        return False
    try:
        module = importlib.import_module(modeling)
    except Exception:  # noqa: BLE001 - no such module, or it does not import: unknown
        return False
    from transformers import PreTrainedModel
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == modeling]
    return bool(classes) and all(_supports(c, "sdpa") for c in classes)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _tracing(tensor=None):
    """Whether values cannot be read here (torch.compile, export, jit or fx tracing, fake tensors):
    then no mask is inspected or tagged."""
    if _hf_is_tracing is None:
        return torch.jit.is_tracing() or torch.compiler.is_compiling()
    return _hf_is_tracing(tensor)


def _probe_window(mask_function, window, device, causal):
    """Whether ``mask_function`` is, on a sample of index pairs around the window's edges, the causal
    sliding window of ``window`` keys (``q - window < kv <= q``) or, not ``causal``, the bidirectional
    window ``|q - kv| <= window``. Mask functions are elementwise over broadcast index tensors."""
    q_values = sorted({0, 1, window - 1, window, window + 1, 2 * window + 3, 10**6, 10**6 + window})
    offsets = sorted({-window - 2, -window - 1, -window, -window + 1, -1, 0, 1, 2, window - 1, window, window + 1})
    pairs = [(q, q + d) for q in q_values if q >= 0 for d in offsets if q + d >= 0]
    q_idx = torch.tensor([p[0] for p in pairs], device=device)
    kv_idx = torch.tensor([p[1] for p in pairs], device=device)
    zero = torch.zeros_like(q_idx)
    try:
        got = mask_function(zero, zero, q_idx, kv_idx)
    except Exception:  # noqa: BLE001 - a mask function that cannot take the probe is not recognised
        return False
    if not isinstance(got, torch.Tensor) or got.shape != q_idx.shape:
        return False
    if causal:
        expected = (kv_idx > q_idx - window) & (kv_idx <= q_idx)
    else:
        expected = (q_idx - kv_idx).abs() <= window
    return bool(torch.equal(got.to(torch.bool), expected))


def _recognised_window(mask_function, local_size, config, q_length, kv_length, q_offset, kv_offset,
                       allow_is_causal_skip, allow_is_bidirectional_skip, device):
    """The kernels' ``window_size`` that contains ``mask_function``'s pattern, aligned as the kernels
    align it (the last query at the last key), or None. Only where transformers added no overlay
    (it then disallows the mask's omission) and the offsets are plain ints."""
    if not (_is_int(q_offset) and _is_int(kv_offset)) or q_offset + q_length != kv_offset + kv_length:
        return None  # static caches (tensor offsets, or keys beyond the last query)
    if mask_function is mu.causal_mask_function:
        return (-1, 0) if allow_is_causal_skip else None
    window = local_size
    if not _is_int(window) or window < 1 or window != getattr(config, "sliding_window", None):
        return None
    if allow_is_causal_skip and _probe_window(mask_function, window, device, causal=True):
        return (window - 1, 0)
    if allow_is_bidirectional_skip and _probe_window(mask_function, window, device, causal=False):
        return (window, window)
    return None


def _causal_pattern(seq, window, rows):
    """Rows ``rows`` of the block-diagonal causal pattern of sequence ids ``seq`` (B, N), within a
    ``window=(left, 0)`` (left -1: unbounded): (B, len(rows), N) bool."""
    i = torch.arange(rows.start, rows.stop, device=seq.device)[:, None]
    j = torch.arange(seq.shape[1], device=seq.device)[None, :]
    allowed = j <= i
    if window[0] >= 0:
        allowed = allowed & (j >= i - window[0])
    return allowed[None] & (seq[:, rows, None] == seq[:, None, :])


def _matches_packed(mask, seq, window):
    """Whether the bool mask (B, 1, N, N) is exactly the block-diagonal causal pattern of ``seq``
    within ``window`` (compared in row blocks, to bound the memory)."""
    n = mask.shape[-1]
    step = max(1, (1 << 22) // max(1, n * mask.shape[0]))
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        if not torch.equal(mask[:, 0, rows, :], _causal_pattern(seq, window, rows)):
            return False
    return True


def _cu_seqlens(seq):
    """Cumulative lengths (int32) and the longest length of the runs of ``seq`` (B, N), rows one
    after another (each row starts a sequence)."""
    flat = seq + (torch.arange(seq.shape[0], device=seq.device)[:, None] * (seq.shape[1] + 1))
    _, counts = torch.unique_consecutive(flat.reshape(-1), return_counts=True)
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=seq.device)
    cu[1:] = counts.cumsum(0)
    return cu, int(counts.max())


def _packed_sequences(mask, window):
    """(cu_seqlens, max_len, window) if ``mask`` (B, 1, N, N) bool is exactly block-diagonal causal
    (within ``window``) over runs of consecutive tokens, at least one row holding several; else None.
    A run starts where a token may not attend the token before it."""
    b, _, n, _ = mask.shape
    if n < 2 or window[0] == 0:
        return None
    attends_previous = mask[:, 0, 1:, :-1].diagonal(dim1=-2, dim2=-1)  # (B, N - 1)
    if bool(attends_previous.all()):
        return None  # one sequence per row
    starts = torch.ones(b, n, dtype=torch.long, device=mask.device)
    starts[:, 1:] = (~attends_previous).long()
    seq = starts.cumsum(1)
    if not _matches_packed(mask, seq, window):
        return None
    cu, max_len = _cu_seqlens(seq)
    return cu, max_len, window


def build_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                         attention_mask=None, local_size=None, allow_is_causal_skip=True,
                         allow_is_bidirectional_skip=False, config=None, **kwargs):
    """transformers' ``AttentionMaskInterface`` function for this implementation: what ``sdpa_mask``
    returns (4-D bool, True = attend, or None), with the exceptions and tags the module docstring
    describes. Same arguments as ``sdpa_mask``."""
    if mask_function is None:
        mask_function = mu.causal_mask_function
    device = kwargs.get("device", "cpu")
    trusted = config is not None and _family_supports_sdpa(type(config))
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                local_size=local_size, **kwargs)

    if mask_function is mu.bidirectional_mask_function and local_size is None and not _tracing(attention_mask):
        if attention_mask is None:
            if not trusted:  # all True, never None (see the docstring)
                return torch.ones((), dtype=torch.bool, device=device).expand(batch_size, 1, q_length, kv_length)
        else:
            row = _padding_row(attention_mask, kv_length, kv_offset)
            if row is not None:
                if allow_is_bidirectional_skip and trusted and bool(row.all()):
                    return None  # as sdpa_mask: no padding, no mask
                return row[:, None, None, :].expand(batch_size, 1, q_length, kv_length)

    skip = allow_is_causal_skip and trusted
    mask = mu.sdpa_mask(allow_is_causal_skip=skip, allow_is_bidirectional_skip=allow_is_bidirectional_skip and trusted,
                        **args)
    if mask is None and skip and 1 < q_length < kv_length:  # a static cache's prefill: keep it (see the docstring)
        mask = mu.sdpa_mask(allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **args)
    if mask is None or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or _tracing(mask):
        return mask
    window = _recognised_window(mask_function, local_size, config, q_length, kv_length, q_offset, kv_offset,
                                allow_is_causal_skip, allow_is_bidirectional_skip, device)
    if window is not None:
        setattr(mask, _WINDOW_TAG, window)
        return mask
    if (attention_mask is None and mask_function is not mu.bidirectional_mask_function and _is_int(q_offset)
            and _is_int(kv_offset) and q_offset == kv_offset == 0 and q_length == kv_length and mask.dim() == 4
            and mask.shape[1] == 1):
        sliding = local_size if _is_int(local_size) and local_size == getattr(config, "sliding_window", None) else None
        packed = _packed_sequences(mask, (sliding - 1, 0) if sliding else (-1, 0))
        if packed is not None:
            setattr(mask, _PACKED_TAG, packed)
    return mask


def _padding_row(attention_mask, kv_length, kv_offset):
    """The (B, kv_length) bool row of the 2-D padding mask that sdpa_mask reads (True = attend), or
    None without one."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
        return None
    if (padding := kv_length + kv_offset - attention_mask.shape[-1]) > 0:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, padding))
    return attention_mask[:, kv_offset:kv_offset + kv_length]
