"""Helpers for tests and benchmarks (not used by training)."""
