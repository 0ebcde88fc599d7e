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
// v28: each thread computes PIXELS adjacent output pixels of one row. With PIXELS = 2 the values of a (channel,
// kernel row) are loaded as aligned pairs: one 8-byte load (4-byte for __half) feeds both pixels at two taps, so the
// L1 wavefronts per FMA, which bound v27 (kernels/NOTES.md, thirtieth session), fall by about 2.4x at KT = 32.
//
// The generator defines the constants before this text and the body of `products` after it:
//   KT: output channels of this kernel; PIXELS: output pixels per thread (1 or 2); C: input channels; HP, WP: the
//     padded input plane (H + 2 pad_h rows of WP elements: pad_w zero columns, the row, zeros up to WP; for
//     PIXELS = 2, WP is even and covers the last pair of every row); E, F: the output plane; THREADS: threads per
//     block; T: storage type (float or __half);
//   products(base, acc): the generated body; its loads read base[offset] (PIXELS = 1, offset = (c * HP + r) * WP
//     + s) or the pair base[offset], base[offset + 1] (PIXELS = 2, offset even) for each (channel, tap) with a
//     nonzero among the KT rows (offsets are compile-time constants below 2^31), then its fused multiply-adds.
//
// xp: (N, C, HP, WP) zero-padded input, 8-byte aligned; y: (N, M, E, F) output, rows k0 .. k0 + KT - 1 written;
// bias: (M,) of T or nullptr; total = N * E * GF pixel groups, GF = ceil(F / PIXELS). Stride 1, dilation 1, groups 1
// only (the caller checks). Every address is inside xp for p < total: oy + r < HP and ox + s + 1 < WP (ox + s < WP
// for PIXELS = 1); a pixel ox + q >= F of the last group is computed from the zero columns and not stored.

#include <cuda_fp16.h>

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ float load(const T* p) { return to_float(__ldg(p)); }
__device__ __forceinline__ float2 load2(const float* p) { return __ldg(reinterpret_cast<const float2*>(p)); }
__device__ __forceinline__ float2 load2(const __half* p) {
  return __half22float2(__ldg(reinterpret_cast<const __half2*>(p)));
}

#define GF ((F + PIXELS - 1) / PIXELS)

__device__ __forceinline__ void products(const T* __restrict__ base, float (&acc)[PIXELS][KT]);

extern "C" __global__ void __launch_bounds__(THREADS) generated_conv(
    const T* __restrict__ xp, const T* __restrict__ bias, T* __restrict__ y, int total, int M, int k0) {
  for (int p = blockIdx.x * THREADS + threadIdx.x; p < total; p += gridDim.x * THREADS) {
    const int ox = (p % GF) * PIXELS;
    const int oy = (p / GF) % E;
    const int n = p / (E * GF);
    const T* base = xp + (static_cast<size_t>(n) * C * HP + oy) * WP + ox;
    float acc[PIXELS][KT];
#pragma unroll
    for (int q = 0; q < PIXELS; ++q) {
#pragma unroll
      for (int k = 0; k < KT; ++k) acc[q][k] = 0.0f;
    }
    products(base, acc);
    T* out = y + ((static_cast<size_t>(n) * M + k0) * E + oy) * F + ox;
#pragma unroll
    for (int q = 0; q < PIXELS; ++q) {
#pragma unroll
      for (int k = 0; k < KT; ++k) {
        if (ox + q < F && k0 + k < M) {
          store(out + q + static_cast<size_t>(k) * E * F, acc[q][k] + (bias ? to_float(bias[k0 + k]) : 0.0f));
        }
      }
    }
  }
}
