// Weight-specialised direct sparse convolution: the skeleton around generated per-weight code (v27).
//
// The direct kernels in direct_conv.cu read every nonzero from memory at run time, so a lane can only add a
// product to an accumulator chosen at compile time: one staged input load per FMA, which caps them near
// 15 TFLOP/s FP32 on an H100 (kernels/NOTES.md, "Floors"). Here the weight is known when the kernel is compiled
// (inference: the pruned weight is fixed; UnSparse-Opt paper 004 §5 deploys one kernel per layer). The Python side
// (unsparse/runtime/generated_source.py) writes every nonzero of KT output channels as one fused multiply-add with
// the weight as an immediate operand into a register accumulator, so one loaded input value feeds every nonzero of
// the KT rows at that (input channel, tap) (Escoin paper 000 §3.1 reuses a weight across pixels; this reuses an
// input across rows). No index is read at run time and no lane diverges.
//
// v26 staged chunks in shared memory and ran the code of all C channels once per block: 270 KB of instructions
// streamed per block, bound by instruction fetch (kernels/NOTES.md, twenty-ninth session). Here each thread loops
// over output pixels (grid-stride), so the body, all C channels of KT rows, is fetched into the SM's instruction
// cache once and run by every warp again and again; its size is set by KT.
//
// The generator defines the constants before this text and the body of `products` after it:
//   KT: output channels of this kernel; C: input channels; HP, WP: the padded input plane (H + 2 pad_h,
//     W + 2 pad_w); E, F: the output plane; THREADS: threads per block; T: storage type (float or __half);
//   products(base, acc): the generated body, one load of base[offset] per (channel, tap) with a nonzero among the
//     KT rows (offset = (c * HP + r) * WP + s, a compile-time constant below 2^31) and its fused multiply-adds.
//
// xp: (N, C, HP, WP) zero-padded input; y: (N, M, E, F) output, rows k0 .. k0 + KT - 1 written; bias: (M,) of T
// or nullptr; total = N * E * F. Stride 1, dilation 1, groups 1 only (the caller checks). Every address is inside xp
// for p < total: oy + r < HP and ox + s < WP.

#include <cuda_fp16.h>

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

__device__ __forceinline__ void products(const T* __restrict__ base, float* acc);

extern "C" __global__ void __launch_bounds__(THREADS) generated_conv(
    const T* __restrict__ xp, const T* __restrict__ bias, T* __restrict__ y, int total, int M, int k0) {
  for (int p = blockIdx.x * THREADS + threadIdx.x; p < total; p += gridDim.x * THREADS) {
    const int ox = p % F;
    const int oy = (p / F) % E;
    const int n = p / (E * F);
    const T* base = xp + (static_cast<size_t>(n) * C * HP + oy) * WP + ox;
    float acc[KT];
#pragma unroll
    for (int k = 0; k < KT; ++k) acc[k] = 0.0f;
    products(base, acc);
    T* out = y + ((static_cast<size_t>(n) * M + k0) * E + oy) * F + ox;
#pragma unroll
    for (int k = 0; k < KT; ++k) {
      if (k0 + k < M) store(out + static_cast<size_t>(k) * E * F, acc[k] + (bias ? to_float(bias[k0 + k]) : 0.0f));
    }
  }
}
