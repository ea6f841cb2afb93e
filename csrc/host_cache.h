// A small cache of CPU output buffers, so that the tensors lq's kernels return
// every training step reuse memory instead of faulting in fresh pages.
//
// Why: glibc returns freed memory at the top of the heap to the kernel once more
// than its trim threshold is free there (and serves large blocks by mmap). A
// QAT step frees and re-allocates the same few activation-sized buffers every
// step, and with glibc's policy those allocations keep landing on fresh pages:
// the bench CNN's quantized step took ~4000 minor page faults per step where its
// FP32 step took ~30, about 10% of the step time. Outputs of lq's kernels are
// therefore allocated here: a freed buffer goes back to a free list keyed by its
// byte size (the shapes of a training step recur every step) and is handed out
// again to the next request of that size.
//
// Bounds: only buffers of at least kMinBytes are cached (small ones are cheap for
// malloc); at most limit() bytes are kept idle (LQ_CPU_CACHE_MB, default 1024;
// 0 turns the cache off), the excess is freed at once. lq.cpu_cache_clear()
// frees every idle buffer. The cached tensors are ordinary CPU tensors with
// their own storage; only their deleter differs.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace lq {
namespace cpu {

// Like at::empty_like(t) (same sizes, dtype, and the strides of t when t is dense
// and non-overlapping; otherwise contiguous), served from the cache when t is a
// CPU tensor of at least kMinBytes.
at::Tensor cached_empty_like(const at::Tensor& t);

}  // namespace cpu
}  // namespace lq

// Plain C entry points, called from Python with ctypes (lq/memory.py).
extern "C" {
// Bytes held idle in the cache, bytes handed out and still alive, hits, misses, and the limit.
void lq_cpu_cache_stats(int64_t* out5);
// Free every idle buffer; returns the bytes freed.
int64_t lq_cpu_cache_clear();
// Set the idle-bytes limit (0 disables caching and frees everything idle).
void lq_cpu_cache_set_limit(int64_t bytes);
}
