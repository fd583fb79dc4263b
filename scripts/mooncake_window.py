"""A window of a Mooncake trace (data/traces/*.jsonl): which requests share a prefix with an
earlier one. Only hash ids are read, never prompt text."""

import json

BLOCK_TOKENS = 512  # tokens per Mooncake hash block


def read(trace, skip, requests):
    """The hash ids of requests skip .. skip + requests - 1."""
    window = []
    with open(trace) as f:
        for i, line in enumerate(f):
            if i >= skip + requests:
                break
            if i >= skip:
                window.append(json.loads(line)["hash_ids"])
    return window


def shared_prefixes(window):
    """Request index -> (shared blocks, first source, last source, the request's blocks) for each
    request whose longest prefix shared with an earlier one is two blocks or more; the sources
    are the earliest and the latest earlier requests sharing that many."""
    out = {}
    for q, h in enumerate(window):
        best = None
        for i in range(q):
            n = 0
            for a, b in zip(h, window[i]):
                if a != b:
                    break
                n += 1
            if n >= 2 and (best is None or n > best[0]):
                best = (n, i, i, len(h))
            elif best is not None and n == best[0]:
                best = (n, best[1], i, len(h))
        if best:
            out[q] = best
    return out
