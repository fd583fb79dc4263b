#!/usr/bin/env python3
"""Tests of import-graph.py on tiny crates written to a temporary folder.

Run: python3 -m unittest discover -s scripts -p 'test_import_graph.py'
"""

import contextlib
import importlib.util
import io
import os
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("import_graph", os.path.join(HERE, "import-graph.py"))
ig = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ig)


class Crate:
    """A crate's src/ folder with the given files."""

    def __init__(self, files):
        self.dir = tempfile.TemporaryDirectory()
        self.src = os.path.join(self.dir.name, "src")
        for rel, text in files.items():
            path = os.path.join(self.src, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)

    def run(self, *args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = ig.main(["--src", self.src, "--check", *args])
        return rc, out.getvalue()

    def circles(self, module=None, no_tests=False):
        edges = ig.graph(ig.load(self.src), module, no_tests)
        nodes = {a for a, _ in edges} | {b for _, b in edges}
        return ig.components(nodes, edges)


LIB = "pub mod a;\npub mod b;\npub mod c;\n"


class Case(unittest.TestCase):
    def crate(self, files):
        crate = Crate(files)
        self.addCleanup(crate.dir.cleanup)
        return crate


class TopLevel(Case):
    def test_a_circle_between_two_modules_is_found_with_the_lines_that_make_it(self):
        crate = self.crate(
            {
                "lib.rs": LIB,
                "a/mod.rs": "mod inner;\nuse crate::b::Thing;\n",
                "a/inner.rs": "pub fn f() {}\n",
                "b.rs": "pub struct Thing;\nfn g() { crate::a::inner::f(); }\n",
                "c.rs": "use crate::a::inner;\n",
            }
        )
        self.assertEqual(crate.circles(), [["a", "b"]])
        rc, out = crate.run()
        self.assertEqual(rc, 1)
        self.assertIn("circle: a, b", out)
        self.assertIn("a -> b: ", out)
        self.assertIn("a/mod.rs:2 crate::b::Thing", out)
        self.assertIn("b -> a: ", out)

    def test_one_direction_is_no_circle(self):
        crate = self.crate(
            {
                "lib.rs": LIB,
                "a.rs": "use crate::{b::{self, Thing as T}, c::*};\n",
                "b.rs": "pub struct Thing;\nuse crate::c::X;\n",
                "c.rs": "pub struct X;\n",
            }
        )
        self.assertEqual(crate.circles(), [])
        self.assertEqual(crate.run()[0], 0)

    def test_grouped_use_trees_and_three_module_circles(self):
        crate = self.crate(
            {
                "lib.rs": LIB,
                "a.rs": "use crate::{c::X, b as bee};\n",
                "b.rs": "pub struct Thing;\n",
                "c.rs": "pub struct X;\nuse super::b::{Thing};\n// use crate::a::Nothing;\n",
            }
        )
        self.assertEqual(crate.circles(), [])
        with open(os.path.join(crate.src, "b.rs"), "a", encoding="utf-8") as f:
            f.write("fn h() -> crate::a::Y { todo!() }\n")
        self.assertEqual(crate.circles(), [["a", "b", "c"]])

    def test_comments_strings_and_visibilities_are_no_references(self):
        crate = self.crate(
            {
                "lib.rs": LIB,
                "a.rs": "use crate::b::Thing;\n",
                "b.rs": (
                    "//! See crate::a::Y.\n"
                    "/* crate::a::Z */\n"
                    "const S: &str = \"crate::a::W\";\n"
                    "pub(in crate::a) struct Thing;\n"
                ),
                "c.rs": "",
            }
        )
        self.assertEqual(crate.circles(), [])

    def test_test_modules_are_left_out_on_request(self):
        crate = self.crate(
            {
                "lib.rs": LIB,
                "a.rs": "use crate::b::Thing;\n#[cfg(test)]\nmod tests {\n    use crate::b::Thing;\n}\n",
                "b.rs": (
                    "pub struct Thing;\n"
                    "#[cfg(test)]\n#[path = \"b_tests.rs\"]\nmod tests;\n"
                    "#[cfg(test)]\nmod more {\n    fn f() { crate::a::g(); }\n}\n"
                ),
                "b_tests.rs": "use super::*;\nuse crate::a::g;\n",
                "c.rs": "",
            }
        )
        self.assertEqual(crate.circles(), [["a", "b"]])
        self.assertEqual(crate.circles(no_tests=True), [])
        rc, out = crate.run("--no-tests")
        self.assertEqual(rc, 0, out)
        rc, out = crate.run()
        self.assertIn("(test)", out)


class Files(Case):
    def test_files_of_one_module_and_their_circles(self):
        crate = self.crate(
            {
                "lib.rs": "pub mod m;\n",
                "m/mod.rs": "mod x;\nmod y;\nmod z;\npub use x::Shared;\n",
                "m/x.rs": "pub struct Shared;\nuse super::y::Y;\n",
                "m/y.rs": "pub struct Y;\nfn f(_: super::Shared) {}\n",
                "m/z.rs": "use crate::m::x::Shared;\n",
            }
        )
        # `super::Shared` in y is x's item through its parent's facade: x and y reach each other;
        # the parent's `pub use` of its child is no edge.
        self.assertEqual(crate.circles(module="m"), [["m::x", "m::y"]])
        rc, out = crate.run("--module", "m")
        self.assertEqual(rc, 1)
        self.assertIn("m::y -> m::x: ", out)
        self.assertEqual(crate.run("--module", "nothing")[0], 2)

    def test_a_file_and_its_own_parent_module_are_no_circle_but_siblings_through_it_are(self):
        files = {
            "lib.rs": "pub mod m;\n",
            "m/mod.rs": "mod x;\nmod y;\npub struct Shared;\nfn f() { self::x::g(); }\n",
            "m/x.rs": "pub fn g(_: super::Shared) {}\n",
            "m/y.rs": "use super::Shared;\n",
        }
        crate = self.crate(files)
        # mod.rs calls x and x uses mod.rs's Shared: the module tree's own two directions.
        self.assertEqual(crate.circles(module="m"), [])
        self.assertEqual(crate.run("--all")[0], 0)
        crate = self.crate(dict(files, **{"m/y.rs": "use super::x::g;\n", "m/x.rs": "fn h() { super::y::k(); }\n"}))
        self.assertEqual(crate.circles(module="m"), [["m::x", "m::y"]])
        rc, out = crate.run("--all")
        self.assertEqual(rc, 1, out)
        self.assertIn("files of m: 1 circle(s) (tests left out)", out)

    def test_all_checks_top_level_with_tests_and_files_without(self):
        crate = self.crate(
            {
                "lib.rs": "pub mod m;\npub mod n;\n",
                "m/mod.rs": "mod x;\nmod y;\n",
                "m/x.rs": "pub struct X;\n#[cfg(test)]\nmod tests {\n    use super::super::y::Y;\n}\n",
                "m/y.rs": "pub struct Y;\nuse super::x::X;\n",
                "n.rs": "#[cfg(test)]\nmod tests {\n    use crate::m::X;\n}\n",
            }
        )
        # x and y meet only in x's tests: no circle among files; n and m not at all.
        self.assertEqual(crate.run("--all")[0], 0)
        with open(os.path.join(crate.src, "m/y.rs"), "a", encoding="utf-8") as f:
            f.write("#[cfg(test)]\nmod tests {\n    use crate::n::Z;\n}\n")
        # m and n now meet through tests, which the top level counts.
        rc, out = crate.run("--all")
        self.assertEqual(rc, 1, out)
        self.assertIn("circle: m, n", out)


if __name__ == "__main__":
    unittest.main()
