"""Exact references: the scheduler graph executed in float64 (forward, backward, FP8, serving layouts), and the
GPU check of a kernel against them."""
