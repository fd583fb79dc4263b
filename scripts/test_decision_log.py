"""Tests of decision_log (run by `cargo test`: crates/kv-bench/tests/scripts.rs)."""

import os
import tempfile
import unittest

import decision_log as dl


def line(t, blocks, pod, replica_color=True):
    text = (f"2026-11-30T21:19:{t} DEBUG kv_router::decide::plan: decision reason=\"scored\" "
            f"blocks={blocks} new_conversation=false pod={pod} matched=0.0 ttft_ms=12.5")
    # tracing colours its output when the log is a terminal; the parser must not care
    return "\x1b[2m" + text.replace(" DEBUG", "\x1b[0m DEBUG") if replica_color else text


class Match(unittest.TestCase):
    def test_a_long_prompt_decided_after_a_later_short_one_gets_its_own_line(self):
        # Sent 2 ms apart; the long prompt's line comes second (it took longer to hash).
        records = [
            {"request": 0, "start_ms": 0.0, "prompt_tokens": 191_374},
            {"request": 1, "start_ms": 2.0, "prompt_tokens": 443},
        ]
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "redisx4#1-0.log"), "w") as f:
                f.write(line("01.000300Z", 27, "127.0.0.1:1") + "\n")
            with open(os.path.join(d, "redisx4#1-1.log"), "w") as f:
                f.write("2026-11-30T21:19:00.5Z  INFO kv_router: started\n")
                f.write(line("01.040000Z", 4096, "127.0.0.1:2", False) + "\n")
            decisions = dl.read(d, "redis x4 #1")
        self.assertEqual([x["blocks"] for x in decisions], ["27", "4096"], "oldest first")
        self.assertEqual(dl.match(records, decisions), 0)
        # Time order alone would give request 0 the short prompt's line.
        self.assertEqual(records[0]["decision"]["pod"], "127.0.0.1:2")
        self.assertEqual(records[0]["decision"]["replica"], "1")
        self.assertEqual(records[1]["decision"]["pod"], "127.0.0.1:1")
        self.assertAlmostEqual(records[0]["decision"]["ms"] - records[1]["decision"]["ms"], 39.7, places=3)

    def test_a_request_without_its_line_is_counted_missing(self):
        records = [{"request": 0, "start_ms": 0.0, "prompt_tokens": 1600}]
        decisions = [dl.parse_line(line("01.0Z", 99, "127.0.0.1:1"), "0")]
        self.assertEqual(dl.match(records, decisions), 1)
        self.assertIsNone(records[0]["decision"])

    def test_other_lines_are_not_decisions(self):
        self.assertIsNone(dl.parse_line("2026-11-30T21:19:01Z  INFO kv_router: ready", "0"))


if __name__ == "__main__":
    unittest.main()
