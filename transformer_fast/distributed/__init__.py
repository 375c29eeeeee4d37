"""transformer_fast beyond one device, over ``torch.distributed`` process groups (gloo, NCCL).

* Context parallelism: each rank holds a shard of the sequence (``shard_sequence``); softmax
  attention (ring, all-gather, Ulysses) and causal linear attention (state passing) run on the
  shards and give the one-device result.
* DTensor sharding rules for every op, so tensor-parallel models run the kernels on local shards.
* ``context_parallel(group)``: routes the public functions, the modules and the Hugging Face
  integration to their context-parallel forms.

See docs/distributed.md.
"""
from .context import context_parallel  # noqa: F401
from .linear_attention import context_parallel_linear_attention  # noqa: F401
from .attention import context_parallel_attention  # noqa: F401
from .plan import communication_counters, reset_communication_counters  # noqa: F401
from .varlen import context_parallel_varlen_attn  # noqa: F401
from .sequence import shard_packed, shard_positions, shard_sequence, unshard_sequence  # noqa: F401
