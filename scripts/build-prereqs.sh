# To be sourced before building the workspace (scripts/setup.sh and scripts/test.sh do): makes the
# tools that backend-iree's build scripts need available, installing them project-locally into
# .seam/py-build (pip --target, no root) when the system lacks them. Idempotent: a second run
# only checks.
#
# - cmake >= 3.26: eerie-sys builds the IREE runtime from its vendored source with cmake (Debian 12
#   ships 3.25).
# - libclang: eerie-sys generates its bindings with bindgen, which loads libclang at build time.
#   The PyPI wheel `libclang` carries libclang.so but not clang's builtin headers (stddef.h, ...),
#   so gcc's are passed to it instead.
#
# Installs go into seam's home folder (the rule of crates/llama-model/src/home.rs, which the Rust
# code follows): py-build/ is `home::py_build_dir()`, pjrt/ is `home::pjrt_plugin_dir()`. That is
# `$SEAM_HOME` if set; else, sourced from inside this checkout, the checkout's .seam; else (sourced
# from a crate of one's own that depends on seam) the user's cache folder, `$XDG_CACHE_HOME/seam` or
# `~/.cache/seam`, and SEAM_HOME is then exported to it: crates/pjrt-runtime/build.rs reads the PJRT
# header from `$SEAM_HOME/pjrt`, and without it would look inside seam's source (a path
# dependency's checkout, or cargo's git cache), where nothing may be written.
seam_checkout_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${SEAM_HOME:-}" ]; then
  seam_home_dir="$SEAM_HOME"
else
  case "$PWD/" in
    "$seam_checkout_dir"/*) seam_home_dir="$seam_checkout_dir/.seam" ;;
    *)
      seam_home_dir="${XDG_CACHE_HOME:-$HOME/.cache}/seam"
      export SEAM_HOME="$seam_home_dir"
      ;;
  esac
fi
seam_prereq_dir="$seam_home_dir/py-build"

seam_cmake_ok() {
  local version
  version="$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')" || return 1
  [ -n "$version" ] || return 1
  set -- $version
  [ "$1" -gt 3 ] || { [ "$1" -eq 3 ] && [ "$2" -ge 26 ]; }
}

seam_system_libclang() {
  ldconfig -p 2>/dev/null | grep -q 'libclang\(-[0-9.]*\)\?\.so' ||
    ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1
}

# The wheel's bin/cmake is a Python launcher that needs the package on PYTHONPATH; the real binary
# lives under cmake/data/bin.
seam_cmake_bin="$seam_prereq_dir/cmake/data/bin"
if [ -x "$seam_cmake_bin/cmake" ]; then
  export PATH="$seam_cmake_bin:$PATH"
fi
if ! seam_cmake_ok; then
  echo "== installing cmake>=3.26,<4 into $seam_prereq_dir (the IREE runtime build needs it)" >&2
  python3 -m pip install -q --disable-pip-version-check --target "$seam_prereq_dir" --upgrade "cmake>=3.26,<4" >&2
  export PATH="$seam_cmake_bin:$PATH"
fi
if [ -z "${LIBCLANG_PATH:-}" ] && ! seam_system_libclang; then
  if [ ! -f "$seam_prereq_dir/clang/native/libclang.so" ]; then
    echo "== installing libclang==18.1.1 into $seam_prereq_dir (bindgen needs it)" >&2
    python3 -m pip install -q --disable-pip-version-check --target "$seam_prereq_dir" "libclang==18.1.1" >&2
  fi
  export LIBCLANG_PATH="$seam_prereq_dir/clang/native"
  export BINDGEN_EXTRA_CLANG_ARGS="${BINDGEN_EXTRA_CLANG_ARGS:-} -isystem $(cc -print-file-name=include)"
fi

# The PJRT C API header: crates/pjrt-runtime generates its bindings from the header that the pinned
# OpenXLA CPU plugin wheel ships, and the same install is where the pjrt-cpu backend finds its
# plugin ($seam_home_dir/pjrt/xla_plugins/xla_cpu_pjrt/).
seam_pjrt_dir="$seam_home_dir/pjrt"
if [ ! -f "$seam_pjrt_dir/xla_plugins/xla_cpu_pjrt/include/pjrt_c_api.h" ]; then
  echo "== installing xla-cpu-pjrt==0.0.1 into $seam_pjrt_dir (PJRT header and CPU plugin)" >&2
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$seam_pjrt_dir" "xla-cpu-pjrt==0.0.1" >&2
fi
