// Compile check of the torch-free kernel templates (tests/test_cuda_compile.py).
//
// Built only with -DLQ_COMPILE_CHECK: lq/_ext.py compiles every csrc/cuda/*.cu
// into the extension, where this file is an empty translation unit. The check
// explicitly instantiates every kernel for float, __half and __nv_bfloat16 (all
// template variants the launcher can pick) and the launching entry points with
// the device executor, so `nvcc -c` proves the whole kernel layer compiles for
// the requested architectures without torch or a GPU.
#ifdef LQ_COMPILE_CHECK

#include "lq_api.cuh"

namespace lq {
namespace cuda {

#define LQ_INST_BODY(...) template __global__ void lq_elementwise_kernel<__VA_ARGS__>(const __VA_ARGS__, int64_t);

#define LQ_INST_OP(...)                  \
  LQ_INST_BODY(DenseBody<__VA_ARGS__, 0>)        \
  LQ_INST_BODY(DenseBody<__VA_ARGS__, 1>)        \
  LQ_INST_BODY(DenseBody<__VA_ARGS__, kMaxDims>) \
  LQ_INST_BODY(StridedBody<__VA_ARGS__>)

#define LQ_INST_TYPE(T)                                                                        \
  LQ_INST_OP(FakeQuantOp<T>)                                                                   \
  LQ_INST_OP(QuantOp<T>)                                                                       \
  LQ_INST_OP(FakeQuantBackwardOp<T, T>)                                                        \
  LQ_INST_OP(FakeAffineOp<T>)                                                                  \
  LQ_INST_OP(FakeAffineBackwardOp<T, T>)                                                       \
  LQ_INST_OP(ScaledE4M3Op<T>)                                                                  \
  template __global__ void lq_block_quant_contig_kernel<T, VecWidth<T>::value>(                \
      const BlockContigBody<T, VecWidth<T>::value>);                                           \
  template __global__ void lq_block_quant_contig_kernel<T, 1>(const BlockContigBody<T, 1>);    \
  template __global__ void lq_block_quant_strided_kernel<T, VecWidth<T>::value>(               \
      const BlockStridedBody<T, VecWidth<T>::value>);                                          \
  template __global__ void lq_block_quant_strided_kernel<T, 1>(const BlockStridedBody<T, 1>);  \
  template __global__ void lq_abs_histogram_kernel<T, VecWidth<T>::value, true>(const HistArgs<T>);  \
  template __global__ void lq_abs_histogram_kernel<T, VecWidth<T>::value, false>(const HistArgs<T>); \
  template __global__ void lq_abs_histogram_kernel<T, 1, true>(const HistArgs<T>);             \
  template __global__ void lq_abs_histogram_kernel<T, 1, false>(const HistArgs<T>);

LQ_INST_TYPE(float)
LQ_INST_TYPE(__half)
LQ_INST_TYPE(__nv_bfloat16)
// gradients of reduced-precision x given in float32 (grad's dtype differs from x's)
LQ_INST_OP(FakeQuantBackwardOp<__half, float>)
LQ_INST_OP(FakeQuantBackwardOp<__nv_bfloat16, float>)
LQ_INST_OP(FakeAffineBackwardOp<__half, float>)
LQ_INST_OP(FakeAffineBackwardOp<__nv_bfloat16, float>)
LQ_INST_OP(QuantScaleOp)

// Both E4M3 roundings on every architecture (e4m3_round picks one per arch).
__global__ void lq_check_e4m3_paths(const float* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = e4m3_round_arith(in[i]) + e4m3_round_cvt(in[i]) + e4m3_round(in[i]);
}

// The host-side entry points with the device executor.
template Status fake_quant<DeviceExec>(DeviceExec&, const TensorView&, const TensorView&, const TensorView&, int, bool,
                                       bool);
template Status quant<DeviceExec>(DeviceExec&, const TensorView&, const TensorView&, const TensorView&,
                                  const TensorView&, const TensorView&, int, bool, bool);
template Status fake_quant_backward<DeviceExec>(DeviceExec&, const TensorView&, const TensorView&, const TensorView&,
                                                const TensorView&);
template Status fake_affine_quant<DeviceExec>(DeviceExec&, const TensorView&, const TensorView&, const TensorView&,
                                              const TensorView&, int);
template Status fake_affine_quant_backward<DeviceExec>(DeviceExec&, const TensorView&, const TensorView&,
                                                       const TensorView&, const TensorView&, const TensorView&);
template Status scaled_e4m3<DeviceExec>(DeviceExec&, const TensorView&, const TensorView&, const TensorView&);
template Status fake_dynamic_block_quant<DeviceExec>(DeviceExec&, void*, const void*, DType, int64_t, int64_t, int64_t,
                                                     int64_t, int, bool, bool);
template Status abs_histogram<DeviceExec>(DeviceExec&, const void*, DType, int64_t, int64_t, int64_t, const float*,
                                          bool, int64_t, int64_t*, float*, int64_t*);

}  // namespace cuda
}  // namespace lq

#endif  // LQ_COMPILE_CHECK
