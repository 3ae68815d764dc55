// Runs the per-thread part of kernels/products.cu on the host for every thread of every block,
// sums the threads' partial sums (what the kernels' warp and block reductions do), and checks
// each format's rows against the format's definition, computed input by input: one matrix with
// its input as it is and a residual added, and three matrices of different heights in one launch
// with an RMSNorm applied to the input (the second with a residual), in every tiling. Prints one line per case; exits 1 when a case is off by
// more than float rounding.
#define SEAM_HOST_EMULATION
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

float seam_half_to_float(unsigned short h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31;
  const int exponent = (h >> 10) & 31;
  const uint32_t mantissa = h & 1023;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp((float)mantissa, -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp((float)(mantissa | 1024), exponent - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

#include "../kernels/products.cu"

static uint64_t state = 0x9e3779b97f4a7c15ull;
static uint32_t next() {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(state >> 33);
}
// A half with a value in about [-2, 2): sign, exponent 12..15, random mantissa.
static unsigned short random_half() {
  return (unsigned short)(((next() & 1) << 15) | ((12 + next() % 4) << 10) | (next() % 1024));
}

// A launch of `set` emulated: every block's threads, their shares summed as the block sums them.
template <int ROWS, int THREADS, class M>
static void run(const seam_products& set, const float* x, const float* norm, float eps, int k) {
  const int last = set.count - 1;
  const int blocks = set.first_block[last] + (set.rows[last] + ROWS - 1) / ROWS;
  for (int b = 0; b < blocks; b++) {
    const seam_matrix m = matrix_of(set, block_matrix(set, b));
    const int row0 = (b - m.first_block) * ROWS;
    float sums[ROWS + 1] = {0};
    for (int t = 0; t < THREADS; t++) {
      float acc[ROWS + 1];
      thread_sums<ROWS, THREADS>(M::of(m, k), x, norm, row0, m.rows, k, t, acc);
      for (int r = 0; r <= ROWS; r++) sums[r] += acc[r];
    }
    for (int r = 0; r < ROWS && row0 + r < m.rows; r++) {
      m.y[row0 + r] = row_output(m, row0 + r, sums[r], sums[ROWS], norm != nullptr, k, eps);
    }
  }
}

static int failures = 0;
static void check(const char* format, const char* what, int tile_rows, int threads, int rows, int k,
                  const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& magnitude) {
  double worst = 0.0;
  for (int r = 0; r < rows; r++) {
    const double error = std::fabs(got[r] - want[r]) / (magnitude[r] + 1e-30);
    if (!(error <= worst)) worst = error;  // NaN included
  }
  const bool ok = worst < 1e-5;
  if (!ok) failures++;
  std::printf("%s %s r%dt%d rows %d k %d: worst error %.3g of the row's magnitude: %s\n", format, what, tile_rows,
              threads, rows, k, worst, ok ? "ok" : "WRONG");
}

// Rows of the three formats with random contents, and each row's product by each format's
// definition over an input (normalized or not), computed in double.
struct Matrices {
  int rows, k, groups;
  std::vector<unsigned short> w, scales, biases;
  std::vector<signed char> q;
  std::vector<unsigned char> packed;
  Matrices(int rows, int k) : rows(rows), k(k), groups(k / SEAM_GROUP) {
    w.resize((size_t)rows * k), scales.resize((size_t)rows * groups), biases.resize((size_t)rows * groups);
    q.resize((size_t)rows * k), packed.resize((size_t)rows * k / 2);
    for (auto& v : w) v = random_half();
    for (auto& v : scales) v = random_half();
    for (auto& v : biases) v = random_half();
    for (auto& v : q) v = (signed char)(next() % 256);
    for (auto& v : packed) v = (unsigned char)(next() % 256);
  }
  // Weight i of row r in format f (0 f16, 1 int8, 2 int4).
  double weight(int f, int r, int i) const {
    const size_t g = (size_t)r * groups + i / SEAM_GROUP;
    if (f == 0) return seam_half_to_float(w[(size_t)r * k + i]);
    if (f == 1) return (double)seam_half_to_float(scales[g]) * q[(size_t)r * k + i];
    const unsigned char byte = packed[((size_t)r * k + i) / 2];
    const int nibble = i % 2 ? byte >> 4 : byte & 15;
    return (double)seam_half_to_float(scales[g]) * nibble + seam_half_to_float(biases[g]);
  }
  // Rows first..first + count of format f over `input`, each added to `residual[first + r]` if
  // given: (sums, sums of magnitudes).
  void products(int f, int first, int count, const std::vector<double>& input, std::vector<double>& want,
                std::vector<double>& magnitude, const float* residual = nullptr) const {
    want.assign(count, 0.0), magnitude.assign(count, 0.0);
    for (int r = 0; r < count; r++) {
      if (residual) want[r] = residual[first + r], magnitude[r] = std::fabs(residual[first + r]);
      for (int i = 0; i < k; i++) {
        const double term = weight(f, first + r, i) * input[i];
        want[r] += term, magnitude[r] += std::fabs(term);
      }
    }
  }
  // Matrix j of a set: rows first..first + count, format f's arrays.
  void place(seam_products& set, int j, int f, int first, int count, float* y) const {
    const size_t row = (size_t)first;
    if (f == 0) set.arrays[j][0] = w.data() + row * k;
    if (f == 1) set.arrays[j][0] = q.data() + row * k, set.arrays[j][1] = scales.data() + row * groups;
    if (f == 2) {
      set.arrays[j][0] = packed.data() + row * k / 2;
      set.arrays[j][1] = scales.data() + row * groups;
      set.arrays[j][2] = biases.data() + row * groups;
    }
    set.y[j] = y, set.rows[j] = count;
  }
};

template <int ROWS, int THREADS>
static void check_tiling(const Matrices& m, const std::vector<float>& x, const std::vector<float>& norm, float eps,
                         const std::vector<double>& normed_x, const std::vector<float>& residual) {
  const char* names[3] = {"f16", "int8", "int4"};
  const int k = m.k;
  std::vector<double> plain_x(x.begin(), x.end());
  // Three matrices of one launch: rows [0, a), [a, a + b), [a + b, rows) of m.
  const int a = (m.rows + 1) / 2, b = m.rows > 2 ? (m.rows - a) / 2 : 0;
  const int parts[3][2] = {{0, a}, {a, b}, {a + b, m.rows - a - b}};
  for (int f = 0; f < 3; f++) {
    std::vector<double> want, magnitude;
    // One matrix, the input as it is, added to a residual.
    seam_products one = {};
    std::vector<float> y(m.rows, NAN);
    m.place(one, 0, f, 0, m.rows, y.data());
    one.residual[0] = residual.data();
    one.count = 1;
    if (f == 0) run<ROWS, THREADS, seam_f16_rows>(one, x.data(), nullptr, 0.0f, k);
    if (f == 1) run<ROWS, THREADS, seam_int8_rows>(one, x.data(), nullptr, 0.0f, k);
    if (f == 2) run<ROWS, THREADS, seam_int4_rows>(one, x.data(), nullptr, 0.0f, k);
    m.products(f, 0, m.rows, plain_x, want, magnitude, residual.data());
    check(names[f], "one", ROWS, THREADS, m.rows, k, y, want, magnitude);
    // The matrices of one launch (those with rows), the input normalized.
    seam_products set = {};
    std::vector<std::vector<float>> ys;
    int blocks = 0;
    for (const auto& part : parts) {
      if (part[1] == 0) continue;
      ys.emplace_back(part[1], NAN);
      m.place(set, set.count, f, part[0], part[1], ys.back().data());
      // The second matrix's rows added to the residual's rows at the same place.
      if (set.count == 1) set.residual[1] = residual.data() + part[0];
      set.first_block[set.count] = blocks;
      blocks += (part[1] + ROWS - 1) / ROWS;
      set.count++;
    }
    if (f == 0) run<ROWS, THREADS, seam_f16_rows>(set, x.data(), norm.data(), eps, k);
    if (f == 1) run<ROWS, THREADS, seam_int8_rows>(set, x.data(), norm.data(), eps, k);
    if (f == 2) run<ROWS, THREADS, seam_int4_rows>(set, x.data(), norm.data(), eps, k);
    std::vector<float> got;
    for (const auto& part_y : ys) got.insert(got.end(), part_y.begin(), part_y.end());
    std::vector<double> part_want, part_magnitude;
    want.clear(), magnitude.clear();
    for (int j = 0, placed = 0; j < 3; j++) {
      if (parts[j][1] == 0) continue;
      m.products(f, parts[j][0], parts[j][1], normed_x, part_want, part_magnitude,
                 placed == 1 ? residual.data() : nullptr);
      want.insert(want.end(), part_want.begin(), part_want.end());
      magnitude.insert(magnitude.end(), part_magnitude.begin(), part_magnitude.end());
      placed++;
    }
    check(names[f], "normed set", ROWS, THREADS, m.rows, k, got, want, magnitude);
  }
}

int main() {
  const int shapes[][2] = {{1, 32}, {70, 96}, {9, 2048}, {13, 4096}, {4, 8192}};
  for (const auto& shape : shapes) {
    const int rows = shape[0], k = shape[1];
    const Matrices m(rows, k);
    std::vector<float> x(k), norm(k), residual(rows);
    for (float& v : x) v = seam_half_to_float(random_half());
    for (float& v : norm) v = seam_half_to_float(random_half());
    // Of about the products' size (sums of k terms of about 1 in magnitude).
    for (float& v : residual) v = seam_half_to_float(random_half()) * std::sqrt((float)k);
    const float eps = 1e-5f;
    double squares = 0.0;
    for (float v : x) squares += (double)v * v;
    const double scale = 1.0 / std::sqrt(squares / k + eps);
    std::vector<double> normed_x(k);
    for (int i = 0; i < k; i++) normed_x[i] = (double)x[i] * scale * norm[i];
#define CHECK_TILING(R, T) check_tiling<R, T>(m, x, norm, eps, normed_x, residual);
    SEAM_TILINGS(CHECK_TILING)
  }
  return failures ? 1 : 0;
}
