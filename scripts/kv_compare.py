#!/usr/bin/env python3
"""Compares two fronts' runs of the KV-events bench request by request.

Each run of `inferlb-bench --kv-events-bench` writes `logs/<run>.requests.jsonl`: one line per
trace request, with the replica that served it, its usage (prompt and cached tokens) and, through
inferlb, its `x-inferlb-route`. Given two such files of the same workload (A and B) and the
trace, this prints every request whose cached tokens differ between them, with:

- A's route (`spilled`: a replica held part of it and A went elsewhere; `spread`: no replica
  held any of it, by A's index);
- the earlier request sharing the longest prefix with it (the latest of those), how long
  before it was sent, and how
  many new (uncached) prompt tokens that request's replica took in between under each front:
  the pressure that evicted, or did not evict, the shared prefix.

Then a summary: requests with any cached token under each, and the tokens each gained over
the other, by A's route.

    scripts/kv_compare.py OUT/logs/kv-events-replay-events-500000-1.requests.jsonl \
        OUT/logs/kv-events-replay-smg-500000-1.requests.jsonl \
        --trace ../shared/traces/mooncake_synthetic_trace.jsonl
"""

import argparse
import collections
import json
import sys


def load_run(path):
    """The run's requests by trace index."""
    with open(path, encoding="utf-8") as f:
        return {r["index"]: r for r in (json.loads(line) for line in f if line.strip())}


def load_trace(path, n):
    """The first `n` requests' block hashes."""
    hashes = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(hashes) == n:
                break
            hashes.append(json.loads(line)["hash_ids"])
    return hashes


def shared_blocks(a, b):
    """Leading blocks two requests share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cached(r):
    usage = r.get("usage") if r else None
    return usage[1] if usage else 0


def new_tokens(run, earlier, later):
    """Uncached prompt tokens the replica of request `earlier` took in after it was sent and
    before `later` was, and how many requests brought them."""
    replica = run[earlier].get("replica")
    start, end = run[earlier]["at_ms"], run[later]["at_ms"]
    tokens = count = 0
    for i, r in run.items():
        if i == earlier or r.get("replica") != replica or not r.get("usage"):
            continue
        if start <= r["at_ms"] < end:
            tokens += r["usage"][0] - r["usage"][1]
            count += 1
    return tokens, count


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="front A's requests.jsonl (inferlb: it records routes)")
    p.add_argument("b", help="front B's requests.jsonl, the same workload")
    p.add_argument("--trace", required=True, help="the trace the bench replayed")
    args = p.parse_args()
    a, b = load_run(args.a), load_run(args.b)
    if not a or not b:
        print("a run has no requests", file=sys.stderr)
        return 1
    trace = load_trace(args.trace, max(max(a), max(b)) + 1)
    gained = {"A": collections.Counter(), "B": collections.Counter()}
    both = set(a) & set(b)
    for i in sorted(both):
        # A request that failed in either run has no usage to compare.
        if a[i].get("failed") or b[i].get("failed"):
            continue
        ca, cb = cached(a[i]), cached(b[i])
        if ca == cb:
            continue
        route = a[i].get("route") or "-"
        gained["A" if ca > cb else "B"][route] += abs(ca - cb)
        # The earlier request sharing the longest prefix with it, the latest of those.
        shares = [(shared_blocks(trace[i], trace[j]), j) for j in range(i) if j in both]
        longest = max(shares, default=(0, None))
        line = f"{i}: cached A {ca} ({a[i].get('replica')}, {route}) B {cb} ({b[i].get('replica')})"
        if longest[0] > 0:
            j = longest[1]
            gap = (a[i]["at_ms"] - a[j]["at_ms"]) / 1000
            ta, na = new_tokens(a, j, i)
            tb, nb = new_tokens(b, j, i)
            line += (
                f"; shares {shared_blocks(trace[i], trace[j])} blocks with {j}, {gap:.1f} s"
                f" earlier; its replica took in since: A {ta // 1000}k tokens ({na} requests)"
                f" on {a[j].get('replica')}, B {tb // 1000}k ({nb}) on {b[j].get('replica')}"
            )
        print(line)
    hits = [sum(1 for r in run.values() if cached(r) > 0) for run in (a, b)]
    routes = collections.Counter(r.get("route") or "-" for r in a.values())
    print(f"requests with a cached token: A {hits[0]} of {len(a)}, B {hits[1]} of {len(b)}")
    print(f"A's routes: {dict(routes)}")
    for side in ("A", "B"):
        print(f"tokens {side} cached beyond the other, by A's route: {dict(gained[side])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
