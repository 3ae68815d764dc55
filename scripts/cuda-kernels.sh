#!/usr/bin/env bash
# Compiles seam's CUDA kernels (crates/cuda-kernels/kernels/*.cu) to the PTX that the crate
# embeds (kernels/*.ptx, committed: neither the build nor the GPU machine has a CUDA compiler;
# the NVIDIA driver compiles PTX for its GPU when seam loads it). Run it after changing a .cu
# file; `--check` compiles to a temporary file and fails when the committed PTX differs.
#
# The compiler is NVIDIA's nvcc 13.0.88 from PyPI (the wheels of the CUDA PJRT plugin set, ADR
# 0040: the compiler, its NVVM back end and the CUDA runtime's headers, plus the C runtime headers nvcc needs), installed with pinned hashes into
# .seam/cuda-toolkit/13.0.88 on first use; it needs a host C++ compiler (g++) on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOLKIT="${SEAM_HOME:-$ROOT/.seam}/cuda-toolkit/13.0.88"
if [ ! -x "$TOOLKIT/nvidia/cu13/bin/nvcc" ]; then
  requirements=$(mktemp)
  cat >"$requirements" <<'REQ'
nvidia-cuda-nvcc==13.0.88 \
    --hash=sha256:c7ff28f86a24effdc6c034fa15230c549a273e4771b10a7fec14996f8cf3307f \
    --hash=sha256:56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03
nvidia-cuda-runtime==13.0.96 \
    --hash=sha256:ef9bcbe90493a2b9d810e43d249adb3d02e98dd30200d86607d8d02687c43f55 \
    --hash=sha256:7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548
nvidia-nvvm==13.0.88 \
    --hash=sha256:c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0 \
    --hash=sha256:c4376a291d72d22a315d9d2f69bdae8f8cd83a627f75bad395cee49a0fe65dc1
nvidia-cuda-crt==13.0.88 \
    --hash=sha256:2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4
REQ
  staging="$TOOLKIT.partial"
  rm -rf "$staging" "$TOOLKIT"
  python3 -m pip install --quiet --no-deps --require-hashes --only-binary :all: --target "$staging" -r "$requirements"
  rm -f "$requirements"
  mkdir -p "$(dirname "$TOOLKIT")"
  mv "$staging" "$TOOLKIT"
fi
NV="$TOOLKIT/nvidia/cu13"
check=0
[ "${1:-}" = --check ] && check=1
status=0
for source in "$ROOT"/crates/cuda-kernels/kernels/*.cu; do
  ptx="${source%.cu}.ptx"
  out=$(mktemp --suffix=.ptx)
  # compute_80: PTX every GPU from the A100 on can run (the driver compiles it for the GPU it
  # has). No line table: it would name this machine's paths.
  PATH="$NV/bin:$PATH" nvcc -ptx -arch=compute_80 -O3 -I"$NV/include" -o "$out" "$source"
  if [ $check = 1 ]; then
    if cmp -s "$out" "$ptx"; then
      echo "$(basename "$ptx"): current"
    else
      echo "$(basename "$ptx"): differs from what $(basename "$source") compiles to; run scripts/cuda-kernels.sh" >&2
      status=1
    fi
    rm -f "$out"
  else
    mv "$out" "$ptx"
    echo "wrote $ptx"
  fi
done
exit $status
