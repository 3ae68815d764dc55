#!/usr/bin/env bash
# A kernel's inner loop through llvm-mca: a static throughput estimate, for kernel changes whose
# wall-clock effect the shared 2-vCPU machines' noise hides (docs/performance.md run 35).
#
#   scripts/kernel-mca.sh [--binary target/debug/seam] [--cpu icelake-server] FUNCTION INSTRUCTION COUNT
#
# Among the functions of the binary whose demangled name contains FUNCTION (e.g.
# `panels::x86::int4_panel`), takes the instance with COUNT occurrences of INSTRUCTION (e.g.
# `vpdpbusd 64`: the eight-token, one-part instance), and in it the loop (a backward jump's body)
# with the most INSTRUCTION; prints the loop's instruction mix and llvm-mca's summary and port
# pressure for --cpu (`llvm-mca -mcpu=help` lists the models). Needs objdump and llvm-mca (Debian:
# `apt-get install binutils llvm`). An estimate, not a measurement: say so when quoting it.
set -euo pipefail
cd "$(dirname "$0")/.."

binary="target/debug/seam"
cpu="icelake-server"
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) binary="$2"; shift 2 ;;
    --cpu) cpu="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
if [ $# -ne 3 ]; then
  echo "usage: scripts/kernel-mca.sh [--binary B] [--cpu C] FUNCTION INSTRUCTION COUNT (see --help)" >&2
  exit 2
fi
function="$1" instruction="$2" count="$3"
for tool in nm objdump llvm-mca; do
  command -v "$tool" >/dev/null || { echo "$tool is missing (Debian: apt-get install binutils llvm)" >&2; exit 1; }
done
[ -f "$binary" ] || { echo "no binary at $binary (build it first: cargo build -p cli)" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Each instance (address and size from `nm -S`, names demangled), disassembled until one has
# COUNT of the instruction.
found=""
while read -r address size; do
  objdump -d --no-show-raw-insn --start-address=$((16#$address)) \
    --stop-address=$((16#$address + 16#$size)) "$binary" | grep -E '^ +[0-9a-f]+:' >"$work/fn" || true
  if [ "$(grep -c -w "$instruction" "$work/fn" || true)" = "$count" ]; then
    found="$address"
    break
  fi
done < <(nm -C -S --defined-only "$binary" | grep -F "$function" | awk '$3 ~ /^[tT]$/ {print $1, $2}')
[ -n "$found" ] || { echo "no instance of '$function' with $count x $instruction in $binary" >&2; exit 1; }

# The backward jump whose body holds the most of the instruction.
best=0
while read -r line; do
  from="$(echo "$line" | awk -F: '{gsub(/ /, "", $1); print $1}')"
  to="$(echo "$line" | sed -E 's/.*\sj[a-z]+ +([0-9a-f]+) .*/\1/')"
  [ $((16#$to)) -lt $((16#$from)) ] || continue
  awk -v s="$to:" -v e="$from:" '$1 == s {on = 1} on {print} $1 == e {on = 0}' "$work/fn" >"$work/body"
  n="$(grep -c -w "$instruction" "$work/body" || true)"
  if [ "$n" -gt "$best" ]; then best="$n"; cp "$work/body" "$work/loop"; fi
done < <(grep -E '\sj[a-z]+ +[0-9a-f]+ <' "$work/fn")
[ "$best" -gt 0 ] || { echo "no loop with $instruction in the instance at 0x$found" >&2; exit 1; }

sed -E 's/^ *[0-9a-f]+:\t//; s/<.*>//' "$work/loop" >"$work/loop.s"
echo "== $function at 0x$found: loop of $(wc -l <"$work/loop.s") instructions, $best x $instruction"
awk '{print $1}' "$work/loop.s" | sort | uniq -c | sort -rn | head -20
echo "== llvm-mca -mcpu=$cpu"
llvm-mca -mcpu="$cpu" -iterations=300 "$work/loop.s" 2>&1 |
  sed -n '/^Iterations/,/^Block RThroughput/p; /^Resources:/,/^$/p; /Resource pressure per iteration/,+3p'
