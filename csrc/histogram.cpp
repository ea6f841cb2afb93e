// One-pass histogram of |x| on CPU: lq::abs_histogram (per tensor, or per channel along `axis`).
//
// Bin of a = |x|: min(floor(a * inv), num_bins - 1), inv = num_bins / range_max computed
// once in float32 as reciprocal(range_max) * num_bins (0 where range_max <= 0); a value is
// counted when it is finite, a <= range_max and (range_max > 0 or a == 0). Also returns the
// largest finite |x| and the number of NaN/Inf skipped.
//
// Parallel: each task bins into its own private histogram (four interleaved 32-bit
// sub-histograms, so runs of equal bins do not serialize on one counter) and adds it
// into the result once at the end.
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <vector>

#include "common.h"
#include "cpu_elementwise.h"

namespace lq {
namespace cpu {
namespace {

struct BinParams {
  float rng;   // range_max
  float inv;   // num_bins / range_max, or 0
  bool rpos;   // range_max > 0
  float nbm1;  // num_bins - 1
  BinParams(float r, int64_t num_bins) : rng(r), rpos(r > 0.f), nbm1(static_cast<float>(num_bins - 1)) {
    const float rec = 1.0f / r;
    inv = rpos ? rec * static_cast<float>(num_bins) : 0.f;
  }
  // Bin of a kept value; NaN (0 * inf for a range so small that inv overflows) goes to bin 0.
  int32_t bin(float a) const {
    const float f = std::floor(a * inv);
    return f >= nbm1 ? static_cast<int32_t>(nbm1) : (f >= 0.f ? static_cast<int32_t>(f) : 0);
  }
  bool keep(float a) const { return a <= rng && (rpos || a == 0.f); }
};

// Counts, absmax and nonfinite count of one histogram being filled by one task.
template <int K>
struct LocalHist {
  int64_t num_bins;
  std::vector<uint32_t> sub;  // K interleaved sub-histograms (K * num_bins)
  int64_t pending = 0;        // elements binned since the last flush (keeps uint32 from overflowing)
  float absmax = 0.f;
  int64_t nonfinite = 0;
  explicit LocalHist(int64_t nb) : num_bins(nb), sub(static_cast<size_t>(K * nb), 0u) {}
  void reset() {
    std::fill(sub.begin(), sub.end(), 0u);
    absmax = 0.f;
    nonfinite = 0;
    pending = 0;
  }
  // Adds the sub-histograms into counts (int64, num_bins) and clears them.
  void flush(int64_t* counts) {
    for (int k = 0; k < K; ++k) {
      uint32_t* s = sub.data() + k * num_bins;
      for (int64_t i = 0; i < num_bins; ++i) counts[i] += s[i];
    }
    std::fill(sub.begin(), sub.end(), 0u);
    pending = 0;
  }
};

template <typename Cnt>
inline void bin_one(float xf, const BinParams& bp, Cnt* hist, float& absmax, int64_t& nonfinite) {
  const float a = std::fabs(xf);
  if (!(a < std::numeric_limits<float>::infinity())) {
    ++nonfinite;
    return;
  }
  absmax = a > absmax ? a : absmax;
  if (bp.keep(a)) ++hist[bp.bin(a)];
}

// Bins a contiguous span into K interleaved histograms hist[k * nb + bin] (lane l uses
// k = l % K); absmax and nonfinite are updated. With uint32 counters, n < 2^32.
template <typename T, int K, typename Cnt>
void bin_span(const T* x, int64_t n, const BinParams& bp, Cnt* hist, int64_t nb, float& absmax_io,
              int64_t& nonfinite_io) {
  const Vec inf(std::numeric_limits<float>::infinity()), zero(0.f), vrng(bp.rng), vinv(bp.inv), vnbm1(bp.nbm1);
  const int full = static_cast<int>((int64_t{1} << kW) - 1);
  Vec am(0.f);
  int64_t nonfinite = 0;
  alignas(64) int32_t idx[kW];
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vec xv[2];
    load2(x + i, xv[0], xv[1]);
    for (int j = 0; j < 2; ++j) {
      const Vec a = xv[j].abs();
      const Vec fin = a < inf;
      nonfinite += __builtin_popcount(static_cast<unsigned>(fin.zero_mask()));
      am = at::vec::maximum(am, a & fin);
      Vec keep = fin & (a <= vrng);
      if (!bp.rpos) keep = keep & (a == zero);
      const int kept = full & ~keep.zero_mask();
      if (!kept) continue;
      Vec f = (a * vinv).floor();
      f = Vec::blendv(zero, f, f >= zero);  // NaN -> 0
      f = at::vec::minimum(f, vnbm1);
      at::vec::convert_to_int_of_same_size(f).store(idx);
      if (kept == full) {
        for (int l = 0; l < kW; ++l) ++hist[(l % K) * nb + idx[l]];
      } else {
        for (int l = 0; l < kW; ++l)
          if (kept >> l & 1) ++hist[(l % K) * nb + idx[l]];
      }
    }
  }
  float absmax = absmax_io;
  for (; i < n; ++i) bin_one(static_cast<float>(x[i]), bp, hist, absmax, nonfinite);
  float buf[kW];
  am.store(buf);
  for (int l = 0; l < kW; ++l) absmax = buf[l] > absmax ? buf[l] : absmax;
  absmax_io = absmax;
  nonfinite_io += nonfinite;
}

constexpr int kSub = 4;
constexpr int64_t kFlushEvery = int64_t{1} << 30;  // elements per sub-histogram flush (uint32 counters)

// Bins span x[0:n] into h, flushing into counts as the counters fill.
template <typename T>
void bin_long_span(const T* x, int64_t n, const BinParams& bp, LocalHist<kSub>& h, int64_t* counts) {
  for (int64_t s = 0; s < n; s += kFlushEvery) {
    const int64_t len = std::min(kFlushEvery, n - s);
    if (h.pending + len > kFlushEvery) h.flush(counts);
    bin_span<T, kSub>(x + s, len, bp, h.sub.data(), h.num_bins, h.absmax, h.nonfinite);
    h.pending += len;
  }
}

// Per tensor: tasks over element ranges, each with a private histogram.
template <typename T>
void hist_tensor(const T* x, int64_t n, const BinParams& bp, int64_t nb, int64_t* counts, float& absmax,
                 int64_t& nonfinite) {
  std::mutex mu;
  at::parallel_for(0, n, 4 * at::internal::GRAIN_SIZE, [&](int64_t b, int64_t e) {
    LocalHist<kSub> h(nb);
    std::vector<int64_t> local(static_cast<size_t>(nb), 0);
    bin_long_span(x + b, e - b, bp, h, local.data());
    h.flush(local.data());
    std::lock_guard<std::mutex> lock(mu);
    for (int64_t i = 0; i < nb; ++i) counts[i] += local[i];
    absmax = h.absmax > absmax ? h.absmax : absmax;
    nonfinite += h.nonfinite;
  });
}

// Per channel, parallel over channels: channel c is outer runs of `inner` contiguous elements.
template <typename T>
void hist_channels(const T* x, int64_t outer, int64_t C, int64_t inner, const std::vector<BinParams>& bps,
                   int64_t nb, int64_t* counts, float* absmax, int64_t* nonfinite) {
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, outer * inner));
  const int64_t per_channel = outer * inner;
  if (per_channel < 2 * kSub * nb) {  // short channels: count straight into the result rows
    at::parallel_for(0, C, grain, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        float am = 0.f;
        int64_t nf = 0;
        for (int64_t o = 0; o < outer; ++o)
          bin_span<T, 1, int64_t>(x + (o * C + c) * inner, inner, bps[c], counts + c * nb, nb, am, nf);
        absmax[c] = am;
        nonfinite[c] = nf;
      }
    });
    return;
  }
  at::parallel_for(0, C, grain, [&](int64_t c0, int64_t c1) {
    LocalHist<kSub> h(nb);
    for (int64_t c = c0; c < c1; ++c) {
      h.reset();
      int64_t* row = counts + c * nb;
      for (int64_t o = 0; o < outer; ++o) bin_long_span(x + (o * C + c) * inner, inner, bps[c], h, row);
      h.flush(row);
      absmax[c] = h.absmax;
      nonfinite[c] = h.nonfinite;
    }
  });
}

// Per channel with few channels and short inner runs (e.g. the last axis): tasks over the
// outer index, each with private (C, num_bins) counts.
template <typename T>
void hist_channels_rows(const T* x, int64_t outer, int64_t C, int64_t inner, const std::vector<BinParams>& bps,
                        int64_t nb, int64_t* counts, float* absmax, int64_t* nonfinite) {
  std::mutex mu;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, C * inner));
  at::parallel_for(0, outer, grain, [&](int64_t o0, int64_t o1) {
    std::vector<uint32_t> local(static_cast<size_t>(C * nb), 0u);
    std::vector<float> am(static_cast<size_t>(C), 0.f);
    std::vector<int64_t> nf(static_cast<size_t>(C), 0);
    std::vector<int64_t> total(static_cast<size_t>(C * nb), 0);
    int64_t pending = 0;
    for (int64_t o = o0; o < o1; ++o) {
      if (pending + C * inner > kFlushEvery) {
        for (size_t i = 0; i < local.size(); ++i) total[i] += local[i];
        std::fill(local.begin(), local.end(), 0u);
        pending = 0;
      }
      const T* xo = x + o * C * inner;
      for (int64_t c = 0; c < C; ++c)
        for (int64_t i = 0; i < inner; ++i)
          bin_one(static_cast<float>(xo[c * inner + i]), bps[c], local.data() + c * nb, am[c], nf[c]);
      pending += C * inner;
    }
    for (size_t i = 0; i < local.size(); ++i) total[i] += local[i];
    std::lock_guard<std::mutex> lock(mu);
    for (int64_t i = 0; i < C * nb; ++i) counts[i] += total[i];
    for (int64_t c = 0; c < C; ++c) {
      absmax[c] = am[c] > absmax[c] ? am[c] : absmax[c];
      nonfinite[c] += nf[c];
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> abs_histogram_cpu(const at::Tensor& x, const at::Tensor& range_max,
                                                                  int64_t num_bins, std::optional<int64_t> axis) {
  check_input(x);
  TORCH_CHECK_VALUE(num_bins > 0 && num_bins <= (int64_t{1} << 24), "num_bins must be in [1, 2^24], got ", num_bins);
  TORCH_CHECK_TYPE(range_max.defined() && range_max.is_floating_point(),
                   "range_max must be a floating point tensor, got ",
                   range_max.defined() ? dtype_name(range_max.scalar_type()) : std::string("None"));
  check_same_device(x, range_max, "range_max");
  const at::Tensor xc = x.contiguous();
  const at::Tensor rng = range_max.to(at::kFloat).contiguous();
  const auto opts = x.options();
  if (!axis.has_value()) {
    TORCH_CHECK_VALUE(rng.numel() == 1, "range_max must hold one value for a per-tensor histogram, got shape ",
                      shape_str(range_max.sizes()));
    at::Tensor counts = at::zeros({num_bins}, opts.dtype(at::kLong));
    float absmax = 0.f;
    int64_t nonfinite = 0;
    const BinParams bp(rng.const_data_ptr<float>()[0], num_bins);
    dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
      using T = decltype(tag);
      hist_tensor<T>(xc.const_data_ptr<T>(), xc.numel(), bp, num_bins, counts.mutable_data_ptr<int64_t>(), absmax,
                     nonfinite);
    });
    return {counts, at::scalar_tensor(absmax, opts.dtype(at::kFloat)),
            at::scalar_tensor(nonfinite, opts.dtype(at::kLong))};
  }
  const int64_t ax = normalize_axis(*axis, x.dim(), "axis");
  const int64_t C = x.dim() ? x.size(ax) : 1;
  TORCH_CHECK_VALUE(rng.numel() == C, "range_max must hold one value per channel: ", C, " values for axis ", ax,
                    " of inputs ", shape_str(x.sizes()), ", got shape ", shape_str(range_max.sizes()));
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < ax; ++d) outer *= x.size(d);
  for (int64_t d = ax + 1; d < x.dim(); ++d) inner *= x.size(d);
  at::Tensor counts = at::zeros({C, num_bins}, opts.dtype(at::kLong));
  at::Tensor absmax = at::zeros({C}, opts.dtype(at::kFloat));
  at::Tensor nonfinite = at::zeros({C}, opts.dtype(at::kLong));
  if (xc.numel() == 0) return {counts, absmax, nonfinite};
  std::vector<BinParams> bps;
  bps.reserve(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) bps.emplace_back(rng.const_data_ptr<float>()[c], num_bins);
  const bool rows = inner < kStep && outer > 1 && C * num_bins <= (int64_t{1} << 22);
  dispatch_float(x.scalar_type(), "inputs", [&](auto tag) {
    using T = decltype(tag);
    auto fn = rows ? hist_channels_rows<T> : hist_channels<T>;
    fn(xc.const_data_ptr<T>(), outer, C, inner, bps, num_bins, counts.mutable_data_ptr<int64_t>(),
       absmax.mutable_data_ptr<float>(), nonfinite.mutable_data_ptr<int64_t>());
  });
  return {counts, absmax, nonfinite};
}

}  // namespace
}  // namespace cpu
}  // namespace lq

TORCH_LIBRARY_IMPL(lq, CPU, m) { m.impl("abs_histogram", &lq::cpu::abs_histogram_cpu); }
