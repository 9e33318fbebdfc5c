"""Kernels: a plain-PyTorch reference (the oracle) and a fast CPU path for each operation."""
