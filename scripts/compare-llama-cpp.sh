#!/usr/bin/env bash
# seam against llama.cpp on the same CPU and the same weights, in one invocation.
#
#   scripts/compare-llama-cpp.sh [--model smollm2|llama-3.2-1b] [--backends iree-cpu,pjrt-cpu]
#                                [--threads N] [--repeats N] [--quick] [--out FILE]
#                                [--depth N] [--set KEY=VALUE ...] [--isa native|avx2]
#
# Builds llama.cpp's llama-bench from the pinned llama-cpp-python source tarball
# (scripts/build-llama-bench.sh), makes the GGUFs llama.cpp reads (`seam export-gguf`), runs
# llama-bench on the F16 and Q4_1 files and `seam bench` on the same weights, and prints the
# ratios (scripts/compare_llama_cpp.py), writing everything to one JSON file. seam bench runs
# every backend on every core (pjrt-cpu's XLA client cannot be given fewer), so llama-bench gets
# -t $(nproc) unless --threads says otherwise. Idempotent: built binaries, GGUFs and models are reused.
# --set passes a backend setting to seam bench (e.g. activations=int8, ADR 0024: the kernels'
# int4 products over activations rounded to int8, as llama.cpp's Q4_1 x Q8_1).
# --depth N times decode after N tokens of context on both sides (`seam bench --decode-depth N`,
# `llama-bench -d N` in a run of its own, so that prefill stays measured from an empty context);
# without it, seam decodes after a 16-token prompt and llama-bench from an empty context.
# --isa avx2 limits both sides to AVX2, FMA and F16C on a machine that has more: seam's kernels
# through SEAM_CPU_ISA=avx2, llama.cpp built without AVX-512 (scripts/build-llama-bench.sh --isa
# avx2). The compilers' own code (XLA's, IREE's) still targets the whole CPU.
#
# Models:
#   smollm2       the default model: llama.cpp runs the original Q4_1 GGUF (which seam's int4
#                 carries exactly) and seam's fp16 weights exported as F16 (the Q4_1 dequantized)
#   llama-3.2-1b  `seam synth-model --shape llama-3.2-1b` (random weights, real dimensions),
#                 exported as F16 (seam's fp16 weights) and Q4_1 (seam's int4 weights, exactly)
set -euo pipefail
cd "$(dirname "$0")/.."

model=smollm2
threads="$(nproc)"
backends=""
repeats=3
quick=0
depth=0
out=""
settings=()
isa=native
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --backends) backends="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --repeats) repeats="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    --depth) depth="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --set) settings+=(--set "$2"); shift 2 ;;
    --isa) isa="$2"; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

# shellcheck source=scripts/llama-cpp-common.sh
source scripts/llama-cpp-common.sh
out="${out:-$work/results/compare-$model-$stamp.json}"

if [ "$quick" = 1 ]; then
  prompt_lengths="16,128"; decode_tokens=16; repeats=1
else
  prompt_lengths="16,128,512"; decode_tokens=64
fi

step "llama-bench (scripts/build-llama-bench.sh)"
llama_bench="$(scripts/build-llama-bench.sh --isa "$isa")"
if [ "$isa" != native ]; then export SEAM_CPU_ISA="$isa"; fi

build_seam

model_ggufs "$model"

if [ -z "$backends" ]; then
  backends="iree-cpu"
  if "$seam" backends --json | python3 -c "import json,sys; sys.exit(0 if any(b['name']=='pjrt-cpu' and b['availability']['status']=='available' for b in json.load(sys.stdin)) else 1)"; then
    backends="iree-cpu,pjrt-cpu"
  fi
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for pair in "f16:$f16" "int4:$q4_1"; do
  format="${pair%%:*}"; gguf="${pair#*:}"
  if [ "$depth" -gt 0 ]; then
    # Prefill from an empty context, then decode after $depth tokens: two runs, one list.
    step "llama-bench $(basename "$gguf") -t $threads -p $prompt_lengths -n 0 -r $repeats"
    "$llama_bench" -m "$gguf" -t "$threads" -p "$prompt_lengths" -n 0 -r "$repeats" -o json > "$tmp/llama-pp-$format.json"
    step "llama-bench $(basename "$gguf") -t $threads -p 0 -n $decode_tokens -d $depth -r $repeats"
    "$llama_bench" -m "$gguf" -t "$threads" -p 0 -n "$decode_tokens" -d "$depth" -r "$repeats" -o json > "$tmp/llama-tg-$format.json"
    python3 -c 'import json,sys; json.dump(json.load(open(sys.argv[1])) + json.load(open(sys.argv[2])), open(sys.argv[3], "w"))' \
      "$tmp/llama-pp-$format.json" "$tmp/llama-tg-$format.json" "$tmp/llama-$format.json"
  else
    step "llama-bench $(basename "$gguf") -t $threads -p $prompt_lengths -n $decode_tokens -r $repeats"
    "$llama_bench" -m "$gguf" -t "$threads" -p "$prompt_lengths" -n "$decode_tokens" -r "$repeats" -o json > "$tmp/llama-$format.json"
  fi
  # A whole llama.cpp process on the file (load, warm-up, one token), against which a new
  # `seam run --max-tokens 1` process (timed by seam bench) is compared.
  step "llama-bench $(basename "$gguf") -t $threads -p 0 -n 1 -r 1, whole process, $repeats times"
  python3 - "$repeats" "$tmp/llama-process-$format.json" "$llama_bench" -m "$gguf" -t "$threads" -p 0 -n 1 -r 1 <<'PY'
import json, subprocess, sys, time
repeats, out, command = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
times = []
for _ in range(repeats):
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times.append((time.perf_counter() - started) * 1000)
json.dump({"command": command, "wall_ms": times}, open(out, "w"))
PY
done

bench_args=(bench --model "$model_dir" --prompt-lengths "$prompt_lengths" --decode-tokens "$decode_tokens" --repeats "$repeats" --json "$tmp/seam.json" ${settings[@]+"${settings[@]}"})
if [ "$depth" -gt 0 ]; then bench_args+=(--decode-depth "$depth"); fi
IFS=',' read -r -a names <<< "$backends"
for b in "${names[@]}"; do bench_args+=(--backend "$b"); done
step "$seam ${bench_args[*]}"
"$seam" "${bench_args[@]}" >&2

llama_commit="$("$llama_bench" --version 2>&1 | head -1 || true)"
seam_commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
context="$(python3 -c 'import json,sys; print(json.dumps({"command": sys.argv[1], "model": sys.argv[2], "threads": int(sys.argv[3]), "llama_cpp": sys.argv[4], "llama_cpp_python": "0.3.36", "seam_commit": sys.argv[5], "ggufs": sys.argv[6:]}))' \
  "scripts/compare-llama-cpp.sh --model $model --backends $backends --threads $threads --repeats $repeats$( [ "$quick" = 1 ] && echo ' --quick')$( [ "$depth" -gt 0 ] && echo " --depth $depth")$( [ "$isa" != native ] && echo " --isa $isa")" "$model" "$threads" "$llama_commit" "$seam_commit" "$f16" "$q4_1")"
python3 scripts/compare_llama_cpp.py --seam "$tmp/seam.json" --llama "f16=$tmp/llama-f16.json" --llama "int4=$tmp/llama-int4.json" \
  --llama-process "f16=$tmp/llama-process-f16.json" --llama-process "int4=$tmp/llama-process-int4.json" \
  --context "$context" --out "$out"
