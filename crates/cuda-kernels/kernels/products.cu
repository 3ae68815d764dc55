// seam's one-row products (decode's `y = W x`) for NVIDIA GPUs, launched by XLA custom calls
// (crates/backend-pjrt/src/gpu_products.rs). A one-row product reads every weight once and does
// two flops per weight: the kernels are written to keep the memory busy, not the arithmetic units.
//
// Layout of the work: a block of THREADS threads computes ROWS consecutive output rows. A row's
// inputs are split into chunks of 8 (16 bytes of f16, 8 of int8, 4 of int4); the block's threads
// take the chunks in turn (thread t chunks t, t + THREADS, ...), so that neighbouring threads
// read neighbouring bytes, and each thread reads its 8 activations once for all ROWS rows. The
// block then sums its threads' partial sums: within each warp by shuffles, across warps through
// shared memory. Many small blocks rather than few large ones: a 512-row matrix still occupies
// every multiprocessor of a large GPU.
//
// ROWS and THREADS (the tiling) trade bytes in flight per thread against blocks per matrix, and
// the best pair differs by format, matrix shape and GPU; so every format is compiled for each
// tiling of SEAM_TILINGS, as its own entry point (`seam_rows_<format>_r<ROWS>t<THREADS>`), and
// the probe times them all on the GPU at hand.
//
// The same file compiles as C++ on a host (SEAM_HOST_EMULATION), where a test runs
// `thread_sums` for every thread of every block and checks the result against the formats'
// definitions: the indexing and the dequantization are tested without a GPU, the reductions by
// reading.
//
// Formats (crates/stablehlo-llama, `weight_args`): x is f32 [k]; y is f32 [rows].
//   f16:  w  f16 [rows, k] row-major.
//   int8: q  s8  [rows, k], scales f16 [rows, k / 32]: w = s q.
//   int4: packed u8 [rows, k / 2], byte i of a group of 32 holds input 2i in its low nibble and
//         2i + 1 in its high one; scales and biases f16 [rows, k / 32]: w = s q + b.

#define SEAM_GROUP 32

// The tilings compiled (ROWS, THREADS); crates/cuda-kernels/src/lib.rs lists the same set.
#define SEAM_TILINGS(X) \
  X(1, 64) X(1, 128) X(1, 256) X(2, 64) X(2, 128) X(2, 256) X(4, 64) X(4, 128) X(4, 256) X(8, 64) X(8, 128) X(8, 256)

#ifdef SEAM_HOST_EMULATION
#define SEAM_FN static inline
#define SEAM_METHOD inline
#define SEAM_RESTRICT
#define SEAM_UNROLL
#else
#define SEAM_FN static __device__ __forceinline__
#define SEAM_METHOD __device__ __forceinline__
#define SEAM_RESTRICT __restrict__
#define SEAM_UNROLL _Pragma("unroll")
#endif

typedef unsigned short seam_half;

#ifdef SEAM_HOST_EMULATION
float seam_half_to_float(seam_half h);  // the harness's
#else
SEAM_FN float seam_half_to_float(seam_half h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
#endif

struct seam_x8 {
  float v[8];
};

// The 8 activations of chunk `c`.
SEAM_FN seam_x8 load_x8(const float* SEAM_RESTRICT x, int c) {
  seam_x8 r;
#ifdef SEAM_HOST_EMULATION
  for (int i = 0; i < 8; i++) r.v[i] = x[8 * c + i];
#else
  const float4 a = __ldg(reinterpret_cast<const float4*>(x) + 2 * c);
  const float4 b = __ldg(reinterpret_cast<const float4*>(x) + 2 * c + 1);
  r.v[0] = a.x, r.v[1] = a.y, r.v[2] = a.z, r.v[3] = a.w;
  r.v[4] = b.x, r.v[5] = b.y, r.v[6] = b.z, r.v[7] = b.w;
#endif
  return r;
}

// Reads that stream through once: not kept in L1 (the activations are what is worth caching).
// Not volatile: the compiler may issue them early, which is the point of loading every row's
// weights before using any.
SEAM_FN unsigned int load_word(const unsigned int* p) {
#ifdef SEAM_HOST_EMULATION
  return *p;
#else
  unsigned int v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
#endif
}

SEAM_FN void load_words2(const unsigned int* p, unsigned int out[2]) {
#ifdef SEAM_HOST_EMULATION
  out[0] = p[0], out[1] = p[1];
#else
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(out[0]), "=r"(out[1]) : "l"(p));
#endif
}

SEAM_FN void load_words4(const unsigned int* p, unsigned int out[4]) {
#ifdef SEAM_HOST_EMULATION
  out[0] = p[0], out[1] = p[1], out[2] = p[2], out[3] = p[3];
#else
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
      : "l"(p));
#endif
}

SEAM_FN seam_half load_half(const seam_half* p) {
#ifdef SEAM_HOST_EMULATION
  return *p;
#else
  return __ldg(p);
#endif
}

// Each format in two steps: `load` reads chunk `c` of row `row` (its weights and group values),
// `dot` multiplies what was read by the chunk's activations. A thread loads its chunk of every
// row of the block before it multiplies any, so that its loads are in flight together.
struct seam_f16_rows {
  const seam_half* w;
  int k;
  struct raw {
    unsigned int words[4];
  };
  SEAM_METHOD raw load(int row, int c) const {
    raw r;
    load_words4(reinterpret_cast<const unsigned int*>(w + (long long)row * k + 8 * c), r.words);
    return r;
  }
  SEAM_METHOD float dot(const raw& r, const seam_x8& x) const {
    float sum = 0.0f;
    for (int i = 0; i < 4; i++) {
      sum += seam_half_to_float((seam_half)(r.words[i] & 0xffffu)) * x.v[2 * i];
      sum += seam_half_to_float((seam_half)(r.words[i] >> 16)) * x.v[2 * i + 1];
    }
    return sum;
  }
};

struct seam_int8_rows {
  const signed char* q;
  const seam_half* scales;
  int k;
  struct raw {
    unsigned int words[2];
    seam_half scale;
  };
  SEAM_METHOD raw load(int row, int c) const {
    raw r;
    load_words2(reinterpret_cast<const unsigned int*>(q + (long long)row * k + 8 * c), r.words);
    r.scale = load_half(scales + (long long)row * (k / SEAM_GROUP) + c / 4);
    return r;
  }
  SEAM_METHOD float dot(const raw& r, const seam_x8& x) const {
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) {
      const int byte = (int)((r.words[i / 4] >> (8 * (i % 4))) & 0xffu);
      sum += (float)(signed char)byte * x.v[i];
    }
    return seam_half_to_float(r.scale) * sum;
  }
};

struct seam_int4_rows {
  const unsigned char* packed;
  const seam_half* scales;
  const seam_half* biases;
  int k;
  struct raw {
    unsigned int word;
    seam_half scale, bias;
  };
  SEAM_METHOD raw load(int row, int c) const {
    // Chunk c is bytes 4c..4c+4 of the row: as a little-endian word, nibble n is input 8c + n.
    raw r;
    r.word = load_word(reinterpret_cast<const unsigned int*>(packed + (long long)row * (k / 2) + 4 * c));
    const long long g = (long long)row * (k / SEAM_GROUP) + c / 4;
    r.scale = load_half(scales + g);
    r.bias = load_half(biases + g);
    return r;
  }
  SEAM_METHOD float dot(const raw& r, const seam_x8& x) const {
    float codes = 0.0f, inputs = 0.0f;
    for (int n = 0; n < 8; n++) {
      codes += (float)((r.word >> (4 * n)) & 15u) * x.v[n];
      inputs += x.v[n];
    }
    return seam_half_to_float(r.scale) * codes + seam_half_to_float(r.bias) * inputs;
  }
};

// Thread `t`'s partial sums of the block's rows `row0..row0 + ROWS` (rows at or past `rows` left
// at zero: their loads read the last row instead, and are dropped).
template <int ROWS, int THREADS, class M>
SEAM_FN void thread_sums(const M& m, const float* SEAM_RESTRICT x, int row0, int rows, int k, int t,
                         float acc[ROWS]) {
  for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
  const int chunks = k / 8;
  for (int c = t; c < chunks; c += THREADS) {
    typename M::raw raw[ROWS];
    SEAM_UNROLL
    for (int r = 0; r < ROWS; r++) raw[r] = m.load(row0 + r < rows ? row0 + r : rows - 1, c);
    const seam_x8 xc = load_x8(x, c);
    SEAM_UNROLL
    for (int r = 0; r < ROWS; r++) {
      if (row0 + r < rows) acc[r] += m.dot(raw[r], xc);
    }
  }
}

#ifndef SEAM_HOST_EMULATION
// The block's sums of its threads' partial sums, written to y.
template <int ROWS, int THREADS>
SEAM_FN void block_sums(float acc[ROWS], float* SEAM_RESTRICT y, int row0, int rows) {
  __shared__ float warp_sums[THREADS / 32][ROWS];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  SEAM_UNROLL
  for (int r = 0; r < ROWS; r++) {
    float v = acc[r];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x < ROWS && row0 + threadIdx.x < rows) {
    float v = 0.0f;
    for (int w = 0; w < THREADS / 32; w++) v += warp_sums[w][threadIdx.x];
    y[row0 + threadIdx.x] = v;
  }
}

template <int ROWS, int THREADS, class M>
SEAM_FN void rows_kernel(const M& m, const float* SEAM_RESTRICT x, float* SEAM_RESTRICT y, int rows, int k) {
  const int row0 = blockIdx.x * ROWS;
  float acc[ROWS];
  thread_sums<ROWS, THREADS>(m, x, row0, rows, k, threadIdx.x, acc);
  block_sums<ROWS, THREADS>(acc, y, row0, rows);
}

// The entry points, per tiling: launched with ceil(rows / ROWS) blocks of THREADS threads; k a
// multiple of 32, every array 16-byte aligned.
#define SEAM_ENTRIES(R, T)                                                                                      \
  extern "C" __global__ void __launch_bounds__(T)                                                               \
      seam_rows_f16_r##R##t##T(const float* __restrict__ x, const seam_half* __restrict__ w,                    \
                               float* __restrict__ y, int rows, int k) {                                        \
    rows_kernel<R, T>(seam_f16_rows{w, k}, x, y, rows, k);                                                      \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(T)                                                               \
      seam_rows_int8_r##R##t##T(const float* __restrict__ x, const signed char* __restrict__ q,                 \
                                const seam_half* __restrict__ scales, float* __restrict__ y, int rows, int k) { \
    rows_kernel<R, T>(seam_int8_rows{q, scales, k}, x, y, rows, k);                                             \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(T)                                                               \
      seam_rows_int4_r##R##t##T(const float* __restrict__ x, const unsigned char* __restrict__ packed,          \
                                const seam_half* __restrict__ scales, const seam_half* __restrict__ biases,     \
                                float* __restrict__ y, int rows, int k) {                                       \
    rows_kernel<R, T>(seam_int4_rows{packed, scales, biases, k}, x, y, rows, k);                                \
  }

SEAM_TILINGS(SEAM_ENTRIES)
#endif
