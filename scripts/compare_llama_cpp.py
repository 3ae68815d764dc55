#!/usr/bin/env python3
"""Ratios of `seam bench` against `llama-bench` on the same weights (scripts/compare-llama-cpp.sh).

  compare_llama_cpp.py --seam SEAM.json --llama f16=F16.json --llama int4=Q4_1.json --out ALL.json

seam's int4 is compared with llama.cpp's Q4_1 and seam's fp16 with llama.cpp's F16 (the same
weights: the F16 GGUF is the Q4_1 one dequantized, and seam's int4 carries Q4_1 blocks exactly).
Throughputs are medians (seam) and means (llama-bench's avg_ts); a ratio above 1 means seam is
faster. Also printed, per seam backend: the targets of issue 6 that are not about llama.cpp
(int4 decode vs fp16 decode, warm load, int4 weight bytes vs fp16), and the start-up targets of
issue 20: a new `seam run --max-tokens 1` process against llama.cpp's whole process on the same
file (`llama-bench -p 0 -n 1 -r 1`, medians of the runs), and that process's RSS after its load
over the weight bytes.
"""

import argparse
import json
import sys
from statistics import median


def llama_decode_depth(entries):
    """The context before llama-bench's decode runs (`-d`), 0 where it has none."""
    return next((e.get("n_depth", 0) for e in entries if e.get("n_prompt", 0) == 0 and e.get("n_gen", 0) > 0), 0)


def llama_rates(entries):
    """{('prefill', n) | ('decode', n): tokens/s} from llama-bench's JSON output."""
    rates = {}
    for e in entries:
        if e.get("n_gen", 0) == 0 and e.get("n_prompt", 0) > 0:
            rates[("prefill", e["n_prompt"])] = e["avg_ts"]
        elif e.get("n_prompt", 0) == 0 and e.get("n_gen", 0) > 0:
            rates[("decode", e["n_gen"])] = e["avg_ts"]
    return rates


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seam", required=True)
    parser.add_argument("--llama", action="append", default=[], help="FORMAT=llama-bench.json (f16 or int4)")
    parser.add_argument("--llama-process", action="append", default=[], help="FORMAT=whole-process.json (f16 or int4)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", default="{}", help="JSON object merged into the output (commands, versions)")
    args = parser.parse_args()

    seam = json.load(open(args.seam))
    llama = {}
    llama_raw = {}
    for item in args.llama:
        fmt_name, path = item.split("=", 1)
        entries = json.load(open(path))
        llama_raw[fmt_name] = entries
        llama[fmt_name] = llama_rates(entries)

    llama_process = {}
    for item in args.llama_process:
        fmt_name, path = item.split("=", 1)
        llama_process[fmt_name] = json.load(open(path))

    lengths = seam["settings"]["prompt_lengths"]
    seam_depth = seam["settings"].get("decode_prompt_tokens", 16)
    llama_depths = sorted({llama_decode_depth(entries) for entries in llama_raw.values()})
    print(f"decode after {seam_depth} tokens of context (seam) and {', '.join(map(str, llama_depths)) or '-'} (llama.cpp)")
    rows = []
    for r in seam["results"]:
        ref = llama.get(r["weights"], {})
        decode = r["decode"]["tokens_per_s"]["median"]
        llama_decode = next((v for (kind, _), v in ref.items() if kind == "decode"), None)
        row = {
            "backend": r["backend"],
            "weights": r["weights"],
            "llama_cpp_type": {"f16": "F16", "int4": "Q4_1"}.get(r["weights"]),
            "decode_tokens_per_s": decode,
            "llama_cpp_decode_tokens_per_s": llama_decode,
            "decode_ratio": ratio(decode, llama_decode),
            "prefill": [],
        }
        for p in r["prefill"]:
            n = p["prompt_tokens"]
            ours = p["tokens_per_s"]["median"]
            theirs = ref.get(("prefill", n))
            row["prefill"].append({"prompt_tokens": n, "tokens_per_s": ours, "llama_cpp_tokens_per_s": theirs, "ratio": ratio(ours, theirs)})
        rows.append(row)

    header = f"{'backend':<10} {'wts':<5} {'vs':<5} {'decode t/s':>10} {'llama.cpp':>10} {'ratio':>6}"
    for n in lengths:
        header += f" {'pp' + str(n):>7} {'llama':>7} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for row in rows:
        line = f"{row['backend']:<10} {row['weights']:<5} {row['llama_cpp_type'] or '-':<5} {fmt(row['decode_tokens_per_s']):>10} {fmt(row['llama_cpp_decode_tokens_per_s']):>10} {fmt(row['decode_ratio'], 2):>6}"
        for p in row["prefill"]:
            line += f" {fmt(p['tokens_per_s']):>7} {fmt(p['llama_cpp_tokens_per_s']):>7} {fmt(p['ratio'], 2):>6}"
        print(line)

    print()
    print("per seam backend: int4 decode / fp16 decode (target >= 1.5), warm load (target < 2 s), int4 weight bytes / fp16 (target <= 0.35)")
    by_backend = {}
    for r in seam["results"]:
        by_backend.setdefault(r["backend"], {})[r["weights"]] = r
    targets = {}
    for backend, formats in by_backend.items():
        f16, int4 = formats.get("f16"), formats.get("int4")
        t = {
            "int4_over_fp16_decode": ratio(int4 and int4["decode"]["tokens_per_s"]["median"], f16 and f16["decode"]["tokens_per_s"]["median"]),
            "warm_load_s": {w: (r["load_warm_ms"] / 1000 if r.get("load_warm_ms") is not None else None) for w, r in formats.items()},
            "int4_over_fp16_weight_bytes": ratio(int4 and int4["weight_bytes"], f16 and f16["weight_bytes"]),
        }
        targets[backend] = t
        warm = ", ".join(f"{w} {fmt(s, 2)} s" for w, s in t["warm_load_s"].items())
        print(f"  {backend:<10} int4/fp16 decode {fmt(t['int4_over_fp16_decode'], 2)}x   warm load {warm}   int4/fp16 bytes {fmt(t['int4_over_fp16_weight_bytes'], 2)}x")

    print()
    print("start-up: a new `seam run --max-tokens 1` process / llama.cpp's whole process (target <= 1.5), RSS after load / weights (target <= 1.15)")
    for r in seam["results"]:
        process = r.get("process")
        theirs = llama_process.get(r["weights"])
        if not process:
            continue
        ours_ms = process["wall_ms"]["median"]
        their_ms = median(theirs["wall_ms"]) if theirs else None
        rss = process.get("rss_after_load_bytes")
        rss_ratio = ratio(rss and rss["median"], r["weight_bytes"])
        targets[r["backend"]].setdefault("start", {})[r["weights"]] = {
            "seam_process_ms": ours_ms,
            "llama_cpp_process_ms": their_ms,
            "ratio": ratio(ours_ms, their_ms),
            "rss_after_load_over_weights": rss_ratio,
        }
        print(
            f"  {r['backend']:<10} {r['weights']:<5} {fmt(ours_ms / 1000, 2)} s / {fmt(their_ms and their_ms / 1000, 2)} s"
            f" = {fmt(ratio(ours_ms, their_ms), 2)}x   RSS after load {fmt(rss and rss['median'] / 1e6, 0)} MB"
            f" / weights {fmt(r['weight_bytes'] / 1e6, 0)} MB = {fmt(rss_ratio, 2)}x"
        )

    out = {"context": json.loads(args.context), "seam": seam, "llama_cpp": llama_raw, "llama_cpp_process": llama_process, "comparison": rows, "targets": targets}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
