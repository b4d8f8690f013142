"""Scoring a model on a dataset: data, the one validator loop, its task hooks, and the backends that run a .pt, .onnx or .engine."""
