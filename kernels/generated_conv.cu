// Weight-specialised direct sparse convolution: the skeleton around generated per-weight code.
//
// The direct kernels in direct_conv.cu read every nonzero from memory at run time, so a lane can only add a
// product to an accumulator chosen at compile time: one staged input load per FMA, which caps them near
// 15 TFLOP/s FP32 on an H100 (kernels/NOTES.md, "Floors"). Here the weight is known when the kernel is compiled
// (inference: the pruned weight is fixed, UnSparse-Opt paper 004 §5 deploys one kernel per layer). The Python side
// (unsparse/runtime/generated_source.py) writes every nonzero of KT output channels as one fused multiply-add with
// the weight as an immediate operand into a register-resident accumulator, so one staged input value feeds every
// nonzero of the KT rows at that (channel, tap) (Escoin paper 000 §3.1 reuses a weight across pixels; this reuses
// an input across rows). The code is straight-line per input channel, so no index is read at run time and no
// lane diverges.
//
// The generator defines, before this text:
//   KT, CC, TH, TW, R, S, PAD_H, PAD_W: output channels per kernel, input channels per staged chunk, the output
//     tile (TH x TW pixels of one image, one pixel per thread), the filter size and the padding;
//   T: the storage type (float or __half); arithmetic is always float;
//   chunk_products(chunk, window, base, acc): the generated products of input channels chunk * CC .. + CC - 1.
//
// Launch (unsparse/runtime/generated_source.py, `launch_grid`): grid (ceil(F / TW) * ceil(E / TH) * N),
// block TH * TW threads; stride 1, dilation 1, groups 1 only (the caller checks). Every index below is bounded by
// the loop limits and the image bounds, so no value read from the untrusted weight file reaches an address.

#include <cuda_fp16.h>

constexpr int WH = TH + R - 1;  // staged rows per channel (tile plus halo)
constexpr int WW = TW + S - 1;  // staged columns per channel
constexpr int THREADS = TH * TW;
constexpr int ROWS_PER_PASS = THREADS / WW;  // staged rows one pass of the block copies (one column per thread)

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// x: (N, C, H, W) input; y: (N, M, E, F) output, rows k0 .. k0 + KT - 1 written; bias: (M,) or nullptr.
extern "C" __global__ void __launch_bounds__(THREADS) generated_conv(
    const T* __restrict__ x, const float* __restrict__ bias, T* __restrict__ y, int N, int C, int H, int W, int M,
    int E, int F, int k0) {
  static_assert(ROWS_PER_PASS >= 1, "a tile must be at least as wide as one staged row");
  __shared__ float window[CC * WH * WW];
  const int tiles_x = (F + TW - 1) / TW;
  const int tiles_y = (E + TH - 1) / TH;
  int block = blockIdx.x;
  const int x0 = (block % tiles_x) * TW;
  block /= tiles_x;
  const int y0 = (block % tiles_y) * TH;
  const int n = block / tiles_y;
  const int t = threadIdx.x;

  // Staging: thread t copies column t % WW of staged rows t / WW, t / WW + ROWS_PER_PASS, ...
  const int stage_col = t % WW;
  const int stage_row = t / WW;
  const int xx = x0 + stage_col - PAD_W;
  const bool stages = stage_row < ROWS_PER_PASS && xx >= 0 && xx < W;
  const bool copies = stage_row < ROWS_PER_PASS;

  float acc[KT];
#pragma unroll
  for (int k = 0; k < KT; ++k) acc[k] = 0.0f;

  const int chunks = (C + CC - 1) / CC;
  const int base = (t / TW) * WW + t % TW;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    if (copies) {
#pragma unroll
      for (int cl = 0; cl < CC; ++cl) {
        const int c = chunk * CC + cl;
#pragma unroll
        for (int rr = 0; rr < WH; rr += ROWS_PER_PASS) {
          const int row = rr + stage_row;
          const int yy = y0 + row - PAD_H;
          if (row < WH) {
            float v = 0.0f;
            if (stages && c < C && yy >= 0 && yy < H) v = to_float(x[((static_cast<size_t>(n) * C + c) * H + yy) * W + xx]);
            window[(cl * WH + row) * WW + stage_col] = v;
          }
        }
      }
    }
    __syncthreads();
    chunk_products(chunk, window, base, acc);
    __syncthreads();
  }

  const int oy = y0 + t / TW;
  const int ox = x0 + t % TW;
  if (oy < E && ox < F) {
    T* out = y + ((static_cast<size_t>(n) * M + k0) * E + oy) * F + ox;
#pragma unroll
    for (int k = 0; k < KT; ++k) {
      if (k0 + k < M) store(out + static_cast<size_t>(k) * E * F, acc[k] + (bias ? bias[k0 + k] : 0.0f));
    }
  }
}
