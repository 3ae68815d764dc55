#!/usr/bin/env bash
# Runs every test of the workspace. Tests install what they lack themselves (the default model,
# PyPI fixtures) into the project-local .seam/ folder, so this works on a fresh machine; a second
# run reuses it and is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
# The IREE runtime (backend-iree) builds from source: cmake >= 3.26 and libclang, project-local
# when the system lacks them.
# shellcheck source=scripts/build-prereqs.sh
source scripts/build-prereqs.sh
cargo test --workspace --no-fail-fast "$@"
