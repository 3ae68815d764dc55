#!/usr/bin/env bash
# Bounded soaks for docs/reliability.md (issue 17), not part of the test command: they take
# minutes to an hour.
#
#   scripts/soak.sh sessions   [--sessions N] [--backends reference,pjrt,iree]
#   scripts/soak.sh interrupts [--runs N] [--max-delay S] [--backends reference,pjrt,iree]
#
# sessions:   the conformance memory case with N sessions (default 1000) created, prefilled,
#             stepped and dropped on one engine per backend; passes when resident memory grows
#             less than its tolerance (crates/conformance/src/cases/memory.rs).
# interrupts: N (default 1000) `seam run` processes on a copy of the default model, each sent
#             SIGINT (every tenth SIGKILL) after a random delay of up to S seconds (default 0.6: a warm run of the default
#             model takes about that long, so most runs are cut somewhere),
#             rotating over backends and both weight formats, with a cache folder that starts
#             empty, so that compiles, int4 and prepared-weight writes are cut at every stage.
#             Then one complete run per backend and format must succeed with the greedy tokens
#             of a run made before the soak, and no temporary (`.*.tmp`, `*.partial`) may be
#             left in the model copy or the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build-prereqs.sh >/dev/null

mode="${1:-}"
shift || true
sessions=1000
runs=1000
max_delay=0.6
backends="reference,pjrt,iree"
while [ $# -gt 0 ]; do
  case "$1" in
    --sessions) sessions="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --max-delay) max_delay="$2"; shift 2 ;;
    --backends) backends="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

cargo build -q -p cli
seam=target/debug/seam
model_src=$("$seam" convert --default-model 2>/dev/null | tail -1)

case "$mode" in
  sessions)
    for b in ${backends//,/ }; do
      for w in f16 int4; do
        echo "== $b $w: $sessions sessions"
        SEAM_MEMORY_CASE_SESSIONS="$sessions" "$seam" conformance --backend "$b" --weights "$w" \
          --cases kv.many_sessions_memory
      done
    done
    ;;
  interrupts)
    work=$(mktemp -d /tmp/seam-soak.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    cp -r "$model_src" "$work/model"
    export SEAM_CACHE_DIR="$work/cache"
    prompt="The capital of France is"
    combos=()
    for b in ${backends//,/ }; do for w in f16 int4; do combos+=("$b:$w"); done; done
    declare -A expected
    for c in "${combos[@]}"; do
      # The expected tokens come from the project's own caches and the original model.
      expected[$c]=$(SEAM_CACHE_DIR= "$seam" run --backend "${c%%:*}" --weights "${c##*:}" --model "$model_src" \
        --prompt "$prompt" --max-tokens 8 --ignore-eos --json 2>/dev/null | python3 -c \
        'import json,sys; print(json.load(sys.stdin)["token_ids"])')
    done
    # Job control on: a non-interactive shell would start background jobs with SIGINT ignored.
    set -m
    # bash reports each signalled job on stderr; the soak's own lines go to stdout.
    exec 3>&2 2>/dev/null
    interrupted=0 finished=0 failed=0
    started=$(date +%s)
    for i in $(seq 1 "$runs"); do
      c=${combos[$((i % ${#combos[@]}))]}
      delay=$(python3 -c "import random; print(round(random.uniform(0, $max_delay), 3))")
      signal=INT
      [ $((i % 10)) -eq 0 ] && signal=KILL
      # SIGINT back to its default: a shell started in the background passes it on ignored.
      env --default-signal=INT "$seam" run --backend "${c%%:*}" --weights "${c##*:}" --model "$work/model" \
        --prompt "$prompt" --max-tokens 8 --ignore-eos >/dev/null 2>"$work/last.err" &
      pid=$!
      sleep "$delay"
      # To the process group, as a terminal's Ctrl-C does: a compiler child goes too.
      kill -s "$signal" -- "-$pid" 2>/dev/null || true
      if wait "$pid"; then
        finished=$((finished + 1))
      else
        rc=$?
        interrupted=$((interrupted + 1))
        # 130 / 137 / 143: ended by the signal; anything else is a failure worth reading.
        if [ "$rc" -ne 130 ] && [ "$rc" -ne 137 ] && [ "$rc" -ne 143 ]; then
          interrupted=$((interrupted - 1)); failed=$((failed + 1)); echo "run $i ($c, $signal after ${delay}s): exit $rc"; tail -3 "$work/last.err"
        fi
      fi
      if [ $((i % 100)) -eq 0 ]; then
        echo "$i runs: $interrupted ended by the signal, $finished exited 0, $failed failures ($(( $(date +%s) - started )) s)"
      fi
    done
    exec 2>&3
    bad=0
    for c in "${combos[@]}"; do
      got=$("$seam" run --backend "${c%%:*}" --weights "${c##*:}" --model "$work/model" --prompt "$prompt" \
        --max-tokens 8 --ignore-eos --json 2>"$work/last.err" | python3 -c \
        'import json,sys; print(json.load(sys.stdin)["token_ids"])') || { echo "$c: final run failed"; cat "$work/last.err"; bad=1; continue; }
      if [ "$got" != "${expected[$c]}" ]; then echo "$c: tokens $got, expected ${expected[$c]}"; bad=1; fi
    done
    debris=$(find "$work/model" "$work/cache" \( -name '.*.tmp' -o -name '*.partial' \) 2>/dev/null | wc -l)
    echo "interrupts: $runs runs, $interrupted ended by the signal, $finished exited 0, $failed failures;" \
      "final runs $([ $bad -eq 0 ] && echo 'all equal the expected tokens' || echo 'FAILED'); $debris temporaries left"
    find "$work/model" "$work/cache" \( -name '.*.tmp' -o -name '*.partial' \) 2>/dev/null | head
    [ "$failed" -eq 0 ] && [ "$bad" -eq 0 ] && [ "$debris" -eq 0 ]
    ;;
  *)
    echo "usage: scripts/soak.sh sessions|interrupts [options]" >&2
    exit 2
    ;;
esac
