"""Conformance with TensorRT-LLM's own scheduler unit tests (see README.md here)."""
