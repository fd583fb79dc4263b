"""The routers' decision lines (`RUST_LOG=kv_router=debug`, saved by `kv-bench compare
--router-metrics DIR` as `<run>-<replica>.log`), matched to the requests of `--records`.

A decision line carries no request number. Requests are matched in time order, but a long
prompt takes longer to parse and hash than a short one sent just after it, so its line can come
later: each request takes the first unclaimed line, among the next few, whose block count is its
prompt's (`prompt_tokens // 16`, capped at the router's block limit, `blocks.max_blocks`:
4096 by default). Only counts, times and pod
addresses are read, never prompt text.
"""

import glob
import os
import re
from datetime import datetime, timezone

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')
TOKENS_PER_BLOCK = 16
# How many lines past the oldest unclaimed one a request's line may be.
LOOKAHEAD = 16


def parse_line(line, replica):
    """One decision line as a dict (values unquoted), with `replica` and `ms` (its UTC time in
    ms); None for other lines."""
    line = ANSI.sub("", line)
    if " decision " not in line:
        return None
    d = {k: v.strip('"') for k, v in FIELD.findall(line)}
    stamp = line.split()[0].rstrip("Z")
    whole, _, frac = stamp.partition(".")
    t = datetime.fromisoformat(whole).replace(tzinfo=timezone.utc).timestamp() + float("0." + (frac or "0"))
    d["ms"] = t * 1000.0
    d["replica"] = replica
    return d


def read(logs, run):
    """Every decision line of `run` (all replicas), oldest first."""
    tag = run.replace(" ", "")
    out = []
    for path in sorted(glob.glob(os.path.join(logs, f"{tag}-*.log"))):
        replica = os.path.basename(path)[len(tag) + 1 : -len(".log")]
        with open(path) as f:
            for line in f:
                d = parse_line(line, replica)
                if d is not None:
                    out.append(d)
    out.sort(key=lambda d: d["ms"])
    return out


def match(records, decisions, max_blocks=4096):
    """Sets `r["decision"]` on each record (sent order) to its decision line; returns how many
    found none."""
    claimed = [False] * len(decisions)
    first = 0
    missing = 0
    for r in sorted(records, key=lambda r: r["start_ms"]):
        want = min(r["prompt_tokens"] // TOKENS_PER_BLOCK, max_blocks)
        while first < len(decisions) and claimed[first]:
            first += 1
        for j in range(first, min(len(decisions), first + LOOKAHEAD)):
            if not claimed[j] and int(decisions[j]["blocks"]) == want:
                claimed[j] = True
                r["decision"] = decisions[j]
                break
        else:
            r["decision"] = None
            missing += 1
    return missing
