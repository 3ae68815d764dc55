#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` from the source tarball of the PyPI package llama-cpp-python
# (pinned; its vendor/llama.cpp is the llama.cpp it ships) into .seam/llama.cpp, for side-by-side
# speed comparisons with seam (scripts/compare-llama-cpp.sh). Idempotent: prints the binary's
# path and does nothing else when it is already built. About 5 minutes on 2 cores.
#
#   scripts/build-llama-bench.sh [--isa native|avx2] [TARGET]
#
# TARGET is another llama.cpp tool of the same build, `llama-bench` when absent:
# scripts/compare-perplexity.sh builds `llama-perplexity` (a small compile once llama-bench is
# built, the libraries being shared).
# --isa avx2 builds, in a folder of its own (.seam/llama.cpp/build-avx2), a llama.cpp limited to
# AVX2, FMA and F16C (no AVX-512): the counterpart of seam's kernels under SEAM_CPU_ISA=avx2, so
# that the AVX2 paths of both can be compared on a machine that has AVX-512 too.
set -euo pipefail
cd "$(dirname "$0")/.."

isa=native
if [ "${1:-}" = "--isa" ]; then
  isa="${2:?--isa needs native or avx2}"
  shift 2
fi
case "$isa" in
  native|avx2) ;;
  *) echo "unknown --isa $isa (native or avx2)" >&2; exit 2 ;;
esac
target="${1:-llama-bench}"
case "$target" in
  llama-bench|llama-perplexity|llama-server) ;;
  *) echo "unknown llama.cpp target $target (llama-bench, llama-perplexity or llama-server)" >&2; exit 2 ;;
esac
LLAMA_CPP_PYTHON_VERSION="0.3.36"
dir="$PWD/.seam/llama.cpp"
build="$dir/build"
[ "$isa" = native ] || build="$dir/build-$isa"
bin="$build/bin/$target"
# Some virtual machines report AMX (amx_tile in /proc/cpuinfo) but ggml's AMX path faults there
# (llama-bench died with SIGILL on `tilezero` on an Intel Xeon VM, 2026-11-26; llama-server did
# too on 2026-11-28, on a VM where AMX tile products otherwise ran: docs/performance.md, run 33),
# so the native build leaves AMX out; llama.cpp then takes its AVX-512 (VNNI) paths. The flags
# are recorded beside the build, and a build made with other flags is configured again.
cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "$isa" = native ]; then
  isa_flags=(-DGGML_NATIVE=ON)
else
  # Not native: ggml then enables only the instruction sets named here.
  isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
  cflags="$cflags -mno-avx512f"
fi
stamp="$build/seam-cflags"
if [ -x "$bin" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$cflags" ]; then
  echo "$bin"
  exit 0
fi

# shellcheck source=scripts/build-prereqs.sh
source scripts/build-prereqs.sh   # cmake >= 3.26 (pip's metadata step for the sdist needs it too)

mkdir -p "$dir/dl" "$dir/src"
tarball="$dir/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$tarball" ]; then
  # pip prepares the sdist's metadata even for a download, which needs its build backend.
  echo "== downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION (source tarball)" >&2
  python3 -m pip install -q --disable-pip-version-check --target "$dir/py" "scikit-build-core==1.1.2" >&2
  PYTHONPATH="$dir/py" python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    --no-build-isolation "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$dir/dl" >&2
fi
src="$dir/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
[ -d "$src" ] || tar -xzf "$tarball" -C "$dir/src"

echo "== building $target (Release, $isa CPU without AMX, no curl)" >&2
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DLLAMA_CURL=OFF \
  -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$build" --target "$target" -j "$(nproc)" >&2
echo "$cflags" > "$stamp"
echo "$bin"
