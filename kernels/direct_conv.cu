// Direct sparse convolution over a UniformCSR weight (Escoin, paper 000 §3; UnSparse-Opt, paper 004 §5).
//
// Three convolution kernels, all templated on the storage dtype T (float or __half; arithmetic is always float)
// and on their tile sizes, and input transforms (at the end): pad_planes, the generated kernels' padded float32 input,
// and direct_tile's paired settings' pair_images and, for strided layers, phase_pair_images. Launch geometry is
// computed in one place on the Python side (unsparse/runtime/launch_geometry.py); every index the kernels read was
// validated there first. Each convolution kernel adds the bias, where its residual argument is not null the residual
// block's identity, and, where its last argument relu is nonzero, applies the ReLU that follows the layer as it stores
// an output (epilogue below).
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
// direct_tile: stride 1, dilation 1 Conv2d (the 3x3 layers that carry most of the work). A block
//   owns WARPS * MW output channels, a TE x TF output tile (TE = (32 / WX) * PY, TF = WX) and NB images.
//   Input channels are staged CC at a time into shared memory with their halo (zero outside the image, so
//   padding needs no copy); chunks stream in with cp.async into two buffers (chunk k + 1 loads while chunk k
//   computes). An element is one float32 image, or (IMAGES = 2) a float2 pair of float32 images or a __half2 pair
//   of float16 images, read from an image-paired input (ceil(N/2), C, H, W, 2) that the Python side builds (one load
//   feeds the FMAs of two images).
//   Each warp walks the nonzeros of its MW rows in the staged channels: per nonzero one broadcast load of
//   (offset into the staged chunk, weight) (Escoin §3.1 stretching, done at plan time against the tile
//   layout), then for each of the lane's PY * NB outputs one shared load at offset + a compile-time
//   displacement and one FMA. The nonzero loop is warp-uniform (no divergence, weight and offset are
//   broadcasts), its bound is the per-(row, chunk) count (UnSparse-Opt's uniform padding entries are
//   dropped at plan time), and the lanes of a warp read 32 distinct banks (padded row width chosen on the
//   Python side).
//   U = 3 ("union" settings, float32): the warp walks its MW rows three at a time; an entry is one tap of the
//   union of the three rows' nonzero taps in the chunk with the three weights (zero where a row lacks the tap),
//   so each staged element a lane loads feeds three FMAs instead of one (kernels/NOTES.md v21).
//   VEC = 1 (WX = 32, W % 4 == 0, a 16-byte aligned input, pad_w <= S - 1; checked on the Python
//   side): each staged row's 32 interior columns (input columns f0 .. f0 + 31) are copied as 16-byte
//   cp.async of VE = 16 / sizeof(element) elements, which the row layout aligns by starting column xx of every
//   row at LEFT + xx with (LEFT + pad_w) % VE == 0; the S - 1 halo columns stay one-element copies. Per staged
//   element this issues about a fifth of the scalar path's address arithmetic (kernels/NOTES.md, third session).
//   SE = 1 ("staged entries"): each warp also copies its groups' entries of chunk k + 1 into its slots in shared
//   memory with the input chunk (cp.async, one entry per lane), so the nonzero loop reads each entry by one
//   broadcast shared load, not by a warp-uniform global load that costs the L1 one wavefront per 4 bytes
//   (kernels/NOTES.md v25).

#include <cuda_fp16.h>

namespace unsparse {

__device__ __forceinline__ float load_float(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(__ldg(p)); }

__device__ __forceinline__ void store_float(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_float(__half* p, float v) { *p = __float2half_rn(v); }

// An output's epilogue: the sum plus its channel's bias plus, where `residual` is not null, its element at the
// output's `index` in the (N, M, E, F) output, through the ReLU that follows the layer where relu is nonzero (a fused layer,
// SparseConv.relu: a negative value stored as 0, NaN kept as torch.relu keeps it), so the ReLU's pass over the ofmap,
// a read and a write of every element, disappears, and with a residual (SparseConv.residual: a residual block's end,
// relu(conv3(x) + bias + identity), ResNet, paper 004 §6) the add's pass too, two reads and a write of every element.
// The sum is rounded to T once, where the unfused model rounds the convolution and then the add. relu and whether
// there is a residual are uniform across a launch.
// A residual known null at compile time (direct_tile's wide tilings) leaves the code of an epilogue without one.
template <typename T>
__device__ __forceinline__ float epilogue(float sum, float bias, const T* residual, long long index, int relu) {
  float v = sum + bias;
  if (residual != nullptr) v += load_float(residual + index);
  return relu && v < 0.f ? 0.f : v;
}

// The same, with the residual's element already loaded (direct_pointwise's vector loads).
__device__ __forceinline__ float epilogue(float sum, float bias, float identity, int relu) {
  const float v = sum + bias + identity;
  return relu && v < 0.f ? 0.f : v;
}

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
                            const T* __restrict__ residual,     // (N, M, E, F) or nullptr
                            T* __restrict__ out,                // (N, M, E, F)
                            int N, int C, int H, int W, int M, int L, int E, int F,
                            int stride_h, int stride_w, int pad_h, int pad_w, int channels_per_block, int relu) {
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
      const long long plane = (static_cast<long long>(n0 + b) * M + m) * P;
#pragma unroll
      for (int i = 0; i < PB; ++i) {
        const int p = (blockIdx.x * PB + i) * blockDim.x + threadIdx.x;
        if (live[i])
          unsparse::store_float(out + plane + p, unsparse::epilogue(acc[b][i], bias_m, residual, plane + p, relu));
      }
    }
  }
}

// Input and shared-memory element of direct_tile, IMAGES images per element: float32 one image, or with IMAGES = 2
// a float2 of images 2i and 2i + 1 (the union tilings, kernels/NOTES.md v22: one 8-byte load feeds the FMAs of both
// images); float16 always two images (a __half2), so one 4-byte load feeds two FMAs. Both pairs come from the
// image-paired input (ceil(N/2), C, H, W, 2) that the Python side builds.
template <typename T, int IMAGES>
struct TileElem;
template <>
struct TileElem<float, 1> {
  using type = float;
  __device__ static void to_float(float v, float (&out)[1]) { out[0] = v; }
};
template <>
struct TileElem<float, 2> {
  using type = float2;
  __device__ static void to_float(float2 v, float (&out)[2]) {
    out[0] = v.x;
    out[1] = v.y;
  }
};
template <>
struct TileElem<__half, 2> {
  using type = __half2;
  __device__ static void to_float(__half2 v, float (&out)[2]) {
    const float2 f = __half22float2(v);
    out[0] = f.x;
    out[1] = f.y;
  }
};

// One 4-, 8- or 16-byte cp.async into shared memory; `live` false zero-fills the destination.
template <int BYTES>
__device__ __forceinline__ void stage_async(void* dst, const void* src, bool live) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned dst_addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_addr), "l"(src), "r"(live ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst_addr), "l"(src), "n"(BYTES),
                 "r"(live ? BYTES : 0));
  }
}

// One entry of the per-(row group, chunk) lists: U = 1, (offset, weight bits) of one output channel; U = 3, (offset,
// weight bits of channels 3g, 3g + 1, 3g + 2), a tap of the union of the three channels' nonzero taps, zero bits where
// a channel lacks it (kernels/NOTES.md v21). One 8- or 16-byte load.
template <int U>
struct TileEntry;
template <>
struct TileEntry<1> {
  using type = int2;
  __device__ static void bits(const int2& e, int (&w)[1]) { w[0] = e.y; }
};
template <>
struct TileEntry<3> {
  using type = int4;
  __device__ static void bits(const int4& e, int (&w)[3]) {
    w[0] = e.y;
    w[1] = e.z;
    w[2] = e.w;
  }
};

// Walks the entries of rows m_base .. m_base + MW - 1 (those below M) in staged chunk k, warp-uniformly, group by
// group of U rows, and calls apply(g, offset, weight bits[U]) for each entry of group g (rows m_base + g*U + u): the
// per-(row group, chunk) lists that direct_tile and direct_pointwise share (chunk_ptr / entries, built and validated
// by prepare_tile on the Python side; m_base is a multiple of U). RUN > 0: the entries of a group come in runs of at
// most RUN, and flush(g) follows each run (direct_tile's half2 partial sums); RUN = 0: one pass per group, no flush.
// STAGED: entry_data is not the global list but this warp's slots of chunk k in shared memory, `capacity` entries
// per group (stage_entries below), so an entry is one broadcast shared load instead of a global load through L1
// (kernels/NOTES.md v25).
template <int MW, int U, int UNROLL, int RUN, bool STAGED, typename Apply, typename Flush>
__device__ __forceinline__ void for_each_entry(const int* __restrict__ chunk_ptr, const void* __restrict__ entry_data,
                                               int capacity, int m_base, int M, int K, int k, const Apply& apply,
                                               const Flush& flush) {
  static_assert(MW % U == 0, "a warp's rows split into whole groups");
  using Entry = typename TileEntry<U>::type;
  const Entry* entries = static_cast<const Entry*>(entry_data);
  const auto visit = [&](int g, int t) {
    Entry entry;
    if constexpr (STAGED) {
      entry = entries[t];
    } else {
      entry = __ldg(entries + t);
    }
    int bits[U];
    TileEntry<U>::bits(entry, bits);
    apply(g, entry.x, bits);
  };
#pragma unroll
  for (int g = 0; g < MW / U; ++g) {
    const int m = m_base + g * U;
    if (m >= M) break;
    const int list = m / U * K + k;
    int begin = __ldg(chunk_ptr + list);
    int end = __ldg(chunk_ptr + list + 1);
    if constexpr (STAGED) {
      end += g * capacity - begin;
      begin = g * capacity;
    }
    if constexpr (RUN == 0) {
#pragma unroll UNROLL
      for (int t = begin; t < end; ++t) visit(g, t);
    } else {
      for (int run = begin; run < end; run += RUN) {
        const int stop = min(end, run + RUN);
#pragma unroll UNROLL
        for (int t = run; t < stop; ++t) visit(g, t);
        flush(g);
      }
    }
  }
}

// Copies the entries of chunk k of the warp's groups (rows m_base .. m_base + MW - 1 below M) into its slots in
// shared memory, `capacity` entries per group, by asynchronous copies of one entry per lane (for_each_entry's STAGED
// lists). The Python side sets `capacity` to the longest (group, chunk) list, so every copy stays in the warp's slots.
template <int MW, int U>
__device__ __forceinline__ void stage_entries(const int* __restrict__ chunk_ptr, const void* __restrict__ entry_data,
                                              void* slots, int capacity, int m_base, int M, int K, int k, int lane) {
  using Entry = typename TileEntry<U>::type;
  const Entry* entries = static_cast<const Entry*>(entry_data);
  Entry* dst = static_cast<Entry*>(slots);
#pragma unroll
  for (int g = 0; g < MW / U; ++g) {
    const int m = m_base + g * U;
    if (m >= M) break;
    const int list = m / U * K + k;
    const int begin = __ldg(chunk_ptr + list);
    const int count = __ldg(chunk_ptr + list + 1) - begin;
#pragma unroll 1
    for (int t = lane; t < count; t += 32)
      stage_async<sizeof(Entry)>(dst + g * capacity + t, entries + begin + t, true);
  }
}

// Tilings with more than 64 float32 sums per thread (the paired union tilings of kernels/NOTES.md v22) walk their
// entries two at a time and are held to 128 registers, two 256-thread blocks per SM: unrolled by four, ptxas gave
// them 137-153 registers, one block per SM. The others take the tiling's MIN_BLOCKS, 0 (no minimum) unless the
// Python side names one: an explicit 1 let ptxas take 96 registers for 64-register tilings and spill the 1024-thread
// ones, and the staged-entry tilings (SE) name the blocks per SM of the tiling they stage for (kernels/NOTES.md v25).
constexpr int TILE_WIDE_SUMS = 64;

template <typename T, int R, int S, int WX, int PY, int NB, int MW, int WARPS, int CC, int IWP, int LEFT, int VEC,
          int HALF_RUN, int U, int IMAGES, int SE, int MIN_BLOCKS>
__global__ void __launch_bounds__(WARPS * 32, MW * NB * PY > TILE_WIDE_SUMS ? 2 : MIN_BLOCKS)
    direct_tile(const T* __restrict__ x,                // IMAGES 1: (N, C, H, W); 2: (ceil(N/2), C, H, W, 2)
                const int* __restrict__ chunk_ptr,      // (ceil(M/U) * K + 1,): entries of (group g, k) from g*K+k
                const void* __restrict__ entries,       // (n,) TileEntry<U>: tile offset, U weights' bits
                const T* __restrict__ bias,             // (M,) or nullptr
                const T* __restrict__ residual,         // (N, M, E, F) or nullptr
                T* __restrict__ out,                    // (N, M, E, F)
                int N, int C, int H, int W, int M, int E, int F, int pad_h, int pad_w, int tiles_f,
                int groups,
                int entry_capacity,  // SE = 1: entries per (group, chunk) slot in shared memory, >= the longest list
                int relu) {
  using Elem = typename TileElem<T, IMAGES>::type;
  constexpr int VE = 16 / sizeof(Elem);  // elements per 16-byte vector
  static_assert(NB % IMAGES == 0, "paired tiles: NB must be even");
  static_assert(HALF_RUN == 0 || sizeof(T) == 2, "half2 products need the float16 image pairs");
  static_assert(MW * NB * PY <= TILE_WIDE_SUMS || WARPS <= 8,
                "a wide tiling runs two blocks per SM at 128 registers: at most 8 warps each");
  static_assert(U == 1 || sizeof(T) == 4, "union entries are float32 only (kernels/NOTES.md v21)");
  static_assert(MIN_BLOCKS == 0 || MW * NB * PY <= TILE_WIDE_SUMS, "a wide tiling's minimum is fixed at two blocks");
  static_assert(32 % WX == 0, "a warp row holds WX lanes");
  constexpr int NBE = NB / IMAGES;
  constexpr int WY = 32 / WX;
  constexpr int TE = WY * PY;
  constexpr int IH = TE + R - 1;
  constexpr int IW = WX + S - 1;
  static_assert(IWP >= LEFT + IW, "padded tile row holds the halo");
  static_assert(!VEC || (WX == 32 && IWP % VE == 0),
                "16-byte staging: one 32-column warp row, rows of whole 16-byte vectors");
  constexpr int PLANE = IH * IWP;
  constexpr int CS = NBE * PLANE;  // one input channel of the tile, all its image elements
  constexpr int THREADS = WARPS * 32;
  constexpr int STAGED = CC * NBE * IH * IW;
  constexpr int ENTRY_UNROLL = MW * NB * PY > TILE_WIDE_SUMS ? 2 : 4;
  // The two staged chunks sit in dynamic shared memory: the launch passes 2 * CC * CS * sizeof(Elem) bytes
  // (TileLayout.shared_bytes), which may exceed the 48 KB of static shared memory (tile_launch opts in). SE = 1:
  // then, from the next 16-byte boundary, two buffers of the warps' entry slots, WARPS * (MW / U) * entry_capacity
  // entries each (tile_shared_bytes on the Python side).
  extern __shared__ __align__(16) unsigned char tile_shared[];
  Elem (*tiles)[CC * CS] = reinterpret_cast<Elem (*)[CC * CS]>(tile_shared);
  using Entry = typename TileEntry<U>::type;
  constexpr int ENTRY_OFFSET = (2 * CC * CS * static_cast<int>(sizeof(Elem)) + 15) / 16 * 16;
  Entry* const entry_slots = reinterpret_cast<Entry*>(tile_shared + ENTRY_OFFSET);

  const int group = blockIdx.x % groups;
  const int tile_id = blockIdx.x / groups;
  const int e0 = (tile_id / tiles_f) * TE;
  const int f0 = (tile_id % tiles_f) * WX;
  const int n0 = blockIdx.y * NB;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int ly = lane / WX;
  const int lx = lane % WX;
  const int base = ly * IWP + LEFT + lx;
  const int m_base = group * (WARPS * MW) + warp * MW;
  const int K = (C + CC - 1) / CC;
  const long long image_size = static_cast<long long>(C) * H * W;  // elements of one image element
  const Elem* xe = reinterpret_cast<const Elem*>(x);
  const int NE = (N + IMAGES - 1) / IMAGES;  // image elements of the input
  const int ne0 = n0 / IMAGES;

  float acc[MW][NBE][PY][IMAGES];
#pragma unroll
  for (int j = 0; j < MW; ++j)
#pragma unroll
    for (int ie = 0; ie < NBE; ++ie)
#pragma unroll
      for (int py = 0; py < PY; ++py)
#pragma unroll
        for (int q = 0; q < IMAGES; ++q) acc[j][ie][py][q] = 0.f;
  __half2 run[NBE][PY];  // HALF_RUN > 0: the float16 partial sums of the current run (zero between runs)
#pragma unroll
  for (int ie = 0; ie < NBE; ++ie)
#pragma unroll
    for (int py = 0; py < PY; ++py) run[ie][py] = __float2half2_rn(0.f);

  // Stages chunk k into buffer b by asynchronous copies of one element or one 16-byte vector (zero-filled outside
  // the image, no registers held), so chunk k + 1 streams in while chunk k is computed.
  const int slots_per_buffer = WARPS * (MW / U) * entry_capacity;
  const auto warp_slots = [&](int b) { return entry_slots + b * slots_per_buffer + warp * (MW / U) * entry_capacity; };
  const auto stage = [&](int k, int b) {
    if constexpr (SE) stage_entries<MW, U>(chunk_ptr, entries, warp_slots(b), entry_capacity, m_base, M, K, k, lane);
    if constexpr (VEC) {
      // Rows (cc, ie, yy) as (row, column xx) copies: first WX / VE interior vectors per row, then the S - 1
      // halo columns (xx < pad_w or xx >= pad_w + WX); W % VE == 0 puts every vector wholly inside or
      // outside the image.
      constexpr int ROWS = CC * NBE * IH;
      const auto copy = [&](int row, int xx, bool vector) {
        const int iy = e0 + row % IH - pad_h;
        const int ix = f0 + xx - pad_w;
        const int n = ne0 + (row / IH) % NBE;
        const int c = k * CC + row / (IH * NBE);
        const bool live = c < C && n < NE && static_cast<unsigned>(iy) < static_cast<unsigned>(H) &&
                          static_cast<unsigned>(ix) < static_cast<unsigned>(W);
        Elem* dst = &tiles[b][row * IWP + LEFT + xx];
        const Elem* src = live ? xe + n * image_size + (c * H + iy) * W + ix : xe;
        if (vector) {
          stage_async<16>(dst, src, live);
        } else {
          stage_async<sizeof(Elem)>(dst, src, live);
        }
      };
#pragma unroll 1
      for (int idx = threadIdx.x; idx < ROWS * (WX / VE); idx += THREADS)
        copy(idx / (WX / VE), pad_w + VE * (idx % (WX / VE)), true);
#pragma unroll 1
      for (int idx = threadIdx.x; idx < ROWS * (IW - WX); idx += THREADS) {
        const int slot = idx % (IW - WX);
        copy(idx / (IW - WX), slot < pad_w ? slot : slot + WX, false);
      }
    } else {
#pragma unroll 1
      for (int idx = threadIdx.x; idx < STAGED; idx += THREADS) {
        const int xx = idx % IW;
        const int row = idx / IW;  // (cc * NBE + ie) * IH + yy
        const int yy = row % IH;
        const int ie = (row / IH) % NBE;
        const int c = k * CC + row / (IH * NBE);
        const int iy = e0 + yy - pad_h;
        const int ix = f0 + xx - pad_w;
        const bool inside = c < C && static_cast<unsigned>(iy) < static_cast<unsigned>(H) &&
                            static_cast<unsigned>(ix) < static_cast<unsigned>(W);
        const int within = inside ? (c * H + iy) * W + ix : 0;
        const int n = ne0 + ie;
        const bool live = inside && n < NE;
        stage_async<sizeof(Elem)>(&tiles[b][row * IWP + LEFT + xx], live ? xe + n * image_size + within : xe, live);
      }
    }
  };

  stage(0, 0);
  asm volatile("cp.async.commit_group;\n" ::);
  for (int k = 0; k < K; ++k) {
    const int b = k & 1;
    if (k + 1 < K) {
      stage(k + 1, b ^ 1);
      asm volatile("cp.async.commit_group;\n" ::);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();
    const Elem* tile = tiles[b];
    const void* list_data = SE ? static_cast<const void*>(warp_slots(b)) : entries;

    if constexpr (HALF_RUN == 0) {
      // Each staged element a lane loads feeds the U channels of the entry (U = 3: kernels/NOTES.md v21).
      for_each_entry<MW, U, ENTRY_UNROLL, 0, SE>(chunk_ptr, list_data, entry_capacity, m_base, M, K, k,
                                             [&](int g, int offset, const int (&bits)[U]) {
        const Elem* src = tile + offset + base;
#pragma unroll
        for (int ie = 0; ie < NBE; ++ie)
#pragma unroll
          for (int py = 0; py < PY; ++py) {
            float v[IMAGES];
            TileElem<T, IMAGES>::to_float(src[ie * PLANE + py * WY * IWP], v);
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
              for (int q = 0; q < IMAGES; ++q)
                acc[g * U + u][ie][py][q] = fmaf(__int_as_float(bits[u]), v[q], acc[g * U + u][ie][py][q]);
          }
      }, [](int) {});
    } else {
      // One HFMA2 per staged pair: weight (w, w) times (image 2i, image 2i + 1), summed in float16 over runs of at
      // most HALF_RUN entries, each run then added to the float32 accumulators (kernels/NOTES.md v17). Unrolled by
      // 2 below 3x3 filters: by 4, ptxas spilled the 2x2 (stride-2 phase) 16-warp tilings at 64 registers.
      for_each_entry<MW, 1, R * S >= 9 ? 4 : 2, HALF_RUN, SE>(chunk_ptr, list_data, entry_capacity, m_base, M, K,
                                                              k, [&](int, int offset, const int (&bits)[1]) {
        const __half2 w = *reinterpret_cast<const __half2*>(&bits[0]);
        const Elem* src = tile + offset + base;
#pragma unroll
        for (int ie = 0; ie < NBE; ++ie)
#pragma unroll
          for (int py = 0; py < PY; ++py) run[ie][py] = __hfma2(w, src[ie * PLANE + py * WY * IWP], run[ie][py]);
      }, [&](int j) {
#pragma unroll
        for (int ie = 0; ie < NBE; ++ie)
#pragma unroll
          for (int py = 0; py < PY; ++py) {
            const float2 f = __half22float2(run[ie][py]);
            acc[j][ie][py][0] += f.x;
            acc[j][ie][py][1] += f.y;
            run[ie][py] = __float2half2_rn(0.f);
          }
      });
    }
    __syncthreads();  // the buffer just read is staged again at iteration k + 1
  }

  // Epilogue: the thread's output rows and their bounds once; per (row, image) one 64-bit address; per output a bias
  // add, the ReLU where fused, a conversion and a predicated store (kernels/NOTES.md v18: the per-output index
  // arithmetic and bounds branches it replaces were about 530 instructions per warp). A wide tiling stores without
  // the residual and the ReLU: held to 128 registers, its epilogue's one extra compare per output made ptxas spill 44
  // bytes inside the chunk loop (the paired union 3x3 tiling, forty-fourth session); the Python side applies them in
  // passes after it (TileTiling.fuses_epilogue in launch_geometry.py). The half2 tilings (HALF_RUN > 0) store without
  // the residual: its loads made ptxas spill 4-16 bytes in those held to 64 registers (forty-sixth session).
  constexpr bool FUSES_EPILOGUE = MW * NB * PY <= TILE_WIDE_SUMS;
  const int fused_relu = FUSES_EPILOGUE ? relu : 0;
  const T* const fused_residual = FUSES_EPILOGUE && HALF_RUN == 0 ? residual : nullptr;
  const int f = f0 + lx;
  const long long plane = static_cast<long long>(E) * F;
  const int first = (e0 + ly) * F + f;  // the thread's first output in a plane; only stored where inside
  const int row_step = WY * F;
  unsigned rows_inside = 0;  // bit py: output (e0 + ly + py * WY, f) lies inside the plane
#pragma unroll
  for (int py = 0; py < PY; ++py) rows_inside |= static_cast<unsigned>(f < F && e0 + ly + py * WY < E) << py;
#pragma unroll
  for (int j = 0; j < MW; ++j) {
    const int m = m_base + j;
    if (m >= M) break;
    const float bias_m = bias != nullptr ? unsparse::load_float(bias + m) : 0.f;
#pragma unroll
    for (int ie = 0; ie < NBE; ++ie)
#pragma unroll
      for (int q = 0; q < IMAGES; ++q) {
        const int n = n0 + ie * IMAGES + q;
        if (n >= N) continue;
        const long long at = (static_cast<long long>(n) * M + m) * plane + first;
#pragma unroll
        for (int py = 0; py < PY; ++py)
          if (rows_inside >> py & 1u) {
            const long long index = at + py * row_step;
            unsparse::store_float(out + index,
                                  unsparse::epilogue(acc[j][ie][py][q], bias_m, fused_residual, index, fused_relu));
          }
      }
  }
}

// direct_pointwise: 1x1, stride 1, unpadded Conv2d (the ResNet bottleneck and GoogLeNet 1x1 layers) as a sparse
//   x dense product over the flattened columns j = n * P + p (P = H * W), so no column of a tile is wasted on a
//   plane edge (direct_tile's 32-wide warp rows cover a 14x14 plane at 44 %). A block owns WARPS * MW output
//   channels and TJ = 128 * PV consecutive columns; CC input channels x TJ columns are staged per chunk into two
//   buffers (chunk k + 1 loads while chunk k computes). Lane l owns columns 4 * l + 128 * v (v < PV): per
//   nonzero one broadcast load of (offset, weight) and, per v, one 16-byte (float) or 8-byte (half) shared load
//   feeding 4 FMAs. Each thread stages the same UNIT columns of every chunk, so the (n, p) split of its column
//   is worked out once per block.
//   VEC = 1 (P a multiple of the 16-byte unit, 16-byte aligned input; checked on the Python side): staging by
//   16-byte cp.async and vector stores of the outputs; VEC = 0: element-wise synchronous staging.
//   Split-K (small batches, where M x columns gives too few blocks to fill the GPU): block row blockIdx.y walks
//   chunks [blockIdx.y * chunks_per_split, + chunks_per_split) only and writes its partial sums (O = float) to
//   slice blockIdx.y of the output; the Python side sums the slices (and adds bias and residual and applies the ReLU
//   after: partial sums take none of them). One split: O = T, the whole K, the output.
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]);
template <>
__device__ __forceinline__ void load4<float>(const float* p, float (&v)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x;
  v[1] = q.y;
  v[2] = q.z;
  v[3] = q.w;
}
template <>
__device__ __forceinline__ void load4<__half>(const __half* p, float (&v)[4]) {
  const uint2 q = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&q.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&q.y));
  v[0] = a.x;
  v[1] = a.y;
  v[2] = b.x;
  v[3] = b.y;
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4]);
template <>
__device__ __forceinline__ void store4<float>(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <>
__device__ __forceinline__ void store4<__half>(__half* p, const float (&v)[4]) {
  const __half2 a = __floats2half2_rn(v[0], v[1]);
  const __half2 b = __floats2half2_rn(v[2], v[3]);
  *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<const unsigned*>(&a),
                                            *reinterpret_cast<const unsigned*>(&b));
}

template <typename T, int PV, int MW, int WARPS, int CC, int VEC, typename O>
__global__ void __launch_bounds__(WARPS * 32)
    direct_pointwise(const T* __restrict__ x,            // (N, C, P), P = H * W
                     const int* __restrict__ chunk_ptr,  // (M * K + 1,): entries of (m, k) are [m*K+k, m*K+k+1)
                     const int2* __restrict__ entries,   // (nnz,): ((c - k*CC) * TJ, float32 bits of the weight)
                     const T* __restrict__ bias,         // (M,) or nullptr
                     const T* __restrict__ residual,     // (N, M, P) or nullptr; VEC = 1: 16-byte aligned
                     O* __restrict__ out,                // (gridDim.y, N, M, P): one slice per split of K
                     int N, int C, int P, int M, int groups, int chunks_per_split,
                     int relu) {  // 0 for split-K partial sums
  constexpr int TJ = 128 * PV;
  constexpr int THREADS = WARPS * 32;
  constexpr int UNIT = VEC ? 16 / static_cast<int>(sizeof(T)) : 1;  // columns per staging copy
  constexpr int UPR = TJ / UNIT;                                      // copies per staged row
  static_assert(THREADS % UPR == 0, "every thread stages one fixed column unit");
  constexpr int ROW_STEP = THREADS / UPR;
  __shared__ __align__(16) T tiles[2][CC * TJ];

  const int group = blockIdx.x % groups;
  const int j0 = (blockIdx.x / groups) * TJ;
  const int J = N * P;  // < 2^31, checked on the Python side
  const long long image_size = static_cast<long long>(C) * P;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int m_base = group * (WARPS * MW) + warp * MW;
  const int K = (C + CC - 1) / CC;
  const int k_begin = blockIdx.y * chunks_per_split;  // this block's chunks of the K dimension (split-K)
  const int k_end = min(K, k_begin + chunks_per_split);
  out += static_cast<long long>(blockIdx.y) * N * M * P;

  const int unit = threadIdx.x % UPR;
  const int row0 = threadIdx.x / UPR;
  const int j_stage = j0 + unit * UNIT;
  const bool column_live = j_stage < J;
  const int n_stage = column_live ? j_stage / P : 0;
  const T* x_column = x + n_stage * image_size + (column_live ? j_stage - n_stage * P : 0);

  const auto stage = [&](int k, int b) {
#pragma unroll 1
    for (int row = row0; row < CC; row += ROW_STEP) {
      const int c = k * CC + row;
      const bool live = column_live && c < C;
      T* dst = &tiles[b][row * TJ + unit * UNIT];
      const T* src = live ? x_column + c * P : x;
      if constexpr (VEC) {
        stage_async<16>(dst, src, live);
      } else {
        *dst = live ? src[0] : T{};
      }
    }
  };

  float acc[MW][PV][4];
#pragma unroll
  for (int j = 0; j < MW; ++j)
#pragma unroll
    for (int v = 0; v < PV; ++v)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][v][i] = 0.f;

  stage(k_begin, 0);
  if constexpr (VEC) asm volatile("cp.async.commit_group;\n" ::);
  for (int k = k_begin; k < k_end; ++k) {
    const int b = (k - k_begin) & 1;
    if (k + 1 < k_end) stage(k + 1, b ^ 1);
    if constexpr (VEC) {
      if (k + 1 < k_end) {
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
      } else {
        asm volatile("cp.async.wait_group 0;\n" ::);
      }
    }
    __syncthreads();
    const T* lane_tile = tiles[b] + 4 * lane;

    const auto apply = [&](int j, int offset, const int (&bits)[1]) {
      const float w = __int_as_float(bits[0]);
#pragma unroll
      for (int v = 0; v < PV; ++v) {
        float f[4];
        load4(lane_tile + offset + 128 * v, f);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][v][i] = fmaf(w, f[i], acc[j][v][i]);
      }
    };
    for_each_entry<MW, 1, 2, 0, false>(chunk_ptr, entries, 0, m_base, M, K, k, apply, [](int) {});
    __syncthreads();  // buffer b is staged again at iteration k + 1
  }

#pragma unroll
  for (int v = 0; v < PV; ++v) {
    const int j = j0 + 128 * v + 4 * lane;
    if (j >= J) continue;
    long long at[4];  // index of column j + i in output channel 0, (n * M) * P + p; -1 past the last column
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = (j + i) / P;
      at[i] = j + i < J ? static_cast<long long>(n) * M * P + (j + i - n * P) : -1;
    }
#pragma unroll
    for (int jj = 0; jj < MW; ++jj) {
      const int m = m_base + jj;
      if (m >= M) break;
      const float bias_m = bias != nullptr ? unsparse::load_float(bias + m) : 0.f;
      const long long channel = static_cast<long long>(m) * P;
      if constexpr (VEC) {  // the 4 columns lie in one plane (P % 4 == 0): one vector of the residual and the output
        const long long index = at[0] + channel;
        float identity[4] = {0.f, 0.f, 0.f, 0.f}, r[4];
        if (residual != nullptr) load4(residual + index, identity);
#pragma unroll
        for (int i = 0; i < 4; ++i) r[i] = unsparse::epilogue(acc[jj][v][i], bias_m, identity[i], relu);
        store4(out + index, r);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (at[i] >= 0)
            unsparse::store_float(out + at[i] + channel,
                                  unsparse::epilogue(acc[jj][v][i], bias_m, residual, at[i] + channel, relu));
      }
    }
  }
}

// pad_planes: the zero-padded float32 copy of the phase images of P planes of T, (P, H, W) to
// (P * PH * PW, HQ + 2 pad_h, WQ + 2 pad_w): the input of the generated kernels (unsparse/runtime/backends/generated.py,
// P = N * C). Output plane (p * PH + a) * PW + b holds rows SH * q + FH + a and columns SW * u + FW + b of plane p at
// (q, u), zero beyond the input (unsparse/sparse/phases.py, PhaseSplit.input: phases FH + a and FW + b, one run per
// axis); a stride-1 layer has SH = SW = PH = PW = 1, FH = FW = 0, HQ = H, WQ = W, the plain padded copy. One pass:
// each padded element is written once and each input element read once (8 bytes per float32 element, 6 per float16),
// where F.pad fills its whole output and then copies the input into it (12 bytes per float32 element: 1.595 ms of
// VGG16 features.2's 3.0 ms at 0.98, batch 128, on the H200; kernels/NOTES.md, thirty-fifth session), and a strided
// layer's phase split first copied its input once more (kernels/NOTES.md, fifty-fifth session). Each warp writes ROWS
// consecutive padded rows of the P * PH * PW * HP (fewer than 2**31, checked on the Python side), its lanes along the
// row's WP columns (coalesced stores; the loads of a phase plane step by SW, the other column phases' planes read the
// rest of those sectors), loading the ROWS rows' elements of a 32-column step before storing them (ROWS loads in
// flight per lane). Grid ceil(P * PH * PW * HP / (ROWS * warps per block)): a block per padded row of each plane (HP
// blocks of one warp row each) spent more time being scheduled than moving bytes (kernels/NOTES.md, thirty-sixth
// session).
template <typename T, int ROWS>
__global__ void pad_planes(const T* __restrict__ x, float* __restrict__ out, int planes, int H, int W, int pad_h,
                           int pad_w, int SH, int SW, int FH, int FW, int PH, int PW, int HQ, int WQ) {
  const unsigned HP = HQ + 2 * pad_h;
  const int WP = WQ + 2 * pad_w;
  const unsigned phases = static_cast<unsigned>(PH) * PW;
  const unsigned rows = static_cast<unsigned>(planes) * phases * HP;
  const unsigned first = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * ROWS;
  const int lane = threadIdx.x % 32;
  long long source[ROWS];  // each row's element of phase column 0, or -1 for a border row (and a row past the end)
  long long first_column[ROWS];  // each row's column phase FW + b
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const unsigned row = first + r;
    const unsigned out_plane = row / HP;
    const unsigned plane = out_plane / phases;
    const unsigned phase = out_plane - plane * phases;
    const int q = static_cast<int>(row - out_plane * HP) - pad_h;
    const long long y = static_cast<long long>(SH) * q + FH + static_cast<int>(phase / PW);
    first_column[r] = static_cast<long long>(FW) + phase % PW;
    source[r] = row < rows && static_cast<unsigned>(q) < static_cast<unsigned>(HQ) && y < H
                    ? (static_cast<long long>(plane) * H + y) * W + first_column[r]
                    : -1;
  }
  for (int step = 0; step < WP; step += 32) {
    const int xx = step + lane;
    const int u = xx - pad_w;
    const bool inside_column = xx < WP && static_cast<unsigned>(u) < static_cast<unsigned>(WQ);
    const long long offset = static_cast<long long>(SW) * u;
    float value[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      value[r] = inside_column && source[r] >= 0 && offset + first_column[r] < W
                     ? unsparse::load_float(x + source[r] + offset)
                     : 0.f;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (xx < WP && first + r < rows) out[static_cast<long long>(first + r) * WP + xx] = value[r];
  }
}

// pair_images: the image-paired input of direct_tile's float16 and paired float32 settings, out[i][p][q] =
//   x[2i + q][p] for the P = C * H * W elements p of each image (a zero image past an odd N): (N, P) to
//   (ceil(N/2), P, 2). torch's permuted copy ran at 2.33-2.38 TB/s on float32 and 1.46-1.50 TB/s on float16 on the
//   H100 against 2.5-3.0 TB/s for a plain copy (kernels/NOTES.md, eleventh session); here each thread reads one
//   16-byte vector of both images and writes their interleaved 32 bytes. Grid
//   (ceil(P / (UNIT * blockDim.x)), ceil(N/2)), UNIT = 16 / sizeof(T) elements per thread. VEC = 1 needs
//   P % UNIT == 0 and a 16-byte aligned x (checked on the Python side); VEC = 0 copies element by element.
template <typename T, int VEC>
__global__ void pair_images(const T* __restrict__ x, T* __restrict__ out, int N, int P) {
  constexpr int UNIT = 16 / sizeof(T);
  const int i = blockIdx.y;
  const long long p = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * UNIT;
  if (p >= P) return;
  const T* first = x + static_cast<long long>(2 * i) * P;
  const bool second_live = 2 * i + 1 < N;
  T* dst = out + (static_cast<long long>(i) * P + p) * 2;
  if constexpr (VEC) {
    const uint4 a = *reinterpret_cast<const uint4*>(first + p);
    const uint4 b = second_live ? *reinterpret_cast<const uint4*>(first + P + p) : make_uint4(0, 0, 0, 0);
    uint4 lo, hi;
    if constexpr (sizeof(T) == 4) {  // words a.x b.x a.y b.y | a.z b.z a.w b.w
      lo = make_uint4(a.x, b.x, a.y, b.y);
      hi = make_uint4(a.z, b.z, a.w, b.w);
    } else {  // halves: each word of the output holds half k of a (low) and half k of b (high)
      lo = make_uint4(__byte_perm(a.x, b.x, 0x5410), __byte_perm(a.x, b.x, 0x7632), __byte_perm(a.y, b.y, 0x5410),
                      __byte_perm(a.y, b.y, 0x7632));
      hi = make_uint4(__byte_perm(a.z, b.z, 0x5410), __byte_perm(a.z, b.z, 0x7632), __byte_perm(a.w, b.w, 0x5410),
                      __byte_perm(a.w, b.w, 0x7632));
    }
    reinterpret_cast<uint4*>(dst)[0] = lo;
    reinterpret_cast<uint4*>(dst)[1] = hi;
  } else {
    for (int u = 0; u < UNIT && p + u < P; ++u) {
      dst[2 * u] = first[p + u];
      dst[2 * u + 1] = second_live ? first[P + p + u] : T(0.f);
    }
  }
}

// phase_pair_images: the phase split (unsparse/sparse/phases.py, every phase of both axes) and the image pairing of
//   a strided layer's paired direct_tile setting in one pass: out[i][(c * SH + a) * SW + b][q][u][k] =
//   x[2i + k][c][SH * q + a][SW * u + b], zero past the image's H x W and past an odd N; (N, C, H, W) to
//   (ceil(N/2), C * SH * SW, HQ, WQ, 2) with HQ = ceil(H / SH), WQ = ceil(W / SW). The two-pass path (a torch copy into
//   the phases, then pair_images) reads and writes the input twice. One thread per (c, t, u) of one image pair's input
//   padded to HQ * SH rows: it reads input columns SW * u .. SW * u + SW - 1 of row t of both images and writes one
//   pair to each of the SW phase planes of row t's phase, at column u, so a warp's stores to a plane are 32
//   consecutive pairs (kernels/NOTES.md v24b; v24 ran one thread per input element, whose stores to a plane came in
//   runs of 32 / SW pairs). Grid (ceil(C * HQ * SH * WQ / blockDim.x), ceil(N/2)); the Python side checks that
//   C * HQ * SH * WQ * SW fits int32.
template <typename T>
__global__ void phase_pair_images(const T* __restrict__ x, T* __restrict__ out, int N, int C, int H, int W, int SH,
                                  int SW, int HQ, int WQ) {
  struct alignas(2 * sizeof(T)) Pair {
    T first, second;
  };
  const int i = blockIdx.y;
  const int rows = HQ * SH;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= C * rows * WQ) return;
  const int u = e % WQ;
  const int t = (e / WQ) % rows;
  const int c = e / (WQ * rows);
  const long long plane = static_cast<long long>(H) * W;
  const long long image = plane * C;
  const T* row = x + 2LL * i * image + c * plane + static_cast<long long>(t) * W;
  const bool second_live = 2 * i + 1 < N;
  const long long phase_plane = static_cast<long long>(HQ) * WQ;
  // pair index of phase (c * SH + t % SH) * SW + 0, row t / SH, column u; phase b is b planes further
  Pair* target = reinterpret_cast<Pair*>(out) +
                 ((static_cast<long long>(i) * C * SH + c * SH + t % SH) * SW * HQ + t / SH) * WQ + u;
  for (int b = 0; b < SW; ++b) {
    const int w = SW * u + b;
    const bool inside = t < H && w < W;
    const T first = inside ? row[w] : T(0.f);
    const T second = inside && second_live ? row[image + w] : T(0.f);
    target[b * phase_plane] = Pair{first, second};
  }
}
