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
//     W + 2 pad_w); E, F: the output plane; MAX_THREADS: the most threads per block a launch may use (the launch
//     bound; the launch picks its own count up to it, blockDim.x, so a batch size needs no kernel of its own);
//     MIN_BLOCKS: the blocks of MAX_THREADS each SM should hold, the launch bound's second part (ptxas fits the
//     registers per thread to it), or 0 for none. A bound of 1 is not the absence of one: ResNet-50's stem program
//     of 64 rows took 224 registers under (256, 1) and 128 under (256) (kernels/NOTES.md, fifty-fifth session);
//     T: storage type of the output and the bias (float or __half);
//   products(base, acc): the generated body, one float load of base[offset] per (channel, tap) with a nonzero among
//     the KT rows (offset = (c * HP + r) * WP + s, a compile-time constant below 2^31) and its fused multiply-adds.
//
// xp: (N, C, HP, WP) zero-padded input in float32 whatever T is: the caller converts a float16 input while padding
// it, since a conversion per load (cuda_fp16.hpp's __half2float is inline PTX) made NVRTC take 3-4x as long on a
// body of 14.6 k products (kernels/NOTES.md, thirty-fourth session); y: (N, M, E, F) output of T, rows k0 .. k0 + KT
// - 1 written; bias: (M,) of T or nullptr; residual: (N, M, E, F) of T, contiguous, added after the bias and before
// the ReLU (a residual block's relu(conv3(x) + identity), in float32 and rounded once with the rest), or nullptr for
// none; total = N * E * F; relu: nonzero to apply the ReLU that follows the layer in the epilogue. Stride 1, dilation 1, groups 1 only (the caller checks; a strided layer arrives as its
// phase split, and E x F is then the strided layer's plane, the top-left corner of the split's). Every address is
// inside xp for p < total: oy + r < HP and ox + s < WP.
//
// pool: nonzero to apply the 2x2, stride-2 max pool that follows the layer (after its ReLU, if any) in the epilogue
// (residual is then nullptr: a pooled layer has no residual add, unsparse/runtime/backends/generated.py refuses both):
// y is then (N, M, E / 2, F / 2) (floor, as nn.MaxPool2d(2)), total = N * (E / 2) * (F / 2) * 4, and four
// consecutive pixel indices are one pool window's four outputs, computed by four adjacent lanes that reduce their
// sums to the window's maxima and store them (store_rows). Bias and ReLU are applied to the maximum: both are
// monotone in the sum, so relu(max(a) + b) = max(relu(a + b)) exactly, rounding included. The caller launches
// blocks of a multiple of four threads, so a lane group is never split by the p < total test.

#include <cuda_fp16.h>

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

struct Pixel {
  int n, oy, ox;
};

// The pooled plane; at least 1, so that a plane below 2x2 (whose pool the caller refuses) divides by no zero.
constexpr int EP = E > 1 ? E / 2 : 1, FP = F > 1 ? F / 2 : 1;

// Output pixel p (0 <= p < total) of the NCHW output plane; with pool, pixel p & 3 (row-major) of pool window p >> 2.
__device__ __forceinline__ Pixel locate(int p, int pool) {
  if (!pool) return {p / (E * F), (p / F) % E, p % F};
  const int window = p >> 2;
  return {window / (EP * FP), 2 * ((window / FP) % EP) + ((p >> 1) & 1), 2 * (window % FP) + (p & 1)};
}

// The larger of a and b, NaN if either is (as torch's max pool propagates it; fmaxf would drop it).
__device__ __forceinline__ float pool_max(float a, float b) { return (b > a || b != b) ? b : a; }

// The padded input at pixel q's window origin: tap (c, r, s) is at + (c * HP + r) * WP + s.
__device__ __forceinline__ const float* window(const float* __restrict__ xp, Pixel q) {
  return xp + (static_cast<size_t>(q.n) * C * HP + q.oy) * WP + q.ox;
}

// KT rounded up to a multiple of four: the rows the pooled epilogue's butterfly splits over a window's four lanes.
constexpr int KQ = (KT + 3) / 4 * 4;

// acc[k], or 0 for a row k past KT (only where KT is not a multiple of four; resolved at compile time once unrolled).
__device__ __forceinline__ float row_sum(const float* acc, int k) { return k < KT ? acc[k] : 0.0f; }

// Rows k0 .. k0 + KT - 1 below out_channels of pixel q, with the bias, the residual's value at the same output index
// where residual is not nullptr (v64), and with the ReLU that follows the layer where relu is nonzero (a negative sum
// stored as 0; NaN kept, as torch.relu keeps it). The residual is read with a branch, not as + 0 when absent, so that
// a sum of -0 stays -0 without one.
//
// With pool, the four lanes of pixel q's pool window (all four call this together) hold the window's four sums of
// each row and reduce them as a butterfly (v40): the two lanes of each pair (bit 0 of the lane) swap half of their
// rows and each keeps the maxima of its half, then the two pairs (bit 1) do the same with quarters, so that lane
// (b1 b0) ends with the window's maxima of rows b0 * KQ / 2 + b1 * KQ / 4 + j, j < KQ / 4, and all four lanes store
// at the window's place in the pooled plane: 3 KQ / 4 shuffles and KQ / 4 stores per lane. v39 reduced every row in
// every lane (2 KT shuffles) and stored KT rows from one lane of four while the other three waited.
__device__ __forceinline__ void store_rows(T* __restrict__ y, const T* __restrict__ bias,
                                           const T* __restrict__ residual, Pixel q, int out_channels, int k0,
                                           const float* acc, int relu, int pool) {
  if (!pool) {
    const size_t at = (static_cast<size_t>(q.n) * out_channels + k0) * (E * F) + q.oy * F + q.ox;
#pragma unroll
    for (int k = 0; k < KT; ++k) {
      if (k0 + k < out_channels) {
        float v = acc[k] + (bias ? to_float(bias[k0 + k]) : 0.0f);
        if (residual) v += to_float(residual[at + static_cast<size_t>(k) * (E * F)]);
        store(y + at + static_cast<size_t>(k) * (E * F), relu && v < 0.0f ? 0.0f : v);
      }
    }
    return;
  }
  const unsigned int group = 0xFu << (threadIdx.x & 28u);  // this lane's group of four in its warp
  const bool odd = threadIdx.x & 1u, upper_pair = threadIdx.x & 2u;
  float half[KQ / 2], quarter[KQ / 4];
#pragma unroll
  for (int j = 0; j < KQ / 2; ++j) {
    const float low = row_sum(acc, j), high = row_sum(acc, j + KQ / 2);
    half[j] = pool_max(odd ? high : low, __shfl_xor_sync(group, odd ? low : high, 1));
  }
#pragma unroll
  for (int j = 0; j < KQ / 4; ++j) {
    const float low = half[j], high = half[j + KQ / 4];
    quarter[j] = pool_max(upper_pair ? high : low, __shfl_xor_sync(group, upper_pair ? low : high, 2));
  }
  const int first = (odd ? KQ / 2 : 0) + (upper_pair ? KQ / 4 : 0);
  T* out = y + (static_cast<size_t>(q.n) * out_channels + k0 + first) * (EP * FP) + (q.oy >> 1) * FP + (q.ox >> 1);
#pragma unroll
  for (int j = 0; j < KQ / 4; ++j) {
    const int k = first + j;
    if (k < KT && k0 + k < out_channels) {
      const float v = quarter[j] + (bias ? to_float(bias[k0 + k]) : 0.0f);
      store(out + static_cast<size_t>(j) * (EP * FP), relu && v < 0.0f ? 0.0f : v);
    }
  }
}

#if MIN_BLOCKS > 0
#define LAUNCH_BOUNDS __launch_bounds__(MAX_THREADS, MIN_BLOCKS)
#else
#define LAUNCH_BOUNDS __launch_bounds__(MAX_THREADS)
#endif

#ifndef G
__device__ __forceinline__ void products(const float* __restrict__ base, float* acc);

extern "C" __global__ void LAUNCH_BOUNDS generated_conv(
    const float* __restrict__ xp, const T* __restrict__ bias, const T* __restrict__ residual, T* __restrict__ y,
    int total, int M, int k0, int relu, int pool) {
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < total; p += gridDim.x * blockDim.x) {
    const Pixel q = locate(p, pool);
    float acc[KT];
#pragma unroll
    for (int k = 0; k < KT; ++k) acc[k] = 0.0f;
    products(window(xp, q), acc);
    store_rows(y, bias, residual, q, M, k0, acc, relu, pool);
  }
}
#else
// v31: G programs in one kernel, each on its own share of the SMs. v27 ran one program per kernel over every pixel, so
// each program streamed the whole input from DRAM and its loads stalled on DRAM (kernels/NOTES.md, thirtieth
// session); v30 put the G programs on the same SM and stalled on instruction fetch. Here a block runs the program of
// the SM it landed on (smid % G), so each SM streams one body, and takes its tiles of blockDim.x pixels in order from
// that program's counter: the G programs walk the pixels together on G sets of SMs, each in flight over about 1/G
// of the pixels the whole GPU would cover, and all but the first to read an input line find it in L2. A block whose
// program has no tile left takes tiles of the next program (only the last tiles mix bodies on an SM).
//
// Also defined by the generator: G, M (the layer's output channels), and run(program, base, acc), a switch whose
// case g runs program g's body and returns its first output channel. counters: G zeros, one tile counter per
// program, set by the caller before each launch.

__device__ __forceinline__ int run(int program, const float* __restrict__ base, float* acc);

extern "C" __global__ void LAUNCH_BOUNDS generated_conv_shared(
    const float* __restrict__ xp, const T* __restrict__ bias, const T* __restrict__ residual, T* __restrict__ y,
    int total, int relu, int pool, unsigned int* __restrict__ counters) {
  __shared__ unsigned int s_tile;
  unsigned int smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  const unsigned int tiles = (static_cast<unsigned int>(total) + blockDim.x - 1) / blockDim.x;
  for (int step = 0; step < G; ++step) {
    const int program = static_cast<int>((smid + step) % G);
    for (;;) {
      if (threadIdx.x == 0) s_tile = atomicAdd(&counters[program], 1u);
      __syncthreads();
      const unsigned int tile = s_tile;
      __syncthreads();
      if (tile >= tiles) break;
      const int p = static_cast<int>(tile * blockDim.x + threadIdx.x);
      // Threads past the last pixel compute it again and store nothing: whole lane groups, as total is a multiple
      // of four with pool.
      const Pixel q = locate(min(p, total - 1), pool);
      float acc[KT];
#pragma unroll
      for (int k = 0; k < KT; ++k) acc[k] = 0.0f;
      const int k0 = run(program, window(xp, q), acc);
      if (p < total) store_rows(y, bias, residual, q, M, k0, acc, relu, pool);
    }
  }
}
#endif
