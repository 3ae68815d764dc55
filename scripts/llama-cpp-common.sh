# Sourced by scripts/compare-llama-cpp.sh and scripts/compare-perplexity.sh, from the repository
# root: the setup both comparisons share.
#   step MESSAGE          a progress line on stderr
#   $work, $stamp         .seam/llama.cpp (models/ and results/ made) and a UTC time stamp
#   build_seam            the build prerequisites, `cargo build -p cli`, and $seam
#   default_model_ggufs   the default model installed; $model_dir, $q4_1 (the GGUF it was
#                         converted from) and $f16 (seam's fp16 weights exported as F16, made once)

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
