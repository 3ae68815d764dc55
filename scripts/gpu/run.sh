#!/usr/bin/env bash
# The GPU proof, run on a machine with an NVIDIA GPU from the bundle scripts/gpu-bundle.sh builds
# (this file is copied there as run.sh). It needs nothing but the bundle, the GPU's driver and, for
# pjrt-cuda, a CUDA PJRT plugin already installed on the machine (JAX's jax-cuda12/13-pjrt, or
# OpenXLA's xla-cuda12-pjrt), which seam finds in python3's site-packages.
#
# It runs `seam backends`, the conformance suite on pjrt-cuda and iree-cuda (parity against the
# reference backend on this machine's CPU; the tiny models are generated here, deterministically),
# and `seam bench` on a Llama-3.2-1B-shaped model in fp16 and int4, and writes to $OUT:
#   log.txt                          everything the commands printed (the CUDA kernels' probe
#                                    included: each kernel's result and time on the 1B shapes
#                                    in every tiling);
#   conformance-{pjrt,iree}-cuda.json the suite's reports;
#   bench-cuda-{pjrt,iree}.json      the benchmark reports of each backend (defaults);
#   bench-cuda-*-{setting}.json      the same with a candidate setting, against those defaults
#                                    (`...-SEAM_CUDA_TILINGS-r4t256`: seam's kernels in the one
#                                    default tiling, against the tilings tuned at load);
#   conformance-pjrt-cuda-{setting}.json the suite with a candidate that changes the kernels;
#   bench-tiny.json                  pjrt-cuda on a tiny model: the per-step cost that is not
#                                    moving weights (launches, host round trips);
#   libraries-{pjrt,iree}.txt        every shared library the conformance run opened;
#   xla-kernels.txt, xla/            the kernels XLA made of each pjrt-cuda graph of the tiny run,
#                                    and their optimized HLO (xla-cuda-kernels/: the same with
#                                    vector_products=cuda-kernels);
#   summary.txt                      the verdict lines and the bench tables;
#   reports.tgz                      all of the above in one file (a caller that brings back only a
#                                    few files takes this one).
# pjrt-cuda's calls print where each graph's time goes (SEAM_PJRT_STEP_PROFILE: uploads, launch,
# waiting and reading back) into log.txt. SEAM_GPU_BACKENDS (default "pjrt iree") picks backends.
# The suite runs with the f16 tolerances: both backends keep f16 weights and an f16 KV cache on a
# GPU, as on the CPU, where the in-tree suites use the same preset.
# Each step has a time limit and the whole a deadline (SEAM_GPU_DEADLINE_S), so that it fits in
# ten minutes; a step that fails is reported and the next one still runs. SEAM_GPU_DRY_RUN=1 runs the same steps on iree-cpu and pjrt-cpu (with a
# tiny bench model), to check the script on a machine without a GPU (where the CUDA kernels'
# steps fail: pjrt-cpu refuses them).
set -uo pipefail
BUNDLE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$BUNDLE/out}"
mkdir -p "$OUT"
SEAM="$BUNDLE/bin/seam"
LOG="$OUT/log.txt"
: >"$LOG"
WORK="$(mktemp -d)"
export SEAM_HOME="$WORK/home"

# The IREE CUDA modules, compiled ahead and packed (PTX is text: packed they take a fifth of the
# room, and the device tool carries at most 64 MiB); unpacked on a dry run too, to check them.
mkdir -p "$WORK/cache"
if ! tar -xzf "$BUNDLE/cache.tgz" -C "$WORK/cache"; then
  echo "run.sh: could not unpack $BUNDLE/cache.tgz; iree-cuda will have no modules" | tee -a "$LOG" >&2
fi

if [ "${SEAM_GPU_DRY_RUN:-}" = 1 ]; then
  device=cpu shape=tiny bench_args=(--prompt-lengths 16,64 --decode-tokens 16 --repeats 2)
  candidate_args=(--prompt-lengths 64 --decode-tokens 16 --repeats 2)
  tiny_args=(--prompt-lengths 16 --decode-tokens 16 --repeats 2)
else
  device=cuda shape=llama-3.2-1b bench_args=(--prompt-lengths 16,128,512 --decode-tokens 64 --repeats 3)
  candidate_args=(--prompt-lengths 512 --decode-tokens 64 --repeats 3)
  tiny_args=(--prompt-lengths 16 --decode-tokens 64 --repeats 3)
  # No compiler here: the IREE modules come from the bundle's cache, compiled ahead.
  export SEAM_CACHE_DIR="$WORK/cache" SEAM_IREE_COMPILER=none
fi

# The whole run ends by SEAM_GPU_DEADLINE_S seconds (default 540, under the device tool's ten
# minutes with room for its start): a step's limit is cut to what is left, and a step with nothing
# left is skipped, so the summary and reports.tgz are always written.
deadline=${SEAM_GPU_DEADLINE_S:-540}

# pack: everything in $OUT so far into reports.tgz (after every step: a run cut short by the
# caller still leaves the reports of the steps that finished).
pack() {
  local reports
  reports=$(mktemp)
  tar -C "$OUT" --exclude ./reports.tgz -czf "$reports" . 2>/dev/null && mv "$reports" "$OUT/reports.tgz"
}

# step NAME LIMIT_S COMMAND...: runs and logs one step; its status goes to the summary.
status_lines=()
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 10 ]; then
    status_lines+=("$(printf '%-28s %-16s %4ss' "$name" "SKIPPED" 0)")
    printf '\n== %s: SKIPPED (the run reached its deadline, %ss)\n' "$name" "$deadline" >>"$LOG"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  printf '\n== %s (limit %ss): %s\n' "$name" "$limit" "$*" >>"$LOG"
  local started=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local verdict="ok"
  [ $rc -eq 124 ] && verdict="TIMED OUT"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="FAILED (exit $rc)"
  status_lines+=("$(printf '%-28s %-16s %4ss' "$name" "$verdict" $((SECONDS - started)))")
  printf '== %s: %s after %ss\n' "$name" "$verdict" $((SECONDS - started)) >>"$LOG"
  pack
}

{
  echo "== machine"
  uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1 || true
  echo "python3: $(command -v python3)"
  echo "CUDA PJRT plugins installed (for the record; seam does its own search):"
  python3 - <<'PY' 2>&1 || true
import glob, site
for folder in site.getsitepackages():
    for name in ("jax_plugins/*/*.so", "xla_plugins/*/*.so"):
        for path in glob.glob(f"{folder}/{name}"):
            print("  ", path)
PY
} >>"$LOG" 2>&1

step "seam backends" 60 "$SEAM" backends
# seam's CUDA kernels on their own (ADR 0042): right on every shape of the 1B model in every
# tiling, and the bytes per second each reaches, before XLA calls them inside a step; it prints
# the tilings the tuner picks for a 1B step (pjrt-cuda tunes them at load, ADR 0045).
# (On a dry run it fails: no NVIDIA driver.)
step "cuda-kernels-probe" 90 "$BUNDLE/bin/cuda-kernels-probe"
step "synth-model $shape" 60 "$SEAM" synth-model --shape "$shape" --out "$WORK/bench-model"
export SEAM_PJRT_STEP_PROFILE=1
selected() { case " ${SEAM_GPU_BACKENDS:-pjrt iree} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# A backend's figures with its defaults, then the conformance suite.
defaults() {
  local backend=$1
  selected "$backend" || return 0
  step "bench $shape $backend" 200 "$SEAM" bench --backend "$backend-$device" --model "$WORK/bench-model" \
    --no-cold "${bench_args[@]}" --json "$OUT/bench-$device-$backend.json"
  # The dynamic loader lists every library the suite's process opens (compiles and executions
  # included): which of the CUDA plugin's NVIDIA libraries seam's graphs need (ADR 0040).
  mkdir -p "$WORK/ld"
  step "conformance $backend-$device" 120 env LD_DEBUG=files LD_DEBUG_OUTPUT="$WORK/ld/$backend" \
    "$SEAM" conformance --backend "$backend-$device" --precision f16 \
    --real-model skip --json "$OUT/conformance-$backend-$device.json"
  grep -ho 'file=[^ ]*' "$WORK/ld/$backend".* 2>/dev/null | sort -u >"$OUT/libraries-$backend.txt"
}
# Candidate settings (comma-separated; a SEAM_* one is an environment variable) against the
# defaults, on the same model in the same call.
candidate() {
  local backend=${1%% *} settings=${1#* }
  selected "$backend" || return 0
  local set_args=() env_args=() setting
  for setting in ${settings//,/ }; do
    case $setting in
      SEAM_*) env_args+=("$setting") ;;
      *) set_args+=(--set "$setting") ;;
    esac
  done
  local name=${settings//=/-}
  step "bench $shape $backend $settings" 90 env "${env_args[@]}" "$SEAM" bench --backend "$backend-$device" \
    --model "$WORK/bench-model" --no-cold "${candidate_args[@]}" "${set_args[@]}" \
    --json "$OUT/bench-$device-$backend-${name//,/-}.json"
}
# The conformance suite with a candidate setting (SEAM_PJRT_* variables): a candidate that
# changes what the kernels compute must also pass the suite before its figures count.
candidate_suite() {
  local backend=${1%% *} settings=${1#* }
  selected "$backend" || return 0
  local name=${settings//=/-}
  step "conformance $backend $settings" 120 env ${settings//,/ } "$SEAM" conformance \
    --backend "$backend-$device" --precision f16 --real-model skip \
    --json "$OUT/conformance-$backend-$device-${name//,/-}.json"
}
# In order of what a short device call must not miss: pjrt-cuda (the backend closest to the
# targets) and its open questions first: decode's products through seam's CUDA kernels (XLA
# custom calls, ADR 0042, in the tilings tuned at load, ADR 0045; never run on a GPU before: its
# suite comes right after its figures), then in the one default tiling (what tuning gains), then
# one call per product with the norms in
# XLA's graph (`cuda-kernels-each`: what grouping the products and folding the norms in gain);
# greedy steps not launched ahead (ADR 0041: what launching the next step before reading the
# token back gains); int4 read as XLA's packed 4-bit type, then as 32-bit words, in decode's
# reductions (the byte-wide form moved a third of fp16's bytes per second); then iree-cuda
# (measured on 2026-11-27, docs/performance.md; its suite proves the graphs again); then decode
# as dots over int4 dequantized in the graph, and the dots at XLA's default precision (TF32: what
# `dot_precision=highest` costs prefill).
defaults pjrt
candidate "pjrt vector_products=cuda-kernels"
candidate_suite "pjrt SEAM_PJRT_VECTOR_PRODUCTS=cuda-kernels"
candidate "pjrt vector_products=cuda-kernels,SEAM_CUDA_TILINGS=r4t256"
candidate "pjrt vector_products=cuda-kernels-each"
candidate "pjrt SEAM_PJRT_LAUNCH_AHEAD=0"
candidate "pjrt vector_products=reduce-nibbles"
candidate "pjrt vector_products=reduce-words"
defaults iree
candidate "pjrt vector_products=dot,int4_dequantize_from=1"
candidate "pjrt dot_precision=default"
step "synth-model tiny" 30 "$SEAM" synth-model --shape tiny --out "$WORK/tiny-model"
# XLA writes each graph it compiles, after optimization: the kernels a step launches, with the
# defaults and with seam's CUDA kernels (the fusions and custom calls left around them).
tiny_dump() {
  local name=$1
  shift
  step "bench tiny${name:+ $name}" 60 env XLA_FLAGS="--xla_dump_to=$WORK/xla$name --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" \
    "$SEAM" bench --backend "pjrt-$device" --model "$WORK/tiny-model" --no-cold "${tiny_args[@]}" "$@" \
    --json "$OUT/bench-tiny$name.json"
  mkdir -p "$OUT/xla$name"
  local f entry
  for f in "$WORK/xla$name"/*after_optimizations.txt; do
    [ -f "$f" ] || continue
    cp "$f" "$OUT/xla$name/"
    entry=$(awk '/^ENTRY/{p=1} p&&/^}/{exit} p' "$f")
    printf '%-70s fusions %4d  custom-calls %4d  copies %3d  while %2d\n' "${name:+$name/}$(basename "$f")" \
      "$(grep -c ' fusion(' <<<"$entry")" "$(grep -c 'custom-call(' <<<"$entry")" \
      "$(grep -c ' copy(' <<<"$entry")" "$(grep -c ' while(' <<<"$entry")"
  done >>"$OUT/xla-kernels.txt" 2>&1
}
: >"$OUT/xla-kernels.txt"
tiny_dump ""
tiny_dump "-cuda-kernels" --set vector_products=cuda-kernels

{
  echo "seam GPU proof, $(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo 'no GPU (dry run)'), bundle built from $(cat "$BUNDLE/built-from.txt" 2>/dev/null || echo 'an unknown commit')"
  echo
  printf '%s\n' "${status_lines[@]}"
  echo
  # The suite's matrix and the bench tables, as the commands printed them.
  grep -E '^(case|backend|pjrt|iree|reference|[a-z]+\.[a-z_]+ |.*(FAIL|pass|unsupported) |.*memory bandwidth|== bench)' "$LOG" \
    | grep -v '^  ' || true
  echo
  echo "seam's CUDA kernels on their own:"
  awk '/^== cuda-kernels-probe \(/{p=1; next} /^== cuda-kernels-probe:/{p=0} p' "$LOG"
  echo
  echo "kernels per pjrt graph (tiny model):"
  head -60 "$OUT/xla-kernels.txt"
} >"$OUT/summary.txt"
rm -rf "$WORK"
pack
cat "$OUT/summary.txt"
