#!/usr/bin/env bash
# Builds, on this machine, everything a GPU machine needs to prove seam's CUDA backends and that it
# cannot build itself (it has no Rust toolchain, no IREE compiler and no package registry), into
# the git-ignored folder gpu-bundle/:
#   bin/seam        a stripped release build with the `cuda` feature (iree-cuda and pjrt-cuda);
#   bin/cuda-kernels-probe  seam's CUDA kernels checked and timed on their own (ADR 0042);
#   cache.tgz       the IREE CUDA modules of the conformance suite's tiny models (every context the
#                   suite loads them with, embedding and batch graphs included) and of the
#                   Llama-3.2-1B shape (fp16 and int4 token graphs, the context `seam bench` loads
#                   with), compiled ahead with `seam compile` for $SEAM_IREE_CUDA_TARGET (default
#                   sm_89: IREE 3.13 has no sm_90 target, and an H100's driver compiles sm_89 PTX)
#                   into target/gpu-bundle-cache/, then packed (their PTX is text: 45 MiB of
#                   modules pack into 8; run.sh unpacks them);
#   run.sh          the run script (scripts/gpu/run.sh);
#   built-from.txt  the commit the bundle was built from.
# On the GPU machine: `gpu-bundle/run.sh` (OUT names the folder for the reports). With the device
# tool: carry gpu-bundle and run `gpu-bundle/run.sh`. Idempotent: a second run rebuilds only what
# changed (the module cache is reused).
#
# `--dry-run` then runs the same script here on the CPU backends (iree-cpu and pjrt-cpu instead of
# the CUDA ones), to check it end to end without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE="$PWD/gpu-bundle"
step() { printf '\n== %s\n' "$*" >&2; }

step "build prerequisites (cmake, libclang, CUDA headers and libdevice)"
# shellcheck source=scripts/build-prereqs.sh
source scripts/build-prereqs.sh
# shellcheck source=scripts/cuda-prereqs.sh
source scripts/cuda-prereqs.sh

step "release build of seam with the cuda feature"
cargo build --release -p cli --features cuda
cargo build --release -p cuda-kernels --bin cuda-kernels-probe
mkdir -p "$BUNDLE/bin"
rm -rf "$BUNDLE/cache"
strip -o "$BUNDLE/bin/seam.tmp" target/release/seam && mv "$BUNDLE/bin/seam.tmp" "$BUNDLE/bin/seam"
strip -o "$BUNDLE/bin/probe.tmp" target/release/cuda-kernels-probe &&
  mv "$BUNDLE/bin/probe.tmp" "$BUNDLE/bin/cuda-kernels-probe"
cp scripts/gpu/run.sh "$BUNDLE/run.sh"
chmod +x "$BUNDLE/run.sh"
# The commit the bundle was built from (`-dirty`: with uncommitted changes), which run.sh reports:
# a bundle left in a checkout says whether it is current.
git describe --always --dirty >"$BUNDLE/built-from.txt" 2>/dev/null || echo unknown >"$BUNDLE/built-from.txt"

step "IREE CUDA modules, compiled ahead (${SEAM_IREE_CUDA_TARGET:=sm_89})"
# The modules are compiled into a cache outside the bundle and packed into it. The cache is kept
# while the seam binary is the same one (a second run compiles nothing); a new binary may emit
# other graph texts, whose modules would sit beside the old ones under new keys, so it starts
# an empty cache and only this binary's modules are packed.
CACHE="$PWD/target/gpu-bundle-cache"
binary_sum=$(sha256sum "$BUNDLE/bin/seam" | cut -d' ' -f1)
if [ "$(cat "$CACHE/seam.sha256" 2>/dev/null)" != "$binary_sum" ]; then
  rm -rf "$CACHE"
fi
mkdir -p "$CACHE"
export SEAM_IREE_CUDA_TARGET
SEAM="$BUNDLE/bin/seam"
# Only the config of a model decides its graphs: the 1B shape is written with random weights, read
# for its config, and removed.
shape_dir=$(mktemp -d)
trap 'rm -rf "$shape_dir"' EXIT
"$SEAM" synth-model --shape llama-3.2-1b --out "$shape_dir/l1b" >/dev/null
"$SEAM" synth-model --shape tiny --out "$shape_dir/tiny" >/dev/null
# The modules go to that cache folder, nothing else of seam's (SEAM_CACHE_DIR moves only the
# compiled-graph caches).
SEAM_CACHE_DIR="$CACHE" "$SEAM" compile --backend iree-cuda --conformance-models
# The bench models (run.sh benches with a context of 2048), token graphs only.
SEAM_CACHE_DIR="$CACHE" "$SEAM" compile --backend iree-cuda --model "$shape_dir/l1b" \
  --model "$shape_dir/tiny" --max-context 2048 --token-graphs-only
echo "$binary_sum" >"$CACHE/seam.sha256"
tar -C "$CACHE" -czf "$BUNDLE/cache.tgz.tmp" iree && mv "$BUNDLE/cache.tgz.tmp" "$BUNDLE/cache.tgz"

size=$(du -sm "$BUNDLE" | cut -f1)
step "gpu-bundle: ${size} MiB (the device tool carries at most 64 MiB with the working tree)"
if [ "$size" -ge 60 ]; then
  echo "gpu-bundle is ${size} MiB, over the 60 MiB it must fit in" >&2
  exit 1
fi

if [ "${1:-}" = "--dry-run" ]; then
  step "dry run of run.sh on the CPU backends"
  dry_out=$(mktemp -d)
  # run.sh gives seam a fresh SEAM_HOME, as on the GPU machine, where the CUDA plugin comes from
  # python3's site-packages; here pjrt-cpu needs the CPU plugin build-prereqs.sh installed.
  cpu_plugin="$PWD/.seam/pjrt/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"
  SEAM_PJRT_CPU_PLUGIN="${SEAM_PJRT_CPU_PLUGIN:-$cpu_plugin}" SEAM_GPU_DRY_RUN=1 OUT="$dry_out" "$BUNDLE/run.sh"
  echo "dry-run reports in $dry_out" >&2
fi
