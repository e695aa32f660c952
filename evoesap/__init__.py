"""EvoESAP: non-uniform expert pruning for sparse MoE language models."""

__version__ = "0.1.0"
