"""Helpers that build real, tiny artifacts (HF checkpoints, tokenizers) for tests, examples and benchmarks.

There is no model hub here: everything is made from a config on the spot and saved the way users' files are.
"""
