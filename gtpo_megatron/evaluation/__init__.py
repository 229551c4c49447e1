"""Evaluation: pass@k / maj@k with vLLM (``gtpo-eval``) and training-curve comparison (``gtpo-compare``).

Importing this package imports neither vLLM nor matplotlib.
"""
