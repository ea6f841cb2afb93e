// The CPU output-buffer cache of host_cache.h.
#include "host_cache.h"

#include <ATen/ops/empty_like.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace lq {
namespace cpu {
namespace {

constexpr size_t kMinBytes = size_t(256) << 10;  // smaller buffers go to malloc directly
constexpr size_t kRound = 4096;                  // sizes are rounded to whole pages
constexpr size_t kHeader = 64;                   // keeps the data 64-byte aligned like c10's allocator

int64_t limit_from_env() {
  const char* v = std::getenv("LQ_CPU_CACHE_MB");
  if (v == nullptr || *v == '\0') return int64_t(1024) << 20;
  char* end = nullptr;
  const long long mb = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || mb < 0) {
    TORCH_WARN("LQ_CPU_CACHE_MB must be a whole number of MiB >= 0 (0 turns the cache off), got '", v,
               "'; using 1024");
    return int64_t(1024) << 20;
  }
  return int64_t(mb) << 20;
}

class Cache {
 public:
  // A block is [header | data]; the header holds the block's rounded data size.
  // nullptr when the cache is off (limit 0): the caller allocates as usual.
  void* get(size_t bytes) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (limit_ == 0) return nullptr;
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        void* base = it->second.back();
        it->second.pop_back();
        idle_ -= int64_t(bytes);
        live_ += int64_t(bytes);
        ++hits_;
        return base;
      }
      ++misses_;
      live_ += int64_t(bytes);
    }
    void* base = c10::alloc_cpu(bytes + kHeader);
    *static_cast<size_t*>(base) = bytes;
    return base;
  }

  void put(void* base) {
    const size_t bytes = *static_cast<size_t*>(base);
    {
      std::lock_guard<std::mutex> g(mu_);
      live_ -= int64_t(bytes);
      if (idle_ + int64_t(bytes) <= limit_) {
        free_[bytes].push_back(base);
        idle_ += int64_t(bytes);
        return;
      }
    }
    c10::free_cpu(base);
  }

  int64_t clear() {
    std::vector<void*> drop;
    int64_t freed = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& kv : free_) drop.insert(drop.end(), kv.second.begin(), kv.second.end());
      free_.clear();
      freed = idle_;
      idle_ = 0;
    }
    for (void* p : drop) c10::free_cpu(p);
    return freed;
  }

  void set_limit(int64_t bytes) {
    {
      std::lock_guard<std::mutex> g(mu_);
      limit_ = bytes < 0 ? 0 : bytes;
    }
    clear();
  }

  void stats(int64_t* out) {
    std::lock_guard<std::mutex> g(mu_);
    out[0] = idle_;
    out[1] = live_;
    out[2] = hits_;
    out[3] = misses_;
    out[4] = limit_;
  }

 private:
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  int64_t limit_ = limit_from_env();
  int64_t idle_ = 0, live_ = 0, hits_ = 0, misses_ = 0;
};

// Never destroyed: tensors may be freed during interpreter shutdown, after static destructors.
Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

void release(void* base) { cache().put(base); }

}  // namespace

at::Tensor cached_empty_like(const at::Tensor& t) {
  const size_t nbytes = size_t(t.numel()) * t.element_size();
  if (!t.device().is_cpu() || nbytes < kMinBytes || !t.is_non_overlapping_and_dense() || t.is_sparse()) {
    return at::empty_like(t);
  }
  const size_t bytes = (nbytes + kRound - 1) / kRound * kRound;
  void* base = cache().get(bytes);
  if (base == nullptr) return at::empty_like(t);
  void* data = static_cast<char*>(base) + kHeader;
  c10::DataPtr dp(data, base, &release, c10::Device(c10::kCPU));
  // Resizable with the default CPU allocator: a later resize_ reallocates normally and
  // hands this block back to the cache through its deleter.
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(dp), c10::GetCPUAllocator(),
                       /*resizable=*/true);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  // The strides of a dense non-overlapping t span exactly numel elements from offset 0.
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides());
  return out;
}

}  // namespace cpu
}  // namespace lq

extern "C" {
void lq_cpu_cache_stats(int64_t* out5) { lq::cpu::cache().stats(out5); }
int64_t lq_cpu_cache_clear() { return lq::cpu::cache().clear(); }
void lq_cpu_cache_set_limit(int64_t bytes) { lq::cpu::cache().set_limit(bytes); }
}
