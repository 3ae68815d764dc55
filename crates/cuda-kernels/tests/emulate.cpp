// Runs the per-thread part of kernels/products.cu on the host for every thread of every block,
// sums the threads' partial sums (what the kernels' warp and block reductions do), and checks
// each format's rows against the format's definition, computed input by input. Prints one line
// per case; exits 1 when a case is off by more than float rounding.
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

// One tiling's blocks of ROWS rows and THREADS threads.
template <int ROWS, int THREADS, class M>
static std::vector<float> run(const M& m, const std::vector<float>& x, int rows, int k) {
  std::vector<float> y(rows, 0.0f);
  const int blocks = (rows + ROWS - 1) / ROWS;
  for (int b = 0; b < blocks; b++) {
    float sums[ROWS] = {0};
    for (int t = 0; t < THREADS; t++) {
      float acc[ROWS];
      thread_sums<ROWS, THREADS>(m, x.data(), b * ROWS, rows, k, t, acc);
      for (int r = 0; r < ROWS; r++) sums[r] += acc[r];
    }
    for (int r = 0; r < ROWS && b * ROWS + r < rows; r++) y[b * ROWS + r] = sums[r];
  }
  return y;
}

static int failures = 0;
static void check(const char* format, int tile_rows, int threads, int rows, int k, const std::vector<float>& got, const std::vector<double>& want,
                  const std::vector<double>& magnitude) {
  double worst = 0.0;
  for (int r = 0; r < rows; r++) {
    const double error = std::fabs(got[r] - want[r]) / (magnitude[r] + 1e-30);
    if (error > worst) worst = error;
  }
  const bool ok = worst < 1e-5;
  if (!ok) failures++;
  std::printf("%s r%dt%d rows %d k %d: worst error %.3g of the row's magnitude: %s\n", format, tile_rows, threads, rows, k,
              worst, ok ? "ok" : "WRONG");
}

int main() {
  const int shapes[][2] = {{1, 32}, {70, 96}, {9, 2048}, {13, 4096}, {4, 8192}};
  for (const auto& shape : shapes) {
    const int rows = shape[0], k = shape[1], groups = k / SEAM_GROUP;
    std::vector<float> x(k);
    for (float& v : x) v = seam_half_to_float(random_half());
    std::vector<unsigned short> w((size_t)rows * k), scales((size_t)rows * groups), biases((size_t)rows * groups);
    std::vector<signed char> q((size_t)rows * k);
    std::vector<unsigned char> packed((size_t)rows * k / 2);
    for (auto& v : w) v = random_half();
    for (auto& v : scales) v = random_half();
    for (auto& v : biases) v = random_half();
    for (auto& v : q) v = (signed char)(next() % 256);
    for (auto& v : packed) v = (unsigned char)(next() % 256);
    std::vector<double> f16(rows), int8(rows), int4(rows), f16_mag(rows), int8_mag(rows), int4_mag(rows);
    for (int r = 0; r < rows; r++) {
      for (int i = 0; i < k; i++) {
        const size_t g = (size_t)r * groups + i / SEAM_GROUP;
        const double wf = seam_half_to_float(w[(size_t)r * k + i]);
        const double w8 = (double)seam_half_to_float(scales[g]) * q[(size_t)r * k + i];
        const unsigned char byte = packed[((size_t)r * k + i) / 2];
        const int nibble = i % 2 ? byte >> 4 : byte & 15;
        const double w4 = (double)seam_half_to_float(scales[g]) * nibble + seam_half_to_float(biases[g]);
        f16[r] += wf * x[i], int8[r] += w8 * x[i], int4[r] += w4 * x[i];
        f16_mag[r] += std::fabs(wf * x[i]), int8_mag[r] += std::fabs(w8 * x[i]), int4_mag[r] += std::fabs(w4 * x[i]);
      }
    }
    const seam_f16_rows f16_rows{w.data(), k};
    const seam_int8_rows int8_rows{q.data(), scales.data(), k};
    const seam_int4_rows int4_rows{packed.data(), scales.data(), biases.data(), k};
    // Every tiling the kernels are compiled for.
#define CHECK_TILING(R, T)                                                    \
  check("f16", R, T, rows, k, run<R, T>(f16_rows, x, rows, k), f16, f16_mag);    \
  check("int8", R, T, rows, k, run<R, T>(int8_rows, x, rows, k), int8, int8_mag); \
  check("int4", R, T, rows, k, run<R, T>(int4_rows, x, rows, k), int4, int4_mag);
    SEAM_TILINGS(CHECK_TILING)
  }
  return failures ? 1 : 0;
}
