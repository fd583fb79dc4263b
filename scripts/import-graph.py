#!/usr/bin/env python3
"""Import circles in a Rust crate's sources: which modules reach each other through `crate::`,
`super::` and `self::` paths (in `use` declarations and in code).

Two levels:
  * the crate's top-level modules (src/index, src/pods, ...): one node each;
  * with --module NAME, the files inside that top-level module: one node per file.

A file and its own parent module (the `mod.rs` that declares it) are no circle: the parent
names its files and they use its shared items by the module tree's design. --all runs what
`make lint` checks: the top-level modules with tests, and every module's files without.
Each strongly connected component of more than one node is a circle; it is printed with, for
every edge inside it, one place that makes it. A module's `pub use` of its own descendants'
items (a facade) is no edge. --no-tests leaves out `#[cfg(test)]` modules (inline or in their
own files). --check exits 1 when a circle is found (for `make lint`).

Python 3 standard library only.
"""

import argparse
import os
import re
import sys
from collections import defaultdict

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(text):
    """The text with comments, string and char literals blanked (newlines kept, so line numbers
    stay right)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not re.match(r"\w", text[i - 1])):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}'), not a lifetime ('a).
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def file_module(src, path):
    """The module path of a source file, as a tuple (`()` for the crate root); None for files
    outside the library crate (the binary's main.rs, src/bin)."""
    rel = os.path.relpath(path, src).replace(os.sep, "/")
    if rel in ("lib.rs",):
        return ()
    if rel == "main.rs" or rel.startswith("bin/"):
        return None
    parts = rel[: -len(".rs")].split("/")
    if parts[-1] == "mod":
        parts = parts[:-1]
    return tuple(parts)


def parse_use_tree(s):
    """The paths a `use` tree names: `a::{b, c::d as e, f::*}` -> [a::b, a::c::d, a::f]."""
    tokens = re.findall(IDENT + r"|::|\{|\}|,|\*", s)
    pos = 0

    def tree(prefix):
        nonlocal pos
        paths = []
        path = list(prefix)
        while pos < len(tokens):
            t = tokens[pos]
            if t == "{":
                pos += 1
                while pos < len(tokens) and tokens[pos] != "}":
                    if tokens[pos] == ",":
                        pos += 1
                        continue
                    paths.extend(tree(path))
                pos += 1
                return paths
            if t in (",", "}"):
                break
            if t == "*":
                pos += 1
                continue
            if t == "::":
                pos += 1
                continue
            if t == "as":
                pos += 2
                continue
            if t == "self" and path:
                pos += 1
                continue
            path.append(t)
            pos += 1
        paths.append(path)
        return paths

    return tree([])


class Source:
    """One file's references: (line, absolute module path referred to, is test code)."""

    def __init__(self, src, path):
        self.path = path
        self.module = file_module(src, path)
        with open(path, encoding="utf-8") as f:
            raw = f.read()
        self.text = strip_comments_and_strings(raw)
        # `#[path = "x.rs"] mod name;`: (file, name, test), the file relative to this one's folder.
        attr = r"(?:#\[[^\]]*\]\s*)*"
        self.path_children = [
            (os.path.normpath(os.path.join(os.path.dirname(path), m.group(2))), m.group(3), "#[cfg(test)]" in m.group(0))
            for m in re.finditer(
                r"(" + attr + r")#\[path\s*=\s*\"([^\"]+)\"\]\s*" + attr + r"(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;",
                raw,
            )
        ]
        # `pub(in crate::a::b)` names a visibility, not a dependency.
        self.text = re.sub(r"pub\s*\(\s*in\s+[^)]*\)", lambda m: re.sub(r"[^\n]", " ", m.group(0)), self.text)
        self.inline = self._inline_modules()
        self.test_children = self._test_children()

    def _inline_modules(self):
        """[(start, end, (names...), test)] of each inline `mod name { ... }` block."""
        spans, stack, depth = [], [], 0
        opener = re.compile(r"(#\[cfg\(test\)\]\s*)?(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*\{")
        i, text = 0, self.text
        while i < len(text):
            m = opener.match(text, i) if text[i] in "#pm" else None
            if m and (i == 0 or not re.match(r"\w", text[i - 1])):
                outer = stack[-1] if stack else ((), False)
                names = outer[0] + (m.group(2),)
                test = outer[1] or bool(m.group(1))
                depth += 1
                stack.append((names, test, depth, m.start()))
                i = m.end()
                continue
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                if stack and stack[-1][2] == depth:
                    names, test, _, start = stack.pop()
                    spans.append((start, i, names, test))
                depth -= 1
            i += 1
        return spans

    def _test_children(self):
        """Names of out-of-line child modules declared `#[cfg(test)] mod name;`."""
        return set(re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;", self.text))

    def scope_at(self, offset):
        """(inline module names, in test code) at `offset`: the innermost inline module."""
        best = ((), False)
        for start, end, names, test in self.inline:
            if start <= offset <= end and len(names) > len(best[0]):
                best = (names, test)
        return best

    def references(self, known=frozenset()):
        refs = []
        uses = list(re.finditer(r"(\bpub\s*(?:\([^)]*\))?\s*)?\buse\s+([^;]*);", self.text))
        spans = [(m.start(), m.end()) for m in uses]
        for m in uses:
            for path in parse_use_tree(m.group(2)):
                refs.append((m.start(), path, bool(m.group(1))))
        for m in re.finditer(r"(?<![\w$])(crate|super|self)((?:\s*::\s*" + IDENT + r")+)", self.text):
            if any(a <= m.start() < b for a, b in spans):
                continue
            path = [m.group(1)] + re.findall(IDENT, m.group(2))
            refs.append((m.start(), path, False))
        out = []
        for offset, path, reexport in refs:
            inner, test = self.scope_at(offset)
            here = self.module + inner
            target = resolve(here, path, known)
            if target is None:
                continue
            line = self.text.count("\n", 0, offset) + 1
            # A module re-exporting its own descendants' items is their facade, not their user.
            facade = reexport and target[: len(here)] == here and len(target) > len(here)
            out.append((line, target, test, "::".join(path), facade, here))
        return out


def resolve(here, path, known=frozenset()):
    """The absolute path `path` names from module `here`; None for other crates and std. A path
    that starts with a child module of `here` (one of the `known` module paths) is relative."""
    if not path:
        return None
    head = path[0]
    if tuple(here) + (head,) in known:
        return tuple(here) + tuple(path)
    if head == "crate":
        return tuple(path[1:])
    if head in ("super", "self"):
        cur = list(here)
        i = 0
        while i < len(path) and path[i] in ("super", "self"):
            if path[i] == "super":
                if not cur:
                    return None
                cur.pop()
            i += 1
        return tuple(cur) + tuple(path[i:])
    return None


def load(src):
    sources = []
    for root, dirs, files in os.walk(src):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".rs"):
                s = Source(src, os.path.join(root, name))
                if s.module is not None:
                    sources.append(s)
    # A file named by `#[path]` is the module that declares it, not the one its name says.
    by_path = {os.path.normpath(s.path): s for s in sources}
    test_mods = set()
    for s in sources:
        for file, name, test in s.path_children:
            child = by_path.get(file)
            if child is not None:
                child.module = s.module + (name,)
                if test:
                    test_mods.add(child.module)
    # Out-of-line `#[cfg(test)] mod x;` children (and their descendants) are test code.
    for s in sources:
        for child in s.test_children:
            test_mods.add(s.module + (child,))
    for s in sources:
        s.is_test = any(s.module[: len(t)] == t for t in test_mods)
    return sources


def graph(sources, module=None, no_tests=False):
    """Edges {(a, b): (file, line, text, test)} between nodes: top-level modules, or with
    `module` the files inside it (a node per file module path)."""
    files = {s.module for s in sources}
    known = set(files)
    for s in sources:
        known.update(s.module + names for _, _, names, _ in s.inline)
    refs = {id(s): s.references(known) for s in sources}
    # (module, name) -> the path a facade re-exports as `name`, to follow to where it is defined.
    facades = {}
    for s in sources:
        for _, target, _, _, facade, here in refs[id(s)]:
            if facade:
                facades[(here, target[-1])] = target

    def defined(target):
        for _ in range(8):
            k = len(target)
            while k > 0 and tuple(target[:k]) not in known:
                k -= 1
            if k < len(target) and (tuple(target[:k]), target[k]) in facades:
                target = facades[(tuple(target[:k]), target[k])] + tuple(target[k + 1 :])
            else:
                break
        return target

    edges = {}
    for s in sources:
        if module is None:
            if not s.module:
                continue
            a = s.module[0]
        else:
            if s.module[:1] != (module,):
                continue
            a = "::".join(s.module)
        for line, target, test, text, facade, _ in refs[id(s)]:
            if facade:
                continue
            target = defined(target)
            test = test or s.is_test
            if no_tests and test:
                continue
            if module is None:
                if not target:
                    continue
                b = target[0]
                if (b,) not in files:
                    continue
            else:
                if target[:1] != (module,):
                    continue
                # The longest prefix of the target that is a file module.
                k = len(target)
                while k > 0 and tuple(target[:k]) not in files:
                    k -= 1
                if k == 0:
                    continue
                b = "::".join(target[:k])
            # A file and its own parent module (the `mod.rs` that declares it, its facade) use
            # each other by the module tree's design; only edges between other files count.
            parent_child = module is not None and (a.split("::")[:-1] == b.split("::") or b.split("::")[:-1] == a.split("::"))
            if a != b and not parent_child:
                key = (a, b)
                old = edges.get(key)
                # Keep a non-test example where there is one.
                if old is None or (old[3] and not test):
                    edges[key] = (os.path.relpath(s.path), line, text, test)
    return edges


def components(nodes, edges):
    """Strongly connected components (Tarjan's, iterative), each sorted; only those of more than
    one node."""
    succ = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def report(edges, out):
    nodes = {a for a, _ in edges} | {b for _, b in edges}
    comps = components(nodes, edges)
    for comp in comps:
        members = set(comp)
        out.write("circle: %s\n" % ", ".join(comp))
        for (a, b), (path, line, text, test) in sorted(edges.items()):
            if a in members and b in members:
                out.write("  %s -> %s: %s:%d %s%s\n" % (a, b, path, line, text, " (test)" if test else ""))
    return comps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default="src", help="the crate's source folder (default: src)")
    ap.add_argument("--module", help="a top-level module: the graph of its files")
    ap.add_argument("--no-tests", action="store_true", help="leave out #[cfg(test)] modules")
    ap.add_argument("--all", action="store_true",
                    help="the top-level modules (tests included) and every module's files (tests left out)")
    ap.add_argument("--check", action="store_true", help="exit 1 when there is a circle")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.src):
        sys.stderr.write("import-graph: no such folder: %s\n" % args.src)
        return 2
    sources = load(args.src)
    if args.module and not any(s.module[:1] == (args.module,) for s in sources):
        sys.stderr.write("import-graph: no module %r under %s\n" % (args.module, args.src))
        return 2
    if args.all:
        # What `make lint` holds: the top-level modules, tests included, and the files of every
        # module, tests left out (a test may build its fixture from a sibling file's types).
        runs = [(None, False)] + sorted({(s.module[0], True) for s in sources if len(s.module) > 1})
    else:
        runs = [(args.module, args.no_tests)]
    found = 0
    for module, no_tests in runs:
        edges = graph(sources, module, no_tests)
        level = "files of %s" % module if module else "top-level modules"
        comps = report(edges, sys.stdout)
        found += len(comps)
        if comps or not args.all:
            print("%s: %d circle(s)%s" % (level, len(comps), " (tests left out)" if no_tests else ""))
    if args.all:
        print("%d circle(s) in %d graphs" % (found, len(runs)))
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
