#!/usr/bin/env bash
# Checks the format, clippy's lints and the API docs' links, then runs every test of the workspace. Tests install what they lack themselves (the default model,
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
# The API docs build without a broken or private link (rustdoc's warnings as errors).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
cargo test --workspace --no-fail-fast "$@"
