"""Tuning: the schedule search over a space (forward and backward), its result store, and the timing helpers
the benchmarks share."""
