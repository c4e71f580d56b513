"""Tensor-parallel building blocks. Sharding is declared on each parameter (``weight_loader``)."""
