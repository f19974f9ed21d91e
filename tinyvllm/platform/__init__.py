"""The device layer: which tinygrad device runs (device.py), what its kernels may assume (target.py), and every use of
tinygrad internals (tinygrad_compat.py)."""
