# To be sourced (after scripts/build-prereqs.sh) before building backend-iree with its `cuda`
# feature: `cargo build -p cli --features cuda`. Idempotent: a second run only checks.
#
# IREE's CUDA HAL driver compiles against CUDA's headers and its build wants `libdevice.10.bc`;
# it loads `libcuda.so` (the driver) only at run time. Where no CUDA toolkit is installed, the two
# files come from NVIDIA's PyPI wheels (nvidia-cuda-runtime-cu12 has the headers,
# nvidia-cuda-nvcc-cu12 has crt/ and libdevice), unpacked into .seam/cuda-deps, which IREE's build accepts
# as IREE_CUDA_DEPS_DIR (include/ and nvvm/libdevice/).
seam_cuda_deps="$PWD/.seam/cuda-deps"
if [ -z "${IREE_CUDA_DEPS_DIR:-}" ] && ! command -v nvcc >/dev/null 2>&1; then
  if [ ! -f "$seam_cuda_deps/include/cuda.h" ] || [ ! -f "$seam_cuda_deps/nvvm/libdevice/libdevice.10.bc" ]; then
    echo "== unpacking CUDA headers and libdevice (PyPI nvidia-cuda-runtime-cu12, nvidia-cuda-nvcc-cu12) into $seam_cuda_deps" >&2
    seam_cuda_wheels="$PWD/.seam/downloads/cuda"
    mkdir -p "$seam_cuda_wheels" "$seam_cuda_deps/include" "$seam_cuda_deps/nvvm/libdevice"
    python3 -m pip download -q --disable-pip-version-check --no-deps -d "$seam_cuda_wheels" \
      "nvidia-cuda-runtime-cu12==12.4.127" "nvidia-cuda-nvcc-cu12==12.4.131" "nvidia-cuda-cccl-cu12==12.6.77" >&2
    python3 - "$seam_cuda_wheels" "$seam_cuda_deps" <<'PY'
import pathlib, sys, zipfile
wheels, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for wheel in wheels.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            prefix = next((p for p in ("nvidia/cuda_runtime/include/", "nvidia/cuda_nvcc/include/", "nvidia/cuda_cccl/include/") if name.startswith(p)), None)
            if prefix and not name.endswith(("/", "__init__.py")):
                # Keep subfolders (cooperative_groups/memory.h must not shadow <memory.h>; the
                # runtime headers include crt/*.h from the nvcc wheel, and NCCL's nv/target from cccl).
                target = out / "include" / name[len(prefix):]
            elif name.endswith("nvvm/libdevice/libdevice.10.bc"):
                target = out / "nvvm" / "libdevice" / "libdevice.10.bc"
            else:
                continue
            if name.endswith("/"):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
PY
  fi
  export IREE_CUDA_DEPS_DIR="$seam_cuda_deps"
fi
