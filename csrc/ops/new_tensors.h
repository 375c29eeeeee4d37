// Allocating what the kernels write (defined in new_tensors.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace transformer_fast {

// A new tensor for a kernel to fill (a result or scratch). A CPU tensor comes straight from the
// allocator (at::detail::empty_cpu, as torch's own CPU kernels allocate theirs): at::empty's trip
// through the dispatcher cost ~0.5 us a tensor, at::zeros' ~1 us, on a small LayerNorm's backward
// a third of the op. new_zeros zero-fills it (in one thread where small, else with zero_'s threads).
at::Tensor new_tensor(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor new_zeros(at::IntArrayRef sizes, const at::TensorOptions& options);

// Allocates a kernel output. With TRANSFORMER_FAST_POISON=1 in the environment it is filled with
// NaN (or all-ones bits for integer types), so tests catch a kernel that leaves any element unwritten.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);

// Whether TRANSFORMER_FAST_POISON=1 was set when the extension loaded: the CPU kernels' scratch
// buffers are then NaN-filled (cpu/attention_tiles.h's TileBuffer).
bool poison_scratch();

// An attention result of width `width` shaped as `like` ((B, H, N, W) or packed (T, H, W)) and laid
// out in its row order, as torch's attention lays out its results: where `like` keeps a row's heads
// together (stride(1) < stride(2): a (B, N, H * W) projection viewed as heads and transposed), the
// result is (B, N, H, width) memory seen as (B, H, N, width), so the caller's transpose back costs
// no copy; else contiguous. NaN-filled under TRANSFORMER_FAST_POISON=1, as new_output.
at::Tensor new_output_in_rows_of(const at::Tensor& like, int64_t width, const at::TensorOptions& options);

}  // namespace transformer_fast
