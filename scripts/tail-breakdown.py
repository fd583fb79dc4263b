#!/usr/bin/env python3
"""What makes a run's TTFT tail, per run of `kv-bench compare --records`.

The simulated pod (crates/vllm-sim) prefills one request at a time, in arrival order, for
`--prefill-us-per-token` per uncached token. From each request's send time, pod, prompt and
cached tokens this script rebuilds every pod's prefill lane and splits each TTFT into:

- `own`: its own prefill (uncached tokens x the per-token cost);
- `wait`: the lane's backlog on its pod when it arrived (requests sent there before it);
- `excess`: that backlog minus the smallest backlog of any pod at that moment (what a
  placement with perfect load knowledge would have saved, cache aside);
- `resid`: the rest (the pod's fixed first-token overhead, Envoy, the router, HTTP).

Per run it prints the TTFT p50 / p99 and the sums of wait and excess, then (`--top K`) the K
slowest requests. With `--trace` (the Mooncake window the run replayed) each slow request that
shares two or more hash blocks with an earlier one also shows its reuse: the prefix tokens it
could have hit, and the tokens its pod computed since that prefix was last sent there, against
the pod's KV capacity (`--gpu-blocks` x 16): the churn that evicts a prefix under LRU.

With `--logs DIR` (the `--router-metrics` directory of a run made with
`RUST_LOG=kv_router=debug`) the lanes take requests in the order the routers decided them (a
long prompt is decided after a short one sent just after it), and each run also says how often
the deciding router's predicted queue (its logged TTFT less the request's own prefill at the
same per-token cost and `--overhead-ms`) missed the modelled wait by more than 100 ms, what load
the routers saw (the mean over decisions of the candidates' mean load score and predicted queue:
replicas sharing a fleet should see what one router sees), and, for
every request decided onto a pod whose previous request (still prefilling) was decided by
*another* replica shortly before, whether the prediction saw that request (it missed it when the
predicted queue was under half of what it had left), by the time between the two decisions.

Only counts, times and pod names are read, never prompt text.

Usage: scripts/tail-breakdown.py --records RECORDS.jsonl [--prefill-us-per-token 20] [--top 8]
           [--trace data/traces/mooncake_synthetic_trace.jsonl --skip 2000 --gpu-blocks 32768]
           [--logs DIR]
"""

import argparse
import collections
import json
import statistics

import decision_log
from mooncake_window import BLOCK_TOKENS, read, shared_prefixes

# Time between two replicas' decisions onto one pod, bucketed (ms).
GAPS = (1, 3, 10, 30)


def pct(xs, q):
    """The q-quantile as kv-bench reports it (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def arrivals(rs):
    """Each request's arrival at its pod (ms from the run's start): its decision's time, shifted
    by the median gap between send and decision, when matched to one; else its send time."""
    decided = [r for r in rs if r.get("decision")]
    if len(decided) < len(rs):
        return {r["request"]: r["start_ms"] for r in rs}
    shift = statistics.median(r["decision"]["ms"] - r["start_ms"] for r in decided)
    return {r["request"]: r["decision"]["ms"] - shift for r in rs}


def lanes(rs, us_per_token):
    """Rebuilds each pod's prefill lane in arrival order; returns per-request breakdowns, with
    the request before each on its pod (`before`) and when its own prefill ends (`end`)."""
    pods = sorted({r["pod"] for r in rs})
    free = {p: 0.0 for p in pods}
    computed = {p: 0.0 for p in pods}  # tokens prefilled on each pod so far
    last = {}
    at = arrivals(rs)
    out = []
    for r in sorted(rs, key=lambda r: at[r["request"]]):
        t = at[r["request"]]
        uncached = r["prompt_tokens"] - r["cached_tokens"]
        own = us_per_token * uncached / 1000.0
        backlog = {p: max(0.0, free[p] - t) for p in pods}
        wait = backlog[r["pod"]]
        free[r["pod"]] = t + wait + own
        computed[r["pod"]] += uncached
        o = dict(r, at=t, own=own, wait=wait, excess=wait - min(backlog.values()),
                 resid=r["ttft_ms"] - own - wait, computed=dict(computed),
                 before=last.get(r["pod"]), end=free[r["pod"]])
        last[r["pod"]] = o
        out.append(o)
    return out


def predicted_queue(o, us_per_token, overhead_ms, max_blocks):
    """The deciding router's predicted wait: its logged TTFT less the request's own prefill
    (the prompt past its logged match, at the lanes' per-token cost) and the overhead."""
    d = o["decision"]
    keyed = min(o["prompt_tokens"], max_blocks * 16)
    uncached = o["prompt_tokens"] - min(float(d["matched"]) * 16, keyed)
    return float(d["ttft_ms"]) - overhead_ms - us_per_token * uncached / 1000.0


def prediction_report(out, a):
    """(queue underestimates over 100 ms, {gap bucket: [pairs, missed]}) of one run."""
    under = 0
    pairs = collections.defaultdict(lambda: [0, 0])
    for o in out:
        if o["prompt_tokens"] > a.max_blocks * 16:
            continue  # its logged match stops at the block limit: no prediction to compare
        pq = predicted_queue(o, a.prefill_us_per_token, a.overhead_ms, a.max_blocks)
        under += o["wait"] - pq > 100
        b = o["before"]
        if b is None or b["decision"]["replica"] == o["decision"]["replica"]:
            continue
        left = b["end"] - o["at"]
        if left <= 50:
            continue
        gap = o["at"] - b["at"]
        bucket = next((f"< {g} ms" for g in GAPS if gap < g), f">= {GAPS[-1]} ms")
        pairs[bucket][0] += 1
        pairs[bucket][1] += pq < left / 2
    return under, pairs


def seen_load(out):
    """The mean, over a run's decisions, of the candidates' mean load score and mean predicted
    queue (the decision lines' `candidates` field: `pod/total/matched/queue_ms/ttft_ms/
    saturated/scorer:score;...`, the best 16 of a larger fleet then `+N`), or None for logs
    without it."""
    loads, queues = [], []
    for o in out:
        field = o["decision"].get("candidates")
        if not field:
            return None
        cands = [c.split("/") for c in field.split(",") if "/" in c]  # not the `+N` left out
        scores = [dict(x.split(":") for x in c[6].split(";") if x) for c in cands]
        loads.append(statistics.mean(float(s.get("load", 0.0)) for s in scores))
        queues.append(statistics.mean(float(c[3]) for c in cands))
    return statistics.mean(loads), statistics.mean(queues)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", required=True)
    ap.add_argument("--prefill-us-per-token", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--trace")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--gpu-blocks", type=int, default=32768)
    ap.add_argument("--logs")
    ap.add_argument("--overhead-ms", type=float, default=15.0,
                    help="the per-request overhead the routers learned: the pods' fixed time to "
                         "first token (vllm-sim's --ttft-base-ms, 15 by default)")
    ap.add_argument("--max-blocks", type=int, default=4096, help="the routers' blocks.max_blocks")
    a = ap.parse_args()

    runs = collections.defaultdict(list)
    with open(a.records) as f:
        for line in f:
            r = json.loads(line)
            if r.get("error") is None and r.get("pod") and r.get("ttft_ms") is not None:
                runs[r["run"]].append(r)
    reuse = {}
    if a.trace:
        n = max(r["request"] for rs in runs.values() for r in rs) + 1
        reuse = {q: (m, last) for q, (m, _, last, _) in shared_prefixes(read(a.trace, a.skip, n)).items()}
    capacity = a.gpu_blocks * 16

    head = "| run | TTFT p50 | TTFT p99 | wait, s | excess, s | resid p50 | resid p99 |"
    if a.logs:
        head += " queue under > 100 ms | another replica's pick before, missed / pairs: " + \
            ", ".join([f"< {g} ms" for g in GAPS] + [f">= {GAPS[-1]} ms"]) + \
            " | load score seen | queue seen |"
    print(head)
    print("| --- " * (head.count("|") - 1) + "|")
    done = {}
    for label in sorted(runs):
        rs = runs[label]
        if a.logs:
            lines = decision_log.read(a.logs, label)
            missing = decision_log.match(rs, lines, a.max_blocks)
            if missing:
                raise SystemExit(f"{label}: {missing} requests without a decision line")
        out = lanes(rs, a.prefill_us_per_token)
        done[label] = out
        ttft = [o["ttft_ms"] for o in out]
        resid = [o["resid"] for o in out]
        row = (f"| {label} | {pct(ttft, .5):.0f} ms | {pct(ttft, .99):.0f} ms "
               f"| {sum(o['wait'] for o in out) / 1000:.1f} | {sum(o['excess'] for o in out) / 1000:.1f} "
               f"| {statistics.median(resid):.0f} ms | {pct(resid, .99):.0f} ms |")
        if a.logs:
            under, pairs = prediction_report(out, a)
            buckets = [f"< {g} ms" for g in GAPS] + [f">= {GAPS[-1]} ms"]
            row += f" {under} | " + ", ".join(f"{pairs[b][1]}/{pairs[b][0]}" for b in buckets) + " |"
            seen = seen_load(out)
            row += f" {seen[0]:.4f} | {seen[1]:.0f} ms |" if seen else " - | - |"
        print(row)
    if a.top <= 0:
        return
    for label, out in done.items():
        print(f"\n{label}: the {a.top} slowest requests")
        by_req = {o["request"]: o for o in out}
        for o in sorted(out, key=lambda o: -o["ttft_ms"])[: a.top]:
            line = (f"  #{o['request']:<4} t={o['at'] / 1000:6.2f} s  {o['pod']:>8}  "
                    f"prompt {o['prompt_tokens']:>6}  cached {o['cached_tokens']:>6}  "
                    f"own {o['own']:5.0f}  wait {o['wait']:5.0f}  excess {o['excess']:5.0f}  "
                    f"TTFT {o['ttft_ms']:5.0f} ms")
            src = reuse.get(o["request"])
            if src and src[1] in by_req:
                s = by_req[src[1]]
                shareable = min(src[0] * BLOCK_TOKENS, o["prompt_tokens"])
                if s["pod"] == o["pod"]:
                    churn = o["computed"][o["pod"]] - s["computed"][o["pod"]] \
                        - (o["prompt_tokens"] - o["cached_tokens"])
                    line += (f"  | reuses #{src[1]} ({shareable} tokens), on its pod; "
                             f"{churn / 1000:.0f} k computed there since ({churn / capacity:.0%} of its KV)")
                else:
                    line += f"  | reuses #{src[1]} ({shareable} tokens), sent to another pod ({s['pod']})"
            print(line)


if __name__ == "__main__":
    main()
