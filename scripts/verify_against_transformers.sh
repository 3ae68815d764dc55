#!/usr/bin/env bash
# Compares the reference backend's greedy continuation on the default model with Hugging Face
# transformers' LlamaForCausalLM (float32) on the same converted weights, token for token.
# Installs torch and transformers (pinned) into .seam/verify-py on first use (about 3 GB with the
# CUDA runtime wheels PyPI's torch depends on; nothing else needs them).
# fp16: seam's fp16 weights against transformers on the same model directory. int4: the reference
# backend on seam's int4 model against transformers' float32 run of the GGUF it was converted from
# (transformers' own GGUF reader dequantizes every tensor; seam carries each one exactly, so only
# the order of additions differs).
#   usage: scripts/verify_against_transformers.sh [tokens per prompt, default 64]
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS="${1:-64}"
PY=.seam/verify-py
if [ ! -f "$PY/.installed" ]; then
  python3 -m pip install --quiet --target "$PY" "torch==2.5.1" "transformers==4.46.3" "numpy<2.1"
  touch "$PY/.installed"
fi
if [ ! -f "$PY/.installed-gguf" ]; then
  # What transformers' GGUF reader imports (gguf 0.10, its documented minimum, predates NumPy 2).
  python3 -m pip install --quiet --no-deps --target "$PY" "gguf==0.17.1" "accelerate==1.1.1" "psutil==6.1.0" \
    "sentencepiece==0.2.0"
  touch "$PY/.installed-gguf"
fi
source scripts/build-prereqs.sh >/dev/null
cargo build -q -p cli
MODEL="${SEAM_HOME:-$PWD/.seam}/models/SmolLM2-135M-Instruct"
target/debug/seam convert --default-model >/dev/null
GGUF="${SEAM_HOME:-$PWD/.seam}/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p .seam/verify
status=0
for prompt in "The three primary colors are" "The capital of France is" "Once upon a time, in a small village by the sea," "def fibonacci(n):" "Water boils at a temperature of"; do
  for weights in f16 int4; do
    backend=()
    source=()
    if [ "$weights" = int4 ]; then backend=(--backend reference); source=("$GGUF"); fi
    target/debug/seam run "${backend[@]}" --weights "$weights" --ignore-eos --max-tokens "$TOKENS" --json \
      --prompt "$prompt" > .seam/verify/run.json
    PYTHONPATH="$PY" python3 scripts/verify_against_transformers.py "$MODEL" .seam/verify/run.json "${source[@]}" \
      > .seam/verify/report.json 2>/dev/null || status=1
    python3 -c 'import json,sys; r=json.load(open(".seam/verify/report.json")); print(json.dumps({k: r[k] for k in ("backend","weights","prompt_tokens","compared_tokens","first_divergence","margin_at_divergence","min_margin")}))'
  done
done
exit $status
