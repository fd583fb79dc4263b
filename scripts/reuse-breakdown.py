#!/usr/bin/env python3
"""Where a Mooncake window's prefix hits come from, per run of `kv-bench compare --records`.

A trace request *reuses* an earlier one when their first two or more hash blocks (512 tokens
each) agree; every other request can hit at most the first block, which nearly all share. This
script finds each reuse request's source (the earlier request sharing the longest prefix) and
says, per run, how much of the reusable prefix it got back, and whether it went to the pod that
had served its source. With `--logs DIR` (the `--router-metrics` directory of a run made with
`RUST_LOG=kv_router=debug`) it also splits the reuse requests by what the router saw:

- `knows`: the best holder in the router's index held at least 80 % of the reusable prefix;
  `unknown` otherwise (evicted from the index, or its TTL passed).
- `follow`: the chosen pod's match was at least 80 % of the best holder's; `moved`: chosen
  elsewhere by load; `spread`: placed as a new conversation.
- `hit` / `miss`: the pod reported at least half the reusable prefix cached.

With the logs it also says how soon after its source a reuse request was decided, at the
least: replicas sharing an index whose records reach each other sooner than that cannot lose a
reuse hit to the lag.

Decision lines carry no request number: they are matched to requests by time and block count
(`decision_log.py`: a long prompt's line can come after a later short one's). Only block counts
and pod names are read, never prompt text.

Usage: scripts/reuse-breakdown.py --trace data/traces/mooncake_conversation_trace.jsonl \
           --skip 2000 --requests 600 --records RECORDS.jsonl [--logs DIR]
"""

import argparse
import collections
import json
import sys

import decision_log
from mooncake_window import BLOCK_TOKENS, read, shared_prefixes


def category(d, shared, total_blocks):
    blocks, best, chosen = (float(d[k]) for k in ("blocks", "holder_matched", "matched"))
    knows = best >= 0.8 * shared / total_blocks * blocks
    if knows and chosen >= 0.8 * best:
        how = "follow"
    elif d["reason"] == "spread":
        how = "spread"
    else:
        how = "moved"
    return ("knows" if knows else "unknown") + "/" + how


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--requests", type=int, required=True)
    ap.add_argument("--records", required=True)
    ap.add_argument("--logs")
    ap.add_argument("--max-blocks", type=int, default=4096, help="the routers' blocks.max_blocks")
    a = ap.parse_args()
    src = {q: (n, first, blocks) for q, (n, first, _, blocks)
           in shared_prefixes(read(a.trace, a.skip, a.requests)).items()}
    runs = collections.defaultdict(dict)
    with open(a.records) as f:
        for line in f:
            r = json.loads(line)
            runs[r["run"]][r["request"]] = r
    totals = collections.defaultdict(lambda: collections.Counter())
    for run in sorted(runs, key=lambda s: (s.split(" #")[0], int(s.split(" #")[1]) if " #" in s else 0)):
        rs = runs[run]
        if len(rs) != a.requests:
            sys.exit(f"{run}: {len(rs)} records, expected {a.requests}")
        ds = {}
        if a.logs:
            lines = decision_log.read(a.logs, run)
            missing = decision_log.match(rs.values(), lines, a.max_blocks)
            if len(lines) != a.requests or missing:
                sys.exit(f"{run}: {len(lines)} decision lines for {a.requests} requests, "
                         f"{missing} unmatched")
            ds = {q: r["decision"] for q, r in rs.items()}
        potential = got = same = 0
        cats, lost = collections.Counter(), collections.Counter()
        for q, (n, i, total_blocks) in src.items():
            reusable = (n - 1) * BLOCK_TOKENS
            cached = min(max(0, rs[q]["cached_tokens"] - BLOCK_TOKENS), reusable)
            potential += reusable
            got += cached
            same += rs[q]["pod"] == rs[i]["pod"]
            if ds:
                c = category(ds[q], n, total_blocks) + ("/hit" if cached >= reusable / 2 else "/miss")
                cats[c] += 1
                lost[c] += reusable - cached
        strategy = run.split(" #")[0]
        t = totals[strategy]
        t["runs"] += 1
        t["got"] += got
        t["same"] += same
        for c, v in cats.items():
            t["n " + c] += v
            t["lost " + c] += lost[c]
        hits = sum(r["cached_tokens"] for r in rs.values())
        line = (f"{run:>18}: all hits {hits / 1e3:6.0f}k, reuse requests {len(src)}, "
                f"got {got / 1e3:4.0f}k of {potential / 1e3:.0f}k ({got / potential:.0%}), "
                f"on their source's pod {same}")
        if ds:
            # How long before a reuse request its source was decided: a shared index whose
            # replicas apply each other's records within less can lose no hit to that lag.
            age = min(float(ds[q]["ms"]) - float(ds[i]["ms"]) for q, (_, i, _) in src.items())
            t["youngest"] = min(t.get("youngest", age), age)
            line += f", source decided >= {age:.0f} ms before"
            line += "; " + ", ".join(f"{c} {v} ({lost[c] / 1e3:.0f}k lost)" if lost[c] else f"{c} {v}"
                                     for c, v in sorted(cats.items()))
        print(line)
    print("\nMean per run:")
    for strategy, t in totals.items():
        k = t["runs"]
        parts = [f"got {t['got'] / k / 1e3:.0f}k", f"on their source's pod {t['same'] / k:.1f}"]
        if "youngest" in t:
            parts.append(f"source decided >= {t['youngest']:.0f} ms before (all runs)")
        for key in sorted(x for x in t if x.startswith("n ")):
            c = key[2:]
            parts.append(f"{c} {t[key] / k:.1f} ({t['lost ' + c] / k / 1e3:.0f}k lost)")
        print(f"{strategy:>18} ({k} runs): " + ", ".join(parts))


if __name__ == "__main__":
    main()
