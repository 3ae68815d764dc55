// seam's one-row products (decode's `y = W x`) for NVIDIA GPUs, launched by XLA custom calls
// (crates/backend-pjrt/src/gpu_products.rs). A one-row product reads every weight once and does
// two flops per weight: the kernels are written to keep the memory busy, not the arithmetic units.
//
// A launch computes the products of up to three matrices of one format over the same input (a
// layer's q, k and v; its gate and up), each into its own output: one launch instead of three
// (a decode step is hundreds of small launches), and more blocks for the small matrices. The
// input may come un-normalized with an RMSNorm weight: the kernel then multiplies by x * g and
// scales each sum by 1 / sqrt(mean(x^2) + eps) at the end, the mean summed from the same loads of
// x, so that the norm costs no launch and no pass of its own. A matrix may come with a residual
// (f32 [rows]) that its output rows are added to as they are written (a layer's o and down: the
// residual stream's adds cost no launch either).
//
// Layout of the work: a block of THREADS threads computes ROWS consecutive output rows of one
// matrix. A row's inputs are split into chunks of 8 (16 bytes of f16, 8 of int8, 4 of int4); the
// block's threads take the chunks in turn (thread t chunks t, t + THREADS, ...), so that
// neighbouring threads read neighbouring bytes, and each thread reads its 8 activations once for
// all ROWS rows. The block then sums its threads' partial sums: within each warp by shuffles,
// across warps through shared memory. Many small blocks rather than few large ones: a 512-row
// matrix still occupies every multiprocessor of a large GPU.
//
// ROWS and THREADS (the tiling) trade bytes in flight per thread against blocks per matrix, and
// the best pair differs by format, matrix shape and GPU; so every format is compiled for each
// tiling of SEAM_TILINGS, as its own entry point (`seam_rows_<format>_r<ROWS>t<THREADS>`), and
// the probe times them all on the GPU at hand.
//
// The same file compiles as C++ on a host (SEAM_HOST_EMULATION), where a test runs
// `thread_sums` for every thread of every block, sums the threads' shares as the block does and
// checks the result against the formats' definitions: the indexing, the dequantization, the
// matrices' blocks and the norm are tested without a GPU, the shuffles and shared memory by
// reading.
//
// Formats (crates/stablehlo-llama, `weight_args`): x is f32 [k]; y is f32 [rows].
//   f16:  w  f16 [rows, k] row-major.
//   int8: q  s8  [rows, k], scales f16 [rows, k / 32]: w = s q.
//   int4: packed u8 [rows, k / 2], byte i of a group of 32 holds input 2i in its low nibble and
//         2i + 1 in its high one; scales and biases f16 [rows, k / 32]: w = s q + b.

#define SEAM_GROUP 32
#define SEAM_MAX_MATRICES 3

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

// A chunk's 8 activations, and their sum (which int4's biases multiply).
struct seam_x8 {
  float v[8];
  float sum;
};

// The float whose bits are `bits`.
SEAM_FN float seam_bits_to_float(unsigned int bits) {
#ifdef SEAM_HOST_EMULATION
  float f;
  memcpy(&f, &bits, 4);
  return f;
#else
  return __uint_as_float(bits);
#endif
}

// An integer code c in [0, 2^23) as a float: its bits under the exponent of 2^23 make the float
// 2^23 + c exactly, and subtracting 2^23 + offset leaves c - offset exactly. Two full-rate
// operations where a conversion instruction runs at a fraction of their rate, for every weight.
#define SEAM_CODE_BITS 0x4B000000u
#define SEAM_CODE_BASE 8388608.0f

// The matrices of one launch (crates/cuda-kernels/src/lib.rs `ProductsParam`, the same layout):
// their arrays in the format's order (f16: w; int8: q, scales; int4: packed, scales, biases),
// outputs, residuals (null for none) and rows; matrix j's blocks start at block first_block[j], in
// order.
struct seam_products {
  const void* arrays[SEAM_MAX_MATRICES][3];
  float* y[SEAM_MAX_MATRICES];
  const float* residual[SEAM_MAX_MATRICES];
  int rows[SEAM_MAX_MATRICES];
  int first_block[SEAM_MAX_MATRICES];
  int count;
};

// One matrix of a launch, picked out of the parameters.
struct seam_matrix {
  const void* arrays[3];
  float* y;
  const float* residual;
  int rows, first_block;
};

// Matrix j of `set`. Constant indices only: a parameter indexed by a variable would be copied to
// the stack by every thread first.
SEAM_FN seam_matrix matrix_of(const seam_products& set, int j) {
  seam_matrix m;
  for (int a = 0; a < 3; a++) m.arrays[a] = j == 0 ? set.arrays[0][a] : j == 1 ? set.arrays[1][a] : set.arrays[2][a];
  m.y = j == 0 ? set.y[0] : j == 1 ? set.y[1] : set.y[2];
  m.residual = j == 0 ? set.residual[0] : j == 1 ? set.residual[1] : set.residual[2];
  m.rows = j == 0 ? set.rows[0] : j == 1 ? set.rows[1] : set.rows[2];
  m.first_block = j == 0 ? set.first_block[0] : j == 1 ? set.first_block[1] : set.first_block[2];
  return m;
}

// The matrix block `block` of a launch computes rows of.
SEAM_FN int block_matrix(const seam_products& set, int block) {
  return (set.count > 1 && block >= set.first_block[1]) + (set.count > 2 && block >= set.first_block[2]);
}

// What an RMSNorm makes of a sum over x * g: the sum over the normalized input.
SEAM_FN float rms_normalized(float sum, float squares, int k, float eps) {
  return sum / sqrtf(squares / (float)k + eps);
}

// Output row `row` of a matrix from its block's sum (and sum of squares): normalized where the
// launch has a norm, added to the matrix's residual where it has one.
SEAM_FN float row_output(const seam_matrix& m, int row, float sum, float squares, bool normed, int k, float eps) {
  const float product = normed ? rms_normalized(sum, squares, k, eps) : sum;
  return m.residual ? m.residual[row] + product : product;
}

// The 8 activations of chunk `c`.
SEAM_FN seam_x8 load_x8(const float* SEAM_RESTRICT x, int c) {
  seam_x8 r;
  r.sum = 0.0f;
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
  static SEAM_METHOD seam_f16_rows of(const seam_matrix& m, int k) {
    return seam_f16_rows{static_cast<const seam_half*>(m.arrays[0]), k};
  }
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
  static SEAM_METHOD seam_int8_rows of(const seam_matrix& m, int k) {
    return seam_int8_rows{static_cast<const signed char*>(m.arrays[0]), static_cast<const seam_half*>(m.arrays[1]),
                          k};
  }
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
    // Each code's sign bit flipped makes it q + 128 in [0, 256).
    const unsigned int words[2] = {r.words[0] ^ 0x80808080u, r.words[1] ^ 0x80808080u};
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) {
      const unsigned int biased = (words[i / 4] >> (8 * (i % 4))) & 0xffu;
      sum += (seam_bits_to_float(biased | SEAM_CODE_BITS) - (SEAM_CODE_BASE + 128.0f)) * x.v[i];
    }
    return seam_half_to_float(r.scale) * sum;
  }
};

struct seam_int4_rows {
  const unsigned char* packed;
  const seam_half* scales;
  const seam_half* biases;
  int k;
  static SEAM_METHOD seam_int4_rows of(const seam_matrix& m, int k) {
    return seam_int4_rows{static_cast<const unsigned char*>(m.arrays[0]), static_cast<const seam_half*>(m.arrays[1]),
                          static_cast<const seam_half*>(m.arrays[2]), k};
  }
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
    float codes = 0.0f;
    for (int n = 0; n < 8; n++) {
      const unsigned int code = (r.word >> (4 * n)) & 15u;
      codes += (seam_bits_to_float(code | SEAM_CODE_BITS) - SEAM_CODE_BASE) * x.v[n];
    }
    return seam_half_to_float(r.scale) * codes + seam_half_to_float(r.bias) * x.sum;
  }
};

// Thread `t`'s partial sums of the block's rows `row0..row0 + ROWS` (rows at or past `rows` left
// at zero: their loads read the last row instead, and are dropped), and in acc[ROWS] its part of
// the sum of x's squares. With a norm weight the sums are over x * norm (the normalization's
// scale comes after the block's sum, `rms_normalized`).
template <int ROWS, int THREADS, class M>
SEAM_FN void thread_sums(const M& m, const float* SEAM_RESTRICT x, const float* SEAM_RESTRICT norm, int row0,
                         int rows, int k, int t, float acc[ROWS + 1]) {
  for (int r = 0; r <= ROWS; r++) acc[r] = 0.0f;
  const int chunks = k / 8;
  for (int c = t; c < chunks; c += THREADS) {
    typename M::raw raw[ROWS];
    SEAM_UNROLL
    for (int r = 0; r < ROWS; r++) raw[r] = m.load(row0 + r < rows ? row0 + r : rows - 1, c);
    seam_x8 xc = load_x8(x, c);
    if (norm) {
      const seam_x8 g = load_x8(norm, c);
      for (int i = 0; i < 8; i++) {
        acc[ROWS] += xc.v[i] * xc.v[i];
        xc.v[i] *= g.v[i];
      }
    }
    // Once for all the rows (unused, and so not computed, where the format has no biases).
    xc.sum = 0.0f;
    for (int i = 0; i < 8; i++) xc.sum += xc.v[i];
    SEAM_UNROLL
    for (int r = 0; r < ROWS; r++) {
      if (row0 + r < rows) acc[r] += m.dot(raw[r], xc);
    }
  }
}

#ifndef SEAM_HOST_EMULATION
// The block's sums of its threads' partial sums (and of the squares), written to m's output.
template <int ROWS, int THREADS>
SEAM_FN void block_sums(float acc[ROWS + 1], const seam_matrix& m, int row0, bool normed, int k, float eps) {
  __shared__ float warp_sums[THREADS / 32][ROWS + 1];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  SEAM_UNROLL
  for (int r = 0; r <= ROWS; r++) {
    float v = acc[r];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x < ROWS && row0 + threadIdx.x < m.rows) {
    float v = 0.0f, squares = 0.0f;
    for (int w = 0; w < THREADS / 32; w++) {
      v += warp_sums[w][threadIdx.x];
      squares += warp_sums[w][ROWS];
    }
    const int row = row0 + threadIdx.x;
    m.y[row] = row_output(m, row, v, squares, normed, k, eps);
  }
}

template <int ROWS, int THREADS, class M>
SEAM_FN void rows_kernel(const seam_products& set, const float* SEAM_RESTRICT x, const float* SEAM_RESTRICT norm,
                         const float* SEAM_RESTRICT eps, int k) {
  const seam_matrix m = matrix_of(set, block_matrix(set, blockIdx.x));
  const int row0 = (blockIdx.x - m.first_block) * ROWS;
  float acc[ROWS + 1];
  thread_sums<ROWS, THREADS>(M::of(m, k), x, norm, row0, m.rows, k, threadIdx.x, acc);
  block_sums<ROWS, THREADS>(acc, m, row0, norm != nullptr, k, norm ? *eps : 0.0f);
}

// The entry points, per format and tiling: launched with the matrices' blocks (ceil(rows / ROWS)
// each) of THREADS threads; k a multiple of 32, every array but eps and the residuals 16-byte
// aligned; `norm` (f32 [k]) and `eps` (f32 [1]) both null, or an RMSNorm to apply to x first.
#define SEAM_ENTRY(FORMAT, R, T)                                                                      \
  extern "C" __global__ void __launch_bounds__(T)                                                     \
      seam_rows_##FORMAT##_r##R##t##T(const float* __restrict__ x, const float* __restrict__ norm,    \
                                      const float* __restrict__ eps, seam_products set, int k) {      \
    rows_kernel<R, T, seam_##FORMAT##_rows>(set, x, norm, eps, k);                                    \
  }
#define SEAM_ENTRIES(R, T) SEAM_ENTRY(f16, R, T) SEAM_ENTRY(int8, R, T) SEAM_ENTRY(int4, R, T)

SEAM_TILINGS(SEAM_ENTRIES)
#endif
