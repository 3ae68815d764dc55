#!/usr/bin/env python3
"""Load on an OpenAI-compatible server (seam serve, llama-server): streamed completions from N
clients at once, each sending requests one after another. Standard library only.

  serve_load.py --url http://127.0.0.1:8080/v1 --concurrency 8 --requests 4 --max-tokens 64

Every request asks for exactly --max-tokens tokens (ignore_eos) at temperature 0 and streams them;
the answer must end with [DONE] and a finish reason, or it counts as failed. Prints one JSON
object: aggregate completion tokens per second over the wall time of the whole run, time to first
token and inter-token latency percentiles (nearest rank), failures.
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse

PROMPT = (
    "The lighthouse keeper wrote in his log every evening. Tonight the sea was calm, the lamp was "
    "clean, and the supply boat was late again. He began to write about"
)


def percentile(values, p):
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-p * len(ordered) // 100))))
    return ordered[rank - 1]


def one_request(url, model, max_tokens, timeout):
    """Streams one completion; returns (ok, completion tokens, ttft s, [inter-token s])."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    started = time.perf_counter()
    connection.request("POST", parts.path.rstrip("/") + "/completions", json.dumps(body),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        response.read()
        return False, 0, None, []
    first, last, gaps, chunks, usage, finished, done = None, None, [], 0, None, False, False
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                now = time.perf_counter()
                if first is None:
                    first = now - started
                else:
                    gaps.append(now - last)
                last = now
                chunks += 1
            if choice.get("finish_reason"):
                finished = True
    connection.close()
    tokens = usage if usage is not None else chunks
    return done and finished, tokens, first, gaps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="base URL, ending in /v1")
    parser.add_argument("--model", default="", help="model id to send (default: none)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    results, lock = [], threading.Lock()

    def client():
        for _ in range(args.requests):
            try:
                outcome = one_request(args.url, args.model, args.max_tokens, args.timeout)
            except (OSError, http.client.HTTPException, ValueError):
                outcome = (False, 0, None, [])
            with lock:
                results.append(outcome)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started

    ok = [r for r in results if r[0]]
    tokens = sum(r[1] for r in ok)
    ttft = [r[2] for r in ok if r[2] is not None]
    gaps = [g for r in ok for g in r[3]]
    ms = lambda v: None if v is None else round(v * 1000, 2)
    print(json.dumps({
        "concurrency": args.concurrency,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "short": sum(1 for r in ok if r[1] != args.max_tokens),
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(gaps, 50)),
        "itl_p99_ms": ms(percentile(gaps, 99)),
    }))


if __name__ == "__main__":
    main()
