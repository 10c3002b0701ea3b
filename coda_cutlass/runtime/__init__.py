"""Loading built kernels and calling them from PyTorch."""
