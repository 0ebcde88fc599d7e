"""Quantization after pruning (paper 004 §4): linear fixed point, FP16, k-means codebooks."""
