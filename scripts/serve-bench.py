#!/usr/bin/env python3
"""Load on a running OpenAI-compatible server (sieve serve, llama.cpp's llama-server, ...).

    serve-bench.py BASE_URL [--clients N] [--requests M] [--max-tokens T] [--prompt-words W]
                   [--api-key KEY] [--model NAME] [--json PATH]

N clients each send M streamed /v1/completions requests one after another, every prompt
distinct (W words), temperature 0, `max_tokens` T (the server may stop earlier at an end
token; what counts is the tokens each stream delivered, one per content chunk). Prints the
aggregate throughput (generated tokens / wall time), TTFT (request sent -> first token) and
TPOT (mean gap between a request's later tokens) at p50 / p99, and the tokens per request.
Standard library only, so that it runs on any machine that has Python.
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

WORDS = ("river star bread music tree number boat rain stone cloud field lamp road glass "
         "winter garden letter mountain window candle").split()


def prompt(i, words):
    # A distinct prompt per request: its number and a rotation of the word list.
    body = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))
    return f"Story {i}: {body}. Continue the story:"


def one_request(url, args, i):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
    payload = {
        "prompt": prompt(i, args.prompt_words),
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if args.model:
        payload["model"] = args.model
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(payload), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    stamps = []
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            stamps.append(time.perf_counter())
    conn.close()
    return start, stamps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--api-key")
    ap.add_argument("--model")
    ap.add_argument("--json")
    args = ap.parse_args()
    results, errors = [], []
    lock = threading.Lock()

    def client(c):
        for r in range(args.requests):
            try:
                out = one_request(args.base_url, args, c * args.requests + r)
                with lock:
                    results.append(out)
            except Exception as e:  # noqa: BLE001 - count and report every failure
                with lock:
                    errors.append(repr(e))

    wall0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - wall0
    tokens = sum(len(s) for _, s in results)
    ttft = [s[0] - st for st, s in results if s]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for _, s in results if len(s) > 1]

    def pct(v, q):
        if not v:
            return float("nan")
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))]

    summary = {
        "clients": args.clients,
        "requests": len(results),
        "errors": len(errors),
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_ms_p50": 1e3 * pct(ttft, 0.5),
        "ttft_ms_p99": 1e3 * pct(ttft, 0.99),
        "tpot_ms_p50": 1e3 * pct(tpot, 0.5),
        "tpot_ms_p99": 1e3 * pct(tpot, 0.99),
        "tokens_per_request_mean": statistics.mean(len(s) for _, s in results) if results else 0,
    }
    print(f"{args.base_url}: {args.clients} clients x {args.requests} requests, "
          f"{tokens} tokens in {wall:.2f} s = {summary['tokens_per_s']:.1f} tok/s; "
          f"TTFT p50 {summary['ttft_ms_p50']:.1f} ms p99 {summary['ttft_ms_p99']:.1f} ms; "
          f"TPOT p50 {summary['tpot_ms_p50']:.2f} ms p99 {summary['tpot_ms_p99']:.2f} ms; "
          f"{summary['tokens_per_request_mean']:.1f} tokens/request; {len(errors)} errors")
    for e in errors[:5]:
        print("error:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    raise SystemExit(1 if errors else 0)


if __name__ == "__main__":
    main()
