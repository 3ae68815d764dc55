#!/usr/bin/env bash
# Checks the format and clippy's lints, then runs every test of the workspace. Tests install what they lack themselves (the default model,
# PyPI fixtures) into the project-local .seam/ folder, so this works on a fresh machine; a second
# run reuses it and is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
# The IREE runtime (backend-iree) builds from source: cmake >= 3.26 and libclang, project-local
# when the system lacks them.
# shellcheck source=scripts/build-prereqs.sh
source scripts/build-prereqs.sh
# Style first, before the long test build: rustfmt.toml sets the format (a check of seconds);
# clippy (a check build of the tree) treats its warnings as errors; the tree is clean of them.
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace --no-fail-fast "$@"
