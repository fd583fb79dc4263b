#!/usr/bin/env python3
"""Checks the repository's documentation the way `make lint` wants it (run by `make lint`).

1. docs/results.md is at most MAX_RESULTS_LINES lines: the generated results (`make bench`) and a
   short list of the hand-measured topic pages under docs/investigations/.
2. No tracked file speaks in work-log terms: a reference to a working step or a tracker number,
   that is the word "stop" or "issue" (any case, plural too) followed by a number, directly or after
   a space or hyphen, with an optional "#". The repository speaks of the software: name the thing ("the
   shared index's goal") or the commit instead. Only these two words with a number are checked,
   as everything else ("this session" can be a request's session) has legitimate uses here.
3. Every relative markdown link in README.md, docs/*.md, docs/investigations/*.md and
   docs/paired-rounds/README.md (file, and #anchor where given) resolves. The paired-round
   records beside that README are data, kept as `kv-bench` printed them, and not checked.

Each problem is printed as FILE:LINE: what; exit status 1 when there is any.

Usage: scripts/check-docs.py [--root DIR]
"""

import argparse
import os
import re
import subprocess
import sys

MAX_RESULTS_LINES = 700

# "stop" or "issue" (any case, plural too) followed by a number, directly or after a space or
# hyphen, with an optional "#": the work-log references this check exists for.
WORKLOG = re.compile(r"\b(?:stops?|issues?)[ \-]?#?[0-9]+\b", re.IGNORECASE)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def tracked_files(root):
    """Tracked files, relative to root (git ls-files), without target/."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    names = [n for n in out.stdout.decode().split("\0") if n]
    return [n for n in names if not n.startswith("target/")]


def read_text(path):
    """The file's text, or None for a binary file (a NUL byte) or one that is not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def worklog_problems(files):
    """(name, line number, message) for each work-log reference in {name: text}."""
    problems = []
    for name, text in sorted(files.items()):
        for no, line in enumerate(text.splitlines(), 1):
            for m in WORKLOG.finditer(line):
                problems.append((name, no, f"work-log reference {m.group(0)!r}: say what it is"))
    # A file name counts too (e.g. a record named after a working step).
    for name in sorted(files):
        m = WORKLOG.search(name.replace("/", " "))
        if m:
            problems.append((name, 0, f"work-log reference {m.group(0)!r} in the file name"))
    return problems


def results_problems(name, text):
    lines = len(text.splitlines())
    if lines > MAX_RESULTS_LINES:
        return [(name, lines, f"{lines} lines, more than {MAX_RESULTS_LINES}: move hand-measured "
                              "sections to a topic page under docs/investigations/")]
    return []


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text):
    """The anchors a markdown text's headings give (duplicates numbered as GitHub does)."""
    seen = {}
    out = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6} (.*)", line)
        if fenced or not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def link_problems(root, names):
    """(name, line, message) for each relative link in the markdown files `names` that does not
    resolve: its file is missing, or its #anchor is no heading there."""
    problems = []
    for name in names:
        text = read_text(os.path.join(root, name)) or ""
        fenced = False
        for no, line in enumerate(text.splitlines(), 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if fenced:
                continue
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z][a-z0-9+.\-]*:", target, re.IGNORECASE):
                    continue  # http:, https:, mailto: ...
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(root, os.path.dirname(name), path)) if path \
                    else os.path.join(root, name)
                if not os.path.exists(full):
                    problems.append((name, no, f"link to {target}: no such file"))
                    continue
                if anchor and full.endswith(".md"):
                    if anchor not in anchors(read_text(full) or ""):
                        problems.append((name, no, f"link to {target}: no such heading"))
    return problems


def markdown_to_check(names):
    """README.md and the documentation pages (not the paired-round records, which are data)."""
    keep = re.compile(r"README\.md|docs/[^/]+\.md|docs/investigations/[^/]+\.md|docs/paired-rounds/README\.md")
    return sorted(n for n in names if keep.fullmatch(n))


def check(root):
    names = tracked_files(root)
    texts = {}
    for n in names:
        t = read_text(os.path.join(root, n))
        if t is not None:
            texts[n] = t
    problems = []
    results = "docs/results.md"
    if results in texts:
        problems += results_problems(results, texts[results])
    problems += worklog_problems(texts)
    problems += link_problems(root, markdown_to_check(names))
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    args = ap.parse_args()
    problems = check(os.path.abspath(args.root))
    for name, no, msg in problems:
        print(f"{name}:{no}: {msg}", file=sys.stderr)
    if problems:
        print(f"check-docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
