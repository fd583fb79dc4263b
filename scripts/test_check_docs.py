"""Tests of check-docs.py, the documentation check `make lint` runs (run by `cargo test`:
crates/kv-bench/tests/scripts.rs)."""

import importlib.util
import os
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

spec = importlib.util.spec_from_file_location("check_docs", os.path.join(HERE, "check-docs.py"))
docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs)

# Built at run time, so that this file holds no work-log reference of its own.
STOP, ISSUE = "st" + "op", "iss" + "ue"


def write(root, name, text):
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


class WorkLog(unittest.TestCase):
    def test_references_to_working_steps_and_tracker_numbers_are_found_with_their_line(self):
        text = "\n".join([
            "fine line",
            f"measured in {STOP} 48 on 2 cores",
            f"{STOP.capitalize()} 53: the load stream",
            f"the {STOP}-63 fix and {STOP}64",
            f"{ISSUE} 32's goal",
            f"({ISSUE.capitalize()}s 10 and 11)",
            f"see {ISSUE} #7",
        ])
        hits = docs.worklog_problems({"docs/a.md": text})
        self.assertEqual([n for _, n, _ in hits], [2, 3, 4, 4, 5, 6, 7])
        self.assertTrue(all(name == "docs/a.md" for name, _, _ in hits))
        self.assertIn(f"'{STOP} 48'", hits[0][2])

    def test_ordinary_words_pass(self):
        text = "\n".join([
            f"the pods {STOP}ped after 3 s; a non{STOP} 24-hour run",
            f"clients {ISSUE} requests; {ISSUE}s of 2 kinds are none of these",
            f"a t{ISSUE} 3 cells thick; {STOP}watch 5",
            f"SIG{STOP.upper()} for 15 s",
        ])
        self.assertEqual(docs.worklog_problems({"docs/a.md": text}), [])

    def test_a_file_name_counts(self):
        hits = docs.worklog_problems({f"docs/paired-rounds/synthetic-2-{STOP}65.md": ""})
        self.assertEqual(len(hits), 1)
        self.assertIn("file name", hits[0][2])


class ResultsLength(unittest.TestCase):
    def test_results_md_past_the_limit_fails_and_at_it_passes(self):
        at = "x\n" * docs.MAX_RESULTS_LINES
        self.assertEqual(docs.results_problems("docs/results.md", at), [])
        over = docs.results_problems("docs/results.md", at + "y\n")
        self.assertEqual(len(over), 1)
        self.assertIn(f"{docs.MAX_RESULTS_LINES + 1} lines", over[0][2])


class Links(unittest.TestCase):
    def test_anchors_follow_githubs_slugs(self):
        text = "# Results\n## Flow control under overload (`kv-bench flow`)\n```sh\n# not a heading\n```\n## Results\n"
        self.assertEqual(docs.anchors(text),
                         {"results", "flow-control-under-overload-kv-bench-flow", "results-1"})

    def test_missing_files_and_headings_are_reported_and_good_links_pass(self):
        with tempfile.TemporaryDirectory() as root:
            write(root, "docs/topic/page.md", "# A page\n\n## The result\n")
            write(root, "docs/images/chart.svg", "<svg/>")
            write(root, "docs/index.md", "\n".join([
                "[ok](topic/page.md) [ok](topic/page.md#the-result) [ok](images/chart.svg)",
                "[web](https://example.com/x.md) [self](#index)",
                "[gone](topic/moved.md)",
                "[no heading](topic/page.md#how-it-was-found)",
                "```sh",
                "[in code](nowhere.md)",
                "```",
                "# Index",
            ]))
            problems = docs.link_problems(root, ["docs/index.md"])
        self.assertEqual([(n, line) for n, line, _ in problems], [("docs/index.md", 3), ("docs/index.md", 4)])
        self.assertIn("no such file", problems[0][2])
        self.assertIn("no such heading", problems[1][2])

    def test_only_documentation_pages_are_link_checked(self):
        names = ["README.md", "docs/results.md", "docs/investigations/soak.md",
                 "docs/paired-rounds/README.md", "docs/paired-rounds/2026-12-01-synthetic-2-1.md",
                 "crates/x/README.md", "docs/images/a.svg"]
        self.assertEqual(docs.markdown_to_check(names),
                         ["README.md", "docs/investigations/soak.md", "docs/paired-rounds/README.md",
                          "docs/results.md"])


class WholeCheck(unittest.TestCase):
    def test_a_repository_with_each_problem_fails_and_names_the_files(self):
        with tempfile.TemporaryDirectory() as root:
            write(root, "README.md", "[results](docs/results.md)\n")
            write(root, "docs/results.md", "line\n" * (docs.MAX_RESULTS_LINES + 1))
            write(root, "src/lib.rs", f"// measured in {STOP} 12\n")
            write(root, "target/debug/junk.rs", f"// {ISSUE} 1\n")
            subprocess.run(["git", "init", "-q"], cwd=root, check=True)
            subprocess.run(["git", "add", "-A"], cwd=root, check=True)
            problems = docs.check(root)
        self.assertEqual(sorted({n for n, _, _ in problems}), ["docs/results.md", "src/lib.rs"])

    def test_the_repositorys_own_pages_link_to_what_exists_and_results_md_fits(self):
        names = docs.tracked_files(ROOT)
        self.assertEqual(docs.link_problems(ROOT, docs.markdown_to_check(names)), [])
        with open(os.path.join(ROOT, "docs", "results.md")) as f:
            self.assertEqual(docs.results_problems("docs/results.md", f.read()), [])


if __name__ == "__main__":
    unittest.main()
