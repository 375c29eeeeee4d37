// The schemas of every transformer_fast op, in one place. Each op's kernels are registered beside
// their code: CPU in csrc/cpu/<family>.cpp, CUDA in csrc/cuda/attention_cuda.cu (C++) or from Python
// (Triton; as native calls, csrc/launch/native_calls.cpp), autograd, autocast and BackendSelect (a
// backend chosen by name, ops/named_backend.h) in csrc/ops/<family>_op.cpp, fake (meta)
// implementations in transformer_fast/<family>.py.
#include <torch/library.h>

TORCH_LIBRARY(transformer_fast, m) {
  // Public ops (CompositeImplicitAutograd): argument checks once, then the kernel ops. The
  // Python functions of the same names call these, with Python's conveniences (scale given as any
  // real scalar). With dropout and no seed they draw one from torch's generator (op_utils.h,
  // dropout_seed, says why a seed is a tensor).
  m.def("scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
        "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
        "Tensor? key_padding_mask=None, Tensor? seed=None, int[]? window_size=None, float? softcap=None, "
        "Tensor? alibi_slopes=None, Tensor? sinks=None) -> Tensor");
  // Packed variable-length sequences: (out, lse); lse is empty unless return_lse.
  m.def("varlen_attn(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor? cu_seq_k, int max_q, "
        "int max_k, bool return_lse=False, float? scale=None, int[] window_size=[-1, -1], "
        "bool enable_gqa=False, Tensor? seqused_k=None, Tensor? block_table=None, int? num_splits=None, "
        "float? softcap=None, Tensor? alibi_slopes=None, Tensor? sinks=None, float dropout_p=0.0, Tensor? seed=None) "
        "-> (Tensor, Tensor)");
  // (y, h): h = input + residual, or an empty tensor without a residual.
  m.def("layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
        "float? eps=None, Tensor? residual=None, bool is_rms=False) -> (Tensor, Tensor)");
  // (out, final S, final z): the state after the last key when output_final_state, else empty tensors.
  m.def("linear_attention(Tensor query, Tensor key, Tensor value, bool is_causal=False, "
        "Tensor? key_padding_mask=None, float eps=1e-06, Tensor? initial_state_S=None, "
        "Tensor? initial_state_z=None, bool output_final_state=False) -> (Tensor, Tensor, Tensor)");

  // Kernel ops: the contract of each is in transformer_fast/<family>.py. Results a call does not
  // produce are empty tensors (an op cannot return None).
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? key_padding_mask, "
        "bool is_causal, float scale, float dropout_p, Tensor? seed, int[] window=[-1, -1], float softcap=0.0, "
        "Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? cu_seq_q=None, Tensor? cu_seq_k=None, "
        "Tensor? seqused_k=None, Tensor? block_table=None, int max_q=0, int max_k=0, int num_splits=0, "
        "int query_offset=0) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? attn_mask, Tensor? key_padding_mask, bool is_causal, float scale, float dropout_p, Tensor? seed, "
        "bool compute_dmask, int[] window=[-1, -1], float softcap=0.0, Tensor? alibi_slopes=None, "
        "Tensor? cu_seq_q=None, Tensor? cu_seq_k=None, int max_q=0, int max_k=0, bool compute_delta=False, "
        "Tensor? sinks=None, int query_offset=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("layer_norm_forward(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool is_rms) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("layer_norm_backward(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor? bias, Tensor mean, "
        "Tensor rstd, float eps, bool is_rms) -> (Tensor, Tensor, Tensor)");
  m.def("linear_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool is_causal, "
        "float eps, Tensor? initial_S, Tensor? initial_z, bool output_final_state) -> (Tensor, Tensor, Tensor)");
  m.def("linear_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, "
        "bool is_causal, float eps, Tensor? initial_S, Tensor? initial_z, Tensor? grad_final_S, "
        "Tensor? grad_final_z) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // The first-order gradients as a graph torch can differentiate again (second derivatives,
  // create_graph=True): the op written in differentiable torch (transformer_fast/_plain_torch.py),
  // registered from Python as CompositeImplicitAutograd.
  m.def("attention_backward_composite(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
        "Tensor? key_padding_mask, bool is_causal, float scale, int[] window=[-1, -1], float softcap=0.0, "
        "Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? cu_seq_q=None, Tensor? cu_seq_k=None, "
        "int query_offset=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("layer_norm_backward_composite(Tensor dy, Tensor h, Tensor? weight, Tensor? bias, float eps, "
        "bool is_rms) -> (Tensor, Tensor, Tensor)");
  m.def("linear_attention_backward_composite(Tensor dout, Tensor q, Tensor k, Tensor v, "
        "Tensor? key_padding_mask, bool is_causal, float eps, Tensor? initial_S, Tensor? initial_z, "
        "Tensor? grad_final_S, Tensor? grad_final_z) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}
