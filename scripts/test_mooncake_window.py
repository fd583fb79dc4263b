"""Tests of mooncake_window (run by `cargo test`: crates/kv-bench/tests/scripts.rs)."""

import unittest

import mooncake_window as mw


class SharedPrefixes(unittest.TestCase):
    def test_the_longest_match_names_its_first_and_last_source(self):
        window = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [1, 9], [1, 2, 3, 6]]
        got = mw.shared_prefixes(window)
        # [1, 2, 4] shares two blocks with request 0; [1, 9] only one with anything.
        self.assertEqual(got[1], (2, 0, 0, 3))
        self.assertNotIn(3, got)
        self.assertEqual(got[2], (3, 0, 0, 4))
        self.assertEqual(got[4], (3, 0, 2, 4), "requests 0 and 2 share three blocks with it")


if __name__ == "__main__":
    unittest.main()
