"""Compute kernels, one folder per op: ref.py (pure PyTorch, the spec) beside the fast versions."""
