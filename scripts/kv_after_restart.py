#!/usr/bin/env python3
"""Requests of a KV-events bench run's restart workload that went to the restarted replica.

For each `logs/<run>.requests.jsonl` of `inferlb-bench --kv-events-bench --kv-workloads restart`:
the requests sent through the front (not straight to a replica) to the restarted replica (gpu1)
in the 15 s after its restart (when the request a third of the way in is due), how many of those
were routed warm (`prefix` or `pinned`), and how many of those found nothing cached: turns sent
there counted warm by a front that did not know the replica had restarted.

    scripts/kv_after_restart.py OUT/logs/kv-events-restart-*.requests.jsonl
"""

import json
import sys

RESTARTED = "gpu1"
WINDOW_MS = 15_000


def main(paths):
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not rows:
            continue
        due = len(rows) // 3
        t0 = next(r["at_ms"] for r in rows if r["index"] == due)
        after = [
            r
            for r in rows
            if not r["direct"]
            and r.get("replica") == RESTARTED
            and t0 <= r["at_ms"] < t0 + WINDOW_MS
        ]
        warm = [r for r in after if r.get("route") in ("prefix", "pinned")]
        found_nothing = [r for r in warm if r.get("usage") and r["usage"][1] == 0]
        name = path.rsplit("/", 1)[-1]
        print(
            f"{name}: to {RESTARTED} {len(after)}, routed warm {len(warm)}, "
            f"of those found nothing {len(found_nothing)}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
