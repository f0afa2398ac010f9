"""Robustness suites: random operation sequences against a model of the tree (fuzz), faults
(cancellation, a full KV cache, panics, Ctrl-C, threads), bad inputs, and long soaks."""
