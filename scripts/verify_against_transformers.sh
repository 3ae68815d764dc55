#!/usr/bin/env bash
# Compares the reference backend's greedy continuation on the default model with Hugging Face
# transformers' LlamaForCausalLM (float32) on the same converted weights, token for token.
# Installs torch and transformers (pinned) into .seam/verify-py on first use (about 3 GB with the
# CUDA runtime wheels PyPI's torch depends on; nothing else needs them).
# transformers cannot read seam's int4 file, so the comparison is on the fp16 weights.
#   usage: scripts/verify_against_transformers.sh [tokens per prompt, default 64]
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS="${1:-64}"
PY=.seam/verify-py
if [ ! -f "$PY/.installed" ]; then
  python3 -m pip install --quiet --target "$PY" "torch==2.5.1" "transformers==4.46.3" "numpy<2.1"
  touch "$PY/.installed"
fi
cargo build -q -p cli
MODEL="${SEAM_HOME:-$PWD/.seam}/models/SmolLM2-135M-Instruct"
target/debug/seam convert --default-model >/dev/null
mkdir -p .seam/verify
status=0
for prompt in "The three primary colors are" "The capital of France is" "Once upon a time, in a small village by the sea," "def fibonacci(n):"; do
  target/debug/seam run --weights f16 --ignore-eos --max-tokens "$TOKENS" --json --prompt "$prompt" > .seam/verify/run.json
  PYTHONPATH="$PY" python3 scripts/verify_against_transformers.py "$MODEL" .seam/verify/run.json \
    > .seam/verify/report.json || status=1
  python3 -c 'import json,sys; r=json.load(open(".seam/verify/report.json")); print(json.dumps({k: r[k] for k in ("prompt_tokens","compared_tokens","first_divergence","margin_at_divergence","min_margin")}))'
done
exit $status
