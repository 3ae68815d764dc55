#!/usr/bin/env bash
# seam's perplexity and KL divergence against llama.cpp's llama-perplexity, on the same text,
# windows and weights, in one invocation (docs/quality.md).
#
#   scripts/compare-perplexity.sh [--ctx N] [--chunks N] [--backends reference,iree-cpu]
#                                 [--text FILE] [--threads N] [--out FILE]
#
# The default model (SmolLM2-135M-Instruct): llama.cpp runs its original Q4_1 GGUF and the F16
# export of seam's fp16 weights (the Q4_1 dequantized, made by `seam export-gguf` as
# scripts/compare-llama-cpp.sh makes it); seam runs its fp16 and int4 weights on every backend of
# --backends (default: reference). Both sides save the F16 run's logits and compare the Q4_1 /
# int4 run against them (llama-perplexity --kl-divergence-base, then --kl-divergence; seam
# perplexity --save-logits, then --kl-divergence). The text is seam's default evaluation text
# (four Shakespeare tragedies, fetched by the first seam run) unless --text names another.
#
# llama-perplexity is built from the pinned llama.cpp of scripts/build-llama-bench.sh (a small
# compile once llama-bench is built). llama.cpp's KL base file holds every log-probability: about
# 25 MB per window of 512 for a 49k vocabulary, so it lives in a temporary folder for the run.
# A full pass over the default text (354 windows of 512) decodes every scored token one step at a
# time on each seam run; --chunks (default 20) keeps the comparison short.
#
# Writes one JSON file with both sides' figures (default .seam/llama.cpp/results/perplexity-*.json)
# and prints a summary table.
set -euo pipefail
cd "$(dirname "$0")/.."

ctx=512
chunks=20
backends="reference"
text=""
threads="$(nproc)"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ctx) ctx="$2"; shift 2 ;;
    --chunks) chunks="$2"; shift 2 ;;
    --backends) backends="$2"; shift 2 ;;
    --text) text="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

# shellcheck source=scripts/llama-cpp-common.sh
source scripts/llama-cpp-common.sh
out="${out:-$work/results/perplexity-$stamp.json}"

step "llama-perplexity (scripts/build-llama-bench.sh llama-perplexity)"
llama_perplexity="$(scripts/build-llama-bench.sh llama-perplexity)"

build_seam
default_model_ggufs

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

text_args=()
[ -n "$text" ] && text_args=(--file "$text")
IFS=',' read -r -a names <<< "$backends"
seam_reports=()
for b in "${names[@]}"; do
  common=(perplexity --backend "$b" --model "$model_dir" --ctx "$ctx" --chunks "$chunks" "${text_args[@]}" --json)
  step "seam ${common[*]} --weights f16 --save-logits"
  "$seam" "${common[@]}" --weights f16 --save-logits "$tmp/seam-$b-f16.logits" > "$tmp/seam-$b-f16.json"
  step "seam ${common[*]} --weights int4 --kl-divergence"
  "$seam" "${common[@]}" --weights int4 --kl-divergence "$tmp/seam-$b-f16.logits" > "$tmp/seam-$b-int4.json"
  seam_reports+=("$b=$tmp/seam-$b-f16.json,$tmp/seam-$b-int4.json")
done
# The text the seam runs read (the default one is fetched by the first run).
if [ -z "$text" ]; then
  text="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["text"])' "$tmp/seam-${names[0]}-f16.json")"
fi

llama_args=(-f "$text" -c "$ctx" --chunks "$chunks" -t "$threads")
step "llama-perplexity -m $(basename "$f16") ${llama_args[*]} --kl-divergence-base"
"$llama_perplexity" -m "$f16" "${llama_args[@]}" --kl-divergence-base "$tmp/llama-f16.kld" > "$tmp/llama-f16.log" 2>&1 ||
  { tail -20 "$tmp/llama-f16.log" >&2; exit 1; }
step "llama-perplexity -m $(basename "$q4_1") ${llama_args[*]} --kl-divergence-base --kl-divergence"
"$llama_perplexity" -m "$q4_1" "${llama_args[@]}" --kl-divergence-base "$tmp/llama-f16.kld" --kl-divergence > "$tmp/llama-q4_1.log" 2>&1 ||
  { tail -20 "$tmp/llama-q4_1.log" >&2; exit 1; }

llama_version="$("$llama_perplexity" --version 2>&1 | head -1 || true)"
seam_commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
python3 - "$out" "$tmp/llama-f16.log" "$tmp/llama-q4_1.log" "$text" "$ctx" "$chunks" "$llama_version" "$seam_commit" \
  "$f16" "$q4_1" "$model_dir" "scripts/compare-perplexity.sh --ctx $ctx --chunks $chunks --backends $backends --threads $threads" \
  "${seam_reports[@]}" <<'PY'
import hashlib, json, re, sys

(out, llama_f16_log, llama_q4_log, text, ctx, chunks, llama_version, seam_commit,
 f16_gguf, q4_1_gguf, model_dir, command, *seam_reports) = sys.argv[1:]


def number(pattern, log, group=1):
    match = re.search(pattern, log)
    if not match:
        sys.exit(f"llama-perplexity printed no line matching {pattern!r}")
    return float(match.group(group))


def llama_f16(log):
    """llama-perplexity's perplexity mode: `Final estimate: PPL = X +/- Y`."""
    return {
        "perplexity": number(r"Final estimate: PPL = ([0-9.]+) \+/- [0-9.]+", log),
        "uncertainty": number(r"Final estimate: PPL = [0-9.]+ \+/- ([0-9.]+)", log),
    }


def llama_kl(log):
    """llama-perplexity's --kl-divergence statistics (printed from 100 scored tokens on)."""
    value = r"\s*:?\s*(-?[0-9.]+)"
    return {
        "perplexity": number(r"Mean PPL\(Q\)" + value, log),
        "uncertainty": number(r"Mean PPL\(Q\)\s*:\s*[0-9.]+\s*±\s*([0-9.]+)", log),
        "ppl_base": number(r"Mean PPL\(base\)" + value, log),
        "ppl_ratio": number(r"Mean PPL\(Q\)/PPL\(base\)" + value, log),
        "mean_kl": number(r"Mean    KLD:" + value, log),
        "p99_kl": number(r"99\.0%   KLD:" + value, log),
        "max_kl": number(r"Maximum KLD:" + value, log),
        "top1_agreement": number(r"Same top p:\s*([0-9.]+)", log) / 100.0,
    }


with open(llama_f16_log) as f:
    f16_log = f.read()
with open(llama_q4_log) as f:
    q4_log = f.read()
with open(text, "rb") as f:
    text_sha256 = hashlib.sha256(f.read()).hexdigest()
report = {
    "context": {
        "command": command, "text": text, "text_sha256": text_sha256, "ctx": int(ctx), "chunks": int(chunks),
        "llama_cpp": llama_version, "llama_cpp_python": "0.3.36", "seam_commit": seam_commit,
        "ggufs": {"f16": f16_gguf, "q4_1": q4_1_gguf}, "seam_model": model_dir,
    },
    "llama_cpp": {"f16": llama_f16(f16_log), "q4_1": llama_kl(q4_log)},
    "seam": {},
}
for entry in seam_reports:
    backend, files = entry.split("=", 1)
    f16_file, int4_file = files.split(",")
    report["seam"][backend] = {"f16": json.load(open(f16_file)), "int4": json.load(open(int4_file))}
with open(out, "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")

rows = [("llama.cpp", "F16", report["llama_cpp"]["f16"], None), ("llama.cpp", "Q4_1", report["llama_cpp"]["q4_1"], report["llama_cpp"]["q4_1"])]
for backend, runs in report["seam"].items():
    rows.append((f"seam {backend}", "f16", runs["f16"], None))
    rows.append((f"seam {backend}", "int4", runs["int4"], runs["int4"]["kl_divergence"]))
print(f"perplexity, ctx {ctx}, {chunks} chunks of {text}")
print(f"{'':<18} {'weights':<8} {'PPL':>10} {'+/-':>9} {'mean KL':>10} {'p99 KL':>10} {'top-1':>8} {'PPL ratio':>10}")
for who, weights, ppl, kl in rows:
    line = f"{who:<18} {weights:<8} {ppl['perplexity']:>10.4f} {ppl['uncertainty']:>9.5f}"
    if kl:
        line += f" {kl['mean_kl']:>10.6f} {kl['p99_kl']:>10.6f} {100 * kl['top1_agreement']:>7.2f}% {kl['ppl_ratio']:>10.6f}"
    print(line)
print(f"written to {out}")
PY
