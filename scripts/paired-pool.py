#!/usr/bin/env python3
"""Pools the paired rounds of several `kv-bench compare --repeat --markdown` outputs (or make
bench sections of docs/results.md) into one estimate of a strategy against the baseline.

One invocation of eight rounds cannot decide a 1-point or 5 % goal on a machine where one
strategy's own runs spread by several points; the rounds of several invocations of the same
command can be pooled, because each round pairs two runs made back to back.

Per file (or section) and pooled, for `STRATEGY #k` against `BASELINE #k`: the median of the
hit / pooled differences (points) and of the TTFT p99 ratios, each with its order-statistic
interval (>= 90 % coverage, no assumption on the distribution), and the mean with its
Student's t 95 % interval. Only the metric tables' numbers are read.

Usage: scripts/paired-pool.py [--strategy redis] [--baseline weighted]
           FILE[#HEADING] ...   (HEADING: a section of FILE whose heading contains this text)
       scripts/paired-pool.py --tsv --sim FLAGS --machine KIND FILE ...
           (the rounds as lines of the record `kv-bench compare --pool` keeps, for files
           measured before it kept one: docs/paired-rounds/rounds.tsv was made so)
"""

import argparse
import math
import re
import statistics


def section(text, heading):
    """The text under the first heading containing `heading`, up to the next heading of the same
    or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(#+) ", line)
        if m and heading in line:
            level = len(m.group(1))
            out = []
            for rest in lines[i + 1:]:
                n = re.match(r"(#+) ", rest)
                if n and len(n.group(1)) <= level:
                    break
                out.append(rest)
            return "\n".join(out)
    raise SystemExit(f"no heading containing {heading!r}")


def metric_tables(text):
    """(column labels, {row name: cells}) of every table whose header starts with `| metric`."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("| metric"):
            i += 1
            continue
        labels = [c.strip() for c in lines[i].strip("|").split("|")][1:]
        rows = {}
        j = i + 2
        while j < len(lines) and lines[j].startswith("|"):
            cells = [c.strip() for c in lines[j].strip("|").split("|")]
            rows[cells[0]] = cells[1:]
            j += 1
        yield labels, rows
        i = j


def number(cell):
    """The cell's leading number; None for a skipped run's `-` or any other non-number."""
    m = re.match(r"-?\d+(\.\d+)?", cell)
    return float(m.group()) if m else None


def runs_of(text):
    """{(label, round): (hit / pooled %, TTFT p99 ms)} of every numbered run in the metric tables."""
    runs = {}
    for labels, rows in metric_tables(text):
        for k, label in enumerate(labels):
            m = re.fullmatch(r"(.+) #(\d+)", label)
            if m and "hit / pooled" in rows and "TTFT p99" in rows:
                hit, p99 = number(rows["hit / pooled"][k]), number(rows["TTFT p99"][k])
                if hit is not None and p99:
                    runs[(m.group(1), int(m.group(2)))] = (hit, p99)
    return runs


def paired_runs(text, strategy, baseline):
    """[(label, round, (hit, p99), (baseline's hit, p99))] of each round both strategies ran; a
    run labelled with its replica count (`redis x4 #3`) counts as its strategy's."""
    runs = runs_of(text)
    return [(s, n, v, runs[(baseline, n)]) for (s, n), v in sorted(runs.items())
            if (s == strategy or s.startswith(strategy + " x")) and (baseline, n) in runs]


def rounds(text, strategy, baseline):
    """[(hit difference in points, TTFT p99 ratio)] of each round both strategies ran."""
    return [(h - bh, p / bp) for _, _, (h, p), (bh, bp) in paired_runs(text, strategy, baseline)]


def tsv_rows(text, source, strategy, baseline, sim, machine, epoch):
    """The rounds as lines of kv-bench's record (`compare --pool`, crates/kv-bench/src/pool.rs):
    the file's `Workload: … Fleet: …` line names the window; lookups that fell back are 0 where
    the file's verdict line says so, else unrecorded (`-`)."""
    workload = next((line for line in text.splitlines() if line.startswith("Workload: ")), None)
    if workload is None:
        raise SystemExit(f"{source}: no 'Workload:' line")
    fell = "0" if re.search(r"\b0 lookups fell back", text) else "-"
    return ["\t".join([str(epoch), machine, workload, sim, label, baseline, source, str(n),
                      f"{h:.4f}", f"{bh:.4f}", f"{p:.2f}", f"{bp:.2f}", fell])
            for label, n, (h, p), (bh, bp) in paired_runs(text, strategy, baseline)]


def median_interval(v, confidence=0.9):
    """(lo, hi, coverage) of the narrowest order-statistic interval holding the median with at
    least `confidence`; None with too few values."""
    s = sorted(v)
    n = len(s)
    for k in range(n // 2, 0, -1):
        below = sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if 1 - 2 * below >= confidence:
            return s[k - 1], s[n - k], 1 - 2 * below
    return None


# Student's t, two-sided 95 %, by degrees of freedom 1-30 (as kv-bench's paired table).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
       2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(df):
    """The t quantile; past 30 degrees of freedom the next listed row below (a wider interval)."""
    if df <= 30:
        return T95[df - 1]
    return 2.042 if df <= 40 else 2.021 if df <= 60 else 2.000 if df <= 120 else 1.980


def describe(pairs):
    hits = [h for h, _ in pairs]
    logs = [math.log(r) for _, r in pairs]
    out = [f"{len(pairs)} rounds"]
    for name, xs, show in (("hits", hits, lambda x: f"{x:+.1f}"),
                           ("TTFT p99", logs, lambda x: f"{math.exp(x):.3f}x")):
        part = f"{name} median {show(statistics.median(xs))}"
        iv = median_interval(xs)
        if iv:
            part += f" ({iv[2]:.0%}: {show(iv[0])} to {show(iv[1])})"
        if len(xs) > 1:
            m, sd = statistics.mean(xs), statistics.stdev(xs)
            half = t95(len(xs) - 1) * sd / math.sqrt(len(xs))
            part += f", mean {show(m)} ({show(m - half)} to {show(m + half)})"
        out.append(part)
    return "; ".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="redis")
    ap.add_argument("--baseline", default="weighted")
    ap.add_argument("--tsv", action="store_true", help="print the rounds as record lines")
    ap.add_argument("--sim", default="", help="with --tsv: the runs' --sim-arg values")
    ap.add_argument("--machine", default="", help="with --tsv: the machine kind")
    ap.add_argument("--epoch", type=int, default=1, help="with --tsv: the record's epoch")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    pooled = []
    for spec in a.files:
        path, _, heading = spec.partition("#")
        with open(path) as f:
            text = f.read()
        if heading:
            text = section(text, heading)
        if a.tsv:
            name = path.rsplit("/", 1)[-1]
            for row in tsv_rows(text, name, a.strategy, a.baseline, a.sim, a.machine, a.epoch):
                print(row)
            continue
        pairs = rounds(text, a.strategy, a.baseline)
        if not pairs:
            raise SystemExit(f"{spec}: no paired rounds of {a.strategy} and {a.baseline}")
        print(f"{spec}: {describe(pairs)}")
        pooled += pairs
    if a.tsv:
        return
    print(f"pooled: {describe(pooled)}")


if __name__ == "__main__":
    main()
