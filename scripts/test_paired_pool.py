"""Tests of paired-pool.py and tail-breakdown.py's load columns (run by `cargo test`:
crates/kv-bench/tests/scripts.rs)."""

import importlib.util
import math
import os
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), os.path.join(HERE, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pool = load("paired-pool.py")
tail = load("tail-breakdown.py")

# A compare --markdown metric table: two rounds, the strategies' runs interleaved.
TABLE = """
| metric           | redis #1 | weighted #1 | weighted #2 | redis #2 | redis #3 |
| ---------------- | -------: | ----------: | ----------: | -------: | -------: |
| hit / pooled     |   93.9 % |      95.3 % |      97.6 % |   96.7 % |   99.0 % |
| TTFT p99         | 1650.0 ms |   1500.0 ms |   1600.0 ms | 1600.0 ms | 1.0 ms |
"""


class Pool(unittest.TestCase):
    def test_rounds_pair_each_strategy_run_with_the_baselines_of_its_round(self):
        pairs = pool.rounds(TABLE, "redis", "weighted")
        self.assertEqual(len(pairs), 2, "round 3 has no baseline")
        (h1, r1), (h2, r2) = pairs
        self.assertAlmostEqual(h1, -1.4)
        self.assertAlmostEqual(r1, 1.1)
        self.assertAlmostEqual(h2, -0.9)
        self.assertAlmostEqual(r2, 1.0)

    def test_a_runs_replica_count_does_not_hide_it(self):
        table = TABLE.replace("redis #", "redis x4 #").replace("| metric  ", "| metric")
        self.assertEqual(len(pool.rounds(table, "redis", "weighted")), 2)
        self.assertEqual(pool.rounds(table, "redis-own-load", "weighted"), [])

    def test_a_skipped_run_has_no_round(self):
        # A run that failed to start shows dashes (as kv-bench's report) and pairs with nothing.
        table = TABLE.replace("|   96.7 % |", "|        - |").replace("| 1600.0 ms | 1.0 ms |", "|         - | 1.0 ms |")
        self.assertEqual(len(pool.rounds(table, "redis", "weighted")), 1)

    def test_a_section_ends_at_the_next_heading_of_its_level(self):
        text = "## A\nx\n### A.1\ny\n## B\nz\n"
        self.assertEqual(pool.section(text, "A"), "x\n### A.1\ny")
        self.assertEqual(pool.section(text, "B"), "z")
        with self.assertRaises(SystemExit):
            pool.section(text, "C")

    def test_record_lines_carry_each_rounds_figures_in_kv_benchs_columns(self):
        text = "Workload: w (d). Fleet: f.\n" + TABLE + "\nGoal …: 0 lookups fell back.\n"
        rows = pool.tsv_rows(text, "a.md", "redis", "weighted", "--x=1", "CPU, 2 cores", 1)
        self.assertEqual(rows[0].split("\t"), [
            "1", "CPU, 2 cores", "Workload: w (d). Fleet: f.", "--x=1", "redis", "weighted",
            "a.md", "1", "93.9000", "95.3000", "1650.00", "1500.00", "0"])
        self.assertEqual(len(rows), 2)
        # 13 columns, as crates/kv-bench/src/pool.rs's HEADER names them.
        self.assertTrue(all(len(r.split("\t")) == 13 for r in rows))
        # No verdict line: the fallbacks were not recorded.
        unrecorded = pool.tsv_rows("Workload: w.\n" + TABLE, "b.md", "redis", "weighted", "", "m", 1)
        self.assertEqual(unrecorded[1].split("\t")[-1], "-")
        with self.assertRaises(SystemExit):
            pool.tsv_rows(TABLE, "c.md", "redis", "weighted", "", "m", 1)

    def test_median_intervals_match_kv_bench(self):
        # As paired::median_interval: eight values give the 2nd and 7th at 1 - 2 * 9 / 256.
        lo, hi, c = pool.median_interval([8, 1, 7, 2, 6, 3, 5, 4])
        self.assertEqual((lo, hi), (2, 7))
        self.assertTrue(math.isclose(c, 1 - 18 / 256))
        self.assertIsNone(pool.median_interval([1, 2, 3, 4]))


class SeenLoad(unittest.TestCase):
    def test_the_mean_of_each_decisions_candidates(self):
        out = [
            {"decision": {"candidates": "a:1/2.0/0/100/400/0/prefix:0.0;load:1.0,"
                                        "b:1/1.5/0/300/600/0/prefix:0.0;load:0.5"}},
            {"decision": {"candidates": "a:1/2.0/0/0/300/0/prefix:0.0;load:0.25,+3"}},
        ]
        load, queue = tail.seen_load(out)
        self.assertAlmostEqual(load, (0.75 + 0.25) / 2)
        self.assertAlmostEqual(queue, (200 + 0) / 2)
        self.assertIsNone(tail.seen_load([{"decision": {"pod": "a:1"}}]), "an older log")


if __name__ == "__main__":
    unittest.main()
