#!/usr/bin/env bash
# Builds the example backend the way a vendor would: a copy of examples/backend-example in a
# temporary directory, outside this checkout, depending on seam by path (docs/adding-a-backend.md).
# Then runs its conformance test on the tiny models, builds its own `seam-example` binary, checks
# that the binary lists and runs the backend, and that nothing was written into this checkout.
#
#   scripts/out-of-tree-check.sh [--keep]
#
# The copy gets its own target folder, so the first run compiles seam's crates it needs (no IREE,
# no PJRT: the cli is taken without default features): several minutes on 2 cores. Not part of the
# test command; issue 19's "done when" is checked by it. --keep leaves the temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
seam_root=$(pwd)
keep=0
[ "${1:-}" = "--keep" ] && keep=1

work=$(mktemp -d /tmp/seam-vendor.XXXXXX)
[ "$keep" -eq 1 ] || trap 'rm -rf "$work"' EXIT
vendor="$work/my-backend"
cp -r examples/backend-example "$vendor"
home="$work/home"
export XDG_CACHE_HOME="$home"
unset SEAM_HOME SEAM_CACHE_DIR SEAM_CONFORMANCE_CACHE

# The vendor's manifest: seam's crates by absolute path, a workspace of its own with seam's
# profiles (the section "Speed" of docs/adding-a-backend.md), the cli without IREE and PJRT.
python3 - "$vendor/Cargo.toml" "$seam_root" <<'EOF'
import re, sys
path, root = sys.argv[1], sys.argv[2]
text = open(path).read().replace('path = "../../crates/', f'path = "{root}/crates/')
profiles = re.search(r"^\[profile\.dev\].*?(?=^\[profile\.release\])", open(f"{root}/Cargo.toml").read(), re.S | re.M)
text += "\n[workspace]\n\n" + profiles.group(0)
open(path, "w").write(text)
EOF

marker="$work/marker"
touch "$marker"
sleep 1
# No `source scripts/build-prereqs.sh`: the vendor's seam has no IREE and no PJRT, so its build
# needs none of the tools and headers that script installs. (A vendor who adds them sources it from
# their own crate; it then installs into the user's cache folder, not here: see the doc's section 8.)
(
  cd "$vendor"
  export CARGO_TARGET_DIR="$vendor/target"
  started=$(date +%s)
  cargo build -q --bin seam-example
  echo "built in $(( $(date +%s) - started )) s"
  started=$(date +%s)
  SEAM_CONFORMANCE_REAL_MODEL=0 cargo test -q --test conformance
  echo "conformance on the tiny models: $(( $(date +%s) - started )) s (run included)"
  ./target/debug/seam-example backends | grep -E "^(example|reference)"
  ./target/debug/seam-example backends --json | python3 -c \
    'import json,sys; names=[b["name"] for b in json.load(sys.stdin)]; assert "example" in names, names; print("listed:", names)'
)
echo "seam's home for the vendor: $home/seam ($(du -sh "$home/seam" 2>/dev/null | cut -f1))"

# Nothing new in the checkout: no file outside git's index (a model, a cache, a download; the
# checkout's own target folder aside) appeared or changed during the run. Tracked files are left
# out so that editing the checkout meanwhile is not reported.
# (find's status is ignored: a file listed and then removed before find looks, by whatever else runs
# in the checkout, is no write of the vendor's. Left to `set -e`, it ended the script silently.)
untracked="$work/untracked"
(cd "$seam_root" && git ls-files --others -z) > "$untracked"
written=$(cd "$seam_root" && { grep -zv '^target/' "$untracked" || true; } \
  | { xargs -0 -r find -newer "$marker" -type f 2>/dev/null || true; } | head -20)
if [ -n "$written" ]; then
  echo "written into the seam checkout:"; echo "$written"; exit 1
fi
echo "nothing written into $seam_root"
