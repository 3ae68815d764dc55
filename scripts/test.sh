#!/usr/bin/env bash
# Runs every test of the workspace. Tests install what they lack themselves (the default model,
# PyPI fixtures) into the project-local .seam/ folder, so this works on a fresh machine; a second
# run reuses it and is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
# Build prerequisites (cargo build scripts run before any test can install them): the IREE runtime
# of backend-iree builds with cmake >= 3.26 and generates its bindings with libclang.
source scripts/build-prereqs.sh
cargo test --workspace --no-fail-fast "$@"
