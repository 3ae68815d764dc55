#!/usr/bin/env bash
# seam serve against llama.cpp's llama-server on the same CPU and the same weights (a Q4_1 GGUF
# that seam's int4 carries exactly), at several concurrencies.
#
#   scripts/compare-serve.sh [--model smollm2|llama-3.2-1b] [--backends iree-cpu,pjrt-cpu]
#                            [--concurrency "1 4 8 16"]
#                            [--requests N] [--max-tokens N] [--out FILE] [--set KEY=VALUE ...]
#
# Builds llama-server from the pinned llama-cpp-python source tarball (scripts/build-llama-bench.sh)
# and starts it with --parallel (the largest concurrency) and continuous batching; starts `seam
# serve --weights int4` with the same --parallel on each backend; at each concurrency runs
# scripts/serve_load.py (N clients, each sending --requests streamed completions of exactly
# --max-tokens tokens) against both, and prints aggregate tokens/s, time to first token and
# inter-token latency side by side, with seam/llama-server ratios. Results: one JSON file.
# --set passes a backend setting to seam serve (e.g. activations=int8, ADR 0024). Models as in
# scripts/compare-llama-cpp.sh: the default model, or the Llama 3.2 1B shape with random weights
# (the answers are noise; `ignore_eos` keeps every one at --max-tokens).
set -euo pipefail
cd "$(dirname "$0")/.."

model=smollm2
backends="iree-cpu,pjrt-cpu"
levels="1 4 8 16"
requests=3
max_tokens=64
out=""
settings=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --backends) backends="$2"; shift 2 ;;
    --concurrency) levels="$2"; shift 2 ;;
    --requests) requests="$2"; shift 2 ;;
    --max-tokens) max_tokens="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --set) settings+=(--set "$2"); shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

# shellcheck source=scripts/llama-cpp-common.sh
source scripts/llama-cpp-common.sh
build_seam
model_ggufs "$model"
step "llama-server"
llama_server="$(scripts/build-llama-bench.sh llama-server)"
out="${out:-$work/results/serve-$model-$stamp.json}"
parallel=0
for level in $levels; do [ "$level" -gt "$parallel" ] && parallel="$level"; done
port=18700
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_healthy() {  # port pid log
  # seam serve compiles every graph it may use before it listens (minutes on a cold cache).
  for _ in $(seq 1 2400); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    if ! kill -0 "$2" 2>/dev/null; then
      echo "the server on port $1 exited before it answered; the end of $3:" >&2
      tail -5 "$3" >&2
      return 1
    fi
    sleep 0.5
  done
  echo "the server on port $1 did not become healthy" >&2
  return 1
}

results="$(mktemp)"
measure() {  # name port pid
  # A discarded pass at every concurrency first: graphs a server compiles or loads on first use
  # (seam's batched decode graphs) are then not timed.
  step "$1: warm-up"
  for level in $levels; do
    python3 scripts/serve_load.py --url "http://127.0.0.1:$2/v1" --concurrency "$level" --requests 1 \
      --max-tokens 8 >/dev/null
  done
  for level in $levels; do
    step "$1 at concurrency $level"
    line="$(python3 scripts/serve_load.py --url "http://127.0.0.1:$2/v1" --concurrency "$level" \
      --requests "$requests" --max-tokens "$max_tokens")"
    echo "{\"server\": \"$1\", \"result\": $line}" >>"$results"
  done
  kill "$3"; wait "$3" 2>/dev/null || true
}

# Context per slot: enough for the prompt and the tokens, the same on both sides.
context=$((parallel * 512))
"$llama_server" -m "$q4_1" --host 127.0.0.1 --port "$port" --parallel "$parallel" --cont-batching \
  -c "$context" -t "$(nproc)" >"$work/results/llama-server.log" 2>&1 &
pids+=($!)
wait_healthy "$port" "${pids[-1]}" "$work/results/llama-server.log"
measure llama-server "$port" "${pids[-1]}"

IFS=',' read -ra backend_list <<<"$backends"
for backend in "${backend_list[@]}"; do
  port=$((port + 1))
  step "seam serve --backend $backend --weights int4"
  "$seam" serve --backend "$backend" --weights int4 --model "$model_dir" --port "$port" \
    --parallel "$parallel" --max-context 512 ${settings[@]+"${settings[@]}"} >"$work/results/seam-serve-$backend.log" 2>&1 &
  pids+=($!)
  wait_healthy "$port" "${pids[-1]}" "$work/results/seam-serve-$backend.log"
  measure "$backend" "$port" "${pids[-1]}"
done

python3 - "$results" "$out" "$(nproc)" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = {r["result"]["concurrency"]: r["result"] for r in rows if r["server"] == "llama-server"}
print(f"{'server':<14}{'conc':>5}{'tok/s':>9}{'x llama':>9}{'ttft p50':>10}{'ttft p99':>10}{'itl p50':>9}{'itl p99':>9}{'failed':>7}")
for r in rows:
    res, ref = r["result"], base.get(r["result"]["concurrency"])
    ratio = res["aggregate_tokens_per_s"] / ref["aggregate_tokens_per_s"] if ref and ref["aggregate_tokens_per_s"] else None
    print(f"{r['server']:<14}{res['concurrency']:>5}{res['aggregate_tokens_per_s']:>9}"
          f"{(f'{ratio:.2f}' if ratio else '-'):>9}{res['ttft_p50_ms']:>10}{res['ttft_p99_ms']:>10}"
          f"{res['itl_p50_ms']:>9}{res['itl_p99_ms']:>9}{res['failed'] + res['short']:>7}")
json.dump({"machine": {"cpu": sys.argv[4], "cores": int(sys.argv[3])}, "rows": rows}, open(sys.argv[2], "w"), indent=2)
print(f"written: {sys.argv[2]}")
PY
rm -f "$results"
