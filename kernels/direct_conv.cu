// Direct sparse convolution over a UniformCSR weight (Escoin, paper 000 §3; UnSparse-Opt, paper 004 §5).
//
// Two kernels, both templated on the storage dtype T (float or __half; arithmetic is always float) and
// on their tile sizes. Launch geometry is computed in one place on the Python side
// (unsparse/runtime/cupy_launcher.py); every index the kernels read was validated there first.
//
// direct_rows: the paper's design, general (any kernel size, stride, dilation, padding, Conv1d as H = 1).
//   Grid (pixel tiles, ceil(M / MB), ceil(N / SB)) (eq. 23: blocks = tiles * M-groups * ceil(N / SB)).
//   Each block walks MB output channels one after another; for each, the row's L stored entries
//   (uniform nnz, UnSparse-Opt §5: the same loop bound L for every row) are staged in shared memory in
//   chunks of JC entries as (stretched offset, tap shift, value) (Escoin §3.1 weight stretching, §3.3
//   weights stationary in shared memory). Each thread owns PB output pixels (strided by the block size,
//   so that a warp's loads are coalesced, Escoin §3.2 Fig. 6) of SB images (the sub-batch, eq. 23-24),
//   keeps SB*PB partial sums in registers and reuses each weight for SB*PB FMAs. Padding is handled by a
//   bounds check on the unpadded input instead of a padded copy.
//
// direct_patch: register-blocked variant for stride 1, dilation 1 Conv2d (the 3x3 and 1x1 layers that
//   carry most of the work). A block owns MB output channels and a TE x TF output tile of one image at a
//   time (it walks its SB images). Input channels are staged CC at a time into shared memory with their
//   halo (zero outside the image, so padding needs no copy). Each thread loads its (PE+R-1) x (PF+S-1)
//   input patch of a channel into registers once and applies every nonzero of the block's MB rows in that
//   channel to it: one loaded input feeds up to MB*R*S taps. Nonzeros are pre-grouped per
//   (channel group, input channel) at plan time as (code = (m_local*R + r)*S + s, value); the loop over
//   them is warp-uniform and a switch on the code selects compile-time register indices.

#include <cuda_fp16.h>

namespace unsparse {

__device__ __forceinline__ float load_float(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(__ldg(p)); }

__device__ __forceinline__ void store_float(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_float(__half* p, float v) { *p = __float2half_rn(v); }

}  // namespace unsparse

// Tap shift packing shared with the Python side: (r * dil_h) << 16 | (s * dil_w), both < 2^15.
constexpr int TAP_SHIFT_BITS = 16;
constexpr int TAP_SHIFT_MASK = (1 << TAP_SHIFT_BITS) - 1;

template <typename T, int PB, int SB, int JC>
__global__ void direct_rows(const T* __restrict__ x,            // (N, C, H, W), unpadded
                            const int* __restrict__ offsets,    // (M, L): c*H*W + r*dil_h*W + s*dil_w
                            const int* __restrict__ taps,       // (M, L): packed (r*dil_h, s*dil_w)
                            const T* __restrict__ values,       // (M, L)
                            const T* __restrict__ bias,         // (M,) or nullptr
                            T* __restrict__ out,                // (N, M, E, F)
                            int N, int C, int H, int W, int M, int L, int E, int F,
                            int stride_h, int stride_w, int pad_h, int pad_w, int channels_per_block) {
  __shared__ int s_off[JC];
  __shared__ int s_tap[JC];
  __shared__ float s_val[JC];

  const int P = E * F;
  const int m_begin = blockIdx.y * channels_per_block;
  const int n0 = blockIdx.z * SB;
  const int images = min(SB, N - n0);
  const long long image_size = static_cast<long long>(C) * H * W;
  const T* x_block = x + n0 * image_size;

  int iy0[PB], ix0[PB], base[PB];
  bool live[PB];
#pragma unroll
  for (int i = 0; i < PB; ++i) {
    const int p = (blockIdx.x * PB + i) * blockDim.x + threadIdx.x;
    live[i] = p < P;
    const int e = live[i] ? p / F : 0;
    const int f = live[i] ? p - e * F : 0;
    iy0[i] = e * stride_h - pad_h;
    ix0[i] = f * stride_w - pad_w;
    base[i] = iy0[i] * W + ix0[i];
  }

  const int m_end = min(M, m_begin + channels_per_block);
  for (int m = m_begin; m < m_end; ++m) {
    float acc[SB][PB];
#pragma unroll
    for (int b = 0; b < SB; ++b)
#pragma unroll
      for (int i = 0; i < PB; ++i) acc[b][i] = 0.f;

    for (int j0 = 0; j0 < L; j0 += JC) {
      const int count = min(JC, L - j0);
      __syncthreads();
      for (int j = threadIdx.x; j < count; j += blockDim.x) {
        const long long idx = static_cast<long long>(m) * L + j0 + j;
        s_off[j] = offsets[idx];
        s_tap[j] = taps[idx];
        s_val[j] = unsparse::load_float(values + idx);
      }
      __syncthreads();
#pragma unroll 4
      for (int j = 0; j < count; ++j) {
        const int off = s_off[j];
        const int dy = s_tap[j] >> TAP_SHIFT_BITS;
        const int dx = s_tap[j] & TAP_SHIFT_MASK;
        const float w = s_val[j];
#pragma unroll
        for (int i = 0; i < PB; ++i) {
          const bool inside = live[i] && static_cast<unsigned>(iy0[i] + dy) < static_cast<unsigned>(H) &&
                              static_cast<unsigned>(ix0[i] + dx) < static_cast<unsigned>(W);
          const T* src = x_block + (off + base[i]);
#pragma unroll
          for (int b = 0; b < SB; ++b) {
            const float v = (inside && b < images) ? unsparse::load_float(src + b * image_size) : 0.f;
            acc[b][i] = fmaf(w, v, acc[b][i]);
          }
        }
      }
    }

    const float bias_m = bias != nullptr ? unsparse::load_float(bias + m) : 0.f;
#pragma unroll
    for (int b = 0; b < SB; ++b) {
      if (b >= images) break;
      T* dst = out + (static_cast<long long>(n0 + b) * M + m) * P;
#pragma unroll
      for (int i = 0; i < PB; ++i) {
        const int p = (blockIdx.x * PB + i) * blockDim.x + threadIdx.x;
        if (live[i]) unsparse::store_float(dst + p, acc[b][i] + bias_m);
      }
    }
  }
}

template <int MM, int RR, int SS, int MB, int PE, int PF, int PH, int PW>
__device__ __forceinline__ void apply_tap(float (&acc)[MB][PE][PF], const float (&patch)[PH][PW], float w) {
#pragma unroll
  for (int i = 0; i < PE; ++i)
#pragma unroll
    for (int j = 0; j < PF; ++j) acc[MM][i][j] = fmaf(w, patch[i + RR][j + SS], acc[MM][i][j]);
}

// One switch case per code k = (m_local * R + r) * S + s; codes at or beyond MB * R * S never occur
// (checked at plan time) and compile to empty cases.
#define UNSPARSE_TAP_CASE(k)                                                                 \
  case (k):                                                                                  \
    if constexpr ((k) < MB * R * S) {                                                        \
      apply_tap<(k) / (R * S), ((k) / S) % R, (k) % S, MB, PE, PF, PE + R - 1, PF + S - 1>( \
          acc, patch, w);                                                                    \
    }                                                                                        \
    break;
#define UNSPARSE_TAP_CASES4(k) \
  UNSPARSE_TAP_CASE(k) UNSPARSE_TAP_CASE((k) + 1) UNSPARSE_TAP_CASE((k) + 2) UNSPARSE_TAP_CASE((k) + 3)
#define UNSPARSE_TAP_CASES16(k)                                                    \
  UNSPARSE_TAP_CASES4(k) UNSPARSE_TAP_CASES4((k) + 4) UNSPARSE_TAP_CASES4((k) + 8) \
  UNSPARSE_TAP_CASES4((k) + 12)
#define UNSPARSE_TAP_CASES64(k)                                                        \
  UNSPARSE_TAP_CASES16(k) UNSPARSE_TAP_CASES16((k) + 16) UNSPARSE_TAP_CASES16((k) + 32) \
  UNSPARSE_TAP_CASES16((k) + 48)

// Largest MB * R * S the switch covers; the Python side rejects tilings beyond it.
constexpr int PATCH_MAX_CODES = 256;

template <typename T, int R, int S, int MB, int PE, int PF, int TE, int TF, int CC>
__global__ void __launch_bounds__((TE / PE) * (TF / PF))
    direct_patch(const T* __restrict__ x,               // (N, C, H, W), unpadded
                 const int* __restrict__ group_ptr,     // (G * C + 1,): entries of (g, c) are [g*C+c, g*C+c+1)
                 const int* __restrict__ codes,         // (nnz,): (m_local * R + r) * S + s
                 const float* __restrict__ weights,     // (nnz,)
                 const T* __restrict__ bias,            // (M,) or nullptr
                 T* __restrict__ out,                   // (N, M, E, F)
                 int N, int C, int H, int W, int M, int E, int F, int pad_h, int pad_w, int tiles_f,
                 int sub_batch) {
  static_assert(TE % PE == 0 && TF % PF == 0, "tile must be a multiple of the thread tile");
  static_assert(MB * R * S <= PATCH_MAX_CODES, "switch covers PATCH_MAX_CODES codes");
  constexpr int IH = TE + R - 1;
  constexpr int IW = TF + S - 1;
  constexpr int THREADS = (TE / PE) * (TF / PF);
  __shared__ float tile[CC][IH][IW];

  const int group = blockIdx.x;
  const int m0 = group * MB;
  const int e0 = (blockIdx.y / tiles_f) * TE;
  const int f0 = (blockIdx.y % tiles_f) * TF;
  const int e_local = (threadIdx.x / (TF / PF)) * PE;
  const int f_local = (threadIdx.x % (TF / PF)) * PF;
  const int* ptr = group_ptr + static_cast<long long>(group) * C;

  for (int b = 0; b < sub_batch; ++b) {
    const int n = blockIdx.z * sub_batch + b;
    if (n >= N) break;
    const T* x_image = x + static_cast<long long>(n) * C * H * W;
    float acc[MB][PE][PF];
#pragma unroll
    for (int mm = 0; mm < MB; ++mm)
#pragma unroll
      for (int i = 0; i < PE; ++i)
#pragma unroll
        for (int j = 0; j < PF; ++j) acc[mm][i][j] = 0.f;

    for (int c0 = 0; c0 < C; c0 += CC) {
      if (ptr[c0] == ptr[min(c0 + CC, C)]) continue;  // no nonzero in these channels: uniform skip
      __syncthreads();
      for (int idx = threadIdx.x; idx < CC * IH * IW; idx += THREADS) {
        const int cc = idx / (IH * IW);
        const int rest = idx - cc * (IH * IW);
        const int yy = rest / IW;
        const int xx = rest - yy * IW;
        const int c = c0 + cc;
        const int iy = e0 + yy - pad_h;
        const int ix = f0 + xx - pad_w;
        const bool inside = c < C && static_cast<unsigned>(iy) < static_cast<unsigned>(H) &&
                            static_cast<unsigned>(ix) < static_cast<unsigned>(W);
        tile[cc][yy][xx] =
            inside ? unsparse::load_float(x_image + (static_cast<long long>(c) * H + iy) * W + ix) : 0.f;
      }
      __syncthreads();
      const int c_end = min(CC, C - c0);
      for (int cc = 0; cc < c_end; ++cc) {
        const int begin = ptr[c0 + cc];
        const int end = ptr[c0 + cc + 1];
        if (begin == end) continue;
        float patch[PE + R - 1][PF + S - 1];
#pragma unroll
        for (int i = 0; i < PE + R - 1; ++i)
#pragma unroll
          for (int j = 0; j < PF + S - 1; ++j) patch[i][j] = tile[cc][e_local + i][f_local + j];
        // The next entry's code and weight are loaded before this one's switch runs, so the load latency
        // overlaps the FMAs instead of preceding every indirect branch.
        int next_code = __ldg(codes + begin);
        float next_w = __ldg(weights + begin);
        for (int t = begin; t < end; ++t) {
          const int code = next_code;
          const float w = next_w;
          if (t + 1 < end) {
            next_code = __ldg(codes + t + 1);
            next_w = __ldg(weights + t + 1);
          }
          switch (code) {
            UNSPARSE_TAP_CASES64(0)
            UNSPARSE_TAP_CASES64(64)
            UNSPARSE_TAP_CASES64(128)
            UNSPARSE_TAP_CASES64(192)
            default:
              break;
          }
        }
      }
    }

#pragma unroll
    for (int mm = 0; mm < MB; ++mm) {
      const int m = m0 + mm;
      if (m >= M) break;
      const float bias_m = bias != nullptr ? unsparse::load_float(bias + m) : 0.f;
      T* dst = out + (static_cast<long long>(n) * M + m) * E * F;
#pragma unroll
      for (int i = 0; i < PE; ++i) {
        const int e = e0 + e_local + i;
#pragma unroll
        for (int j = 0; j < PF; ++j) {
          const int f = f0 + f_local + j;
          if (e < E && f < F) unsparse::store_float(dst + e * F + f, acc[mm][i][j] + bias_m);
        }
      }
    }
  }
}
