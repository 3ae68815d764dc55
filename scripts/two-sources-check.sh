#!/usr/bin/env bash
# Checks that a binary linking two copies of session-api fails to link, naming the problem, and
# that `[patch]` fixes it (docs/adding-a-backend.md, section 3; session_api::ONE_SESSION_API_PER_BINARY).
#
#   scripts/two-sources-check.sh [--keep]
#
# In a temporary folder: a git repository holding a copy of this checkout's sources (the second
# source, at the same version), a vendor crate that registers a backend through session-api from
# that git repository, and an app that takes session-api from this checkout by path and lists the
# registered backends. Without the marker symbol the app would build and list no vendor backend;
# with it the link fails with a duplicate-symbol error. Then the app's workspace patches the git
# source to the path, and the app builds and lists the vendor's backend. About half a minute on 2
# cores (session-api's few dependencies are built once, offline from cargo's cache when present).
# Not part of the test command: it builds outside the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
seam_root=$(pwd)
keep=0
[ "${1:-}" = "--keep" ] && keep=1
symbol=seam_session_api_linked_twice__take_every_seam_crate_from_one_source_with_cargo_patch

work=$(mktemp -d /tmp/seam-two-sources.XXXXXX)
[ "$keep" -eq 1 ] || trap 'rm -rf "$work"' EXIT

# The second source: this checkout's working tree (uncommitted edits included) as a git repository.
mkdir "$work/seam-git"
tar --exclude=./target --exclude=./.seam --exclude=./gpu-bundle --exclude=./.git -cf - . | tar -xf - -C "$work/seam-git"
git -C "$work/seam-git" init -q
git -C "$work/seam-git" add -A
git -C "$work/seam-git" -c user.email=check@seam -c user.name=check commit -qm "second source"

app="$work/app"
mkdir -p "$app/vendor/src" "$app/bin/src"
cat > "$app/Cargo.toml" <<EOF
[workspace]
members = ["vendor", "bin"]
resolver = "2"
EOF
cat > "$app/vendor/Cargo.toml" <<EOF
[package]
name = "vendor"
version = "0.1.0"
edition = "2021"

[dependencies]
session-api = { git = "file://$work/seam-git" }
EOF
cat > "$app/vendor/src/lib.rs" <<'EOF'
use session_api::{Availability, Backend, Capabilities, Engine, LoadRequest, Result};
use std::sync::Arc;

struct Npu;

impl Backend for Npu {
    fn name(&self) -> &str {
        "vendor-npu"
    }
    fn description(&self) -> &str {
        "registered through the git source"
    }
    fn availability(&self) -> Availability {
        Availability::Unavailable { reason: "a check".into() }
    }
    fn capabilities(&self) -> Capabilities {
        unreachable!()
    }
    fn load(&self, _: &LoadRequest) -> Result<Arc<dyn Engine>> {
        unreachable!()
    }
}

session_api::register_backend!("vendor-npu", || Box::new(Npu));

pub fn link() {}
EOF
cat > "$app/bin/Cargo.toml" <<EOF
[package]
name = "app"
version = "0.1.0"
edition = "2021"

[dependencies]
session-api = { path = "$seam_root/crates/session-api" }
vendor = { path = "../vendor" }
EOF
cat > "$app/bin/src/main.rs" <<'EOF'
fn main() {
    vendor::link();
    let names: Vec<&str> = session_api::registered_backends().iter().map(|b| b.name).collect();
    println!("{}", names.join(","));
}
EOF

export CARGO_TARGET_DIR="$app/target"
cd "$app"
cargo fetch -q
if out=$(cargo build -q --offline 2>&1); then
  echo "FAILED: a binary with two copies of session-api linked (it lists: $(./target/debug/app))"
  exit 1
fi
if ! grep -q "$symbol" <<<"$out"; then
  echo "FAILED: the link failed, but not on the marker symbol:"; echo "$out" | tail -20; exit 1
fi
echo "two sources: the link fails on $symbol"
grep -m1 -o "duplicate symbol: $symbol\|multiple definition of .$symbol." <<<"$out" || true

cat >> Cargo.toml <<EOF

[patch."file://$work/seam-git"]
session-api = { path = "$seam_root/crates/session-api" }
EOF
cargo build -q --offline
listed=$(./target/debug/app)
[ "$listed" = "vendor-npu" ] || { echo "FAILED: with [patch] the app lists '$listed'"; exit 1; }
echo "with [patch]: one copy, and the app lists $listed"
