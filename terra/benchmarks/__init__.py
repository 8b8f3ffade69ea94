"""Benchmarks: they print tables and write JSON; tests never assert on their timings."""
