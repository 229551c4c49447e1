"""Test utilities: float64 references (``references``) and the gloo process harness (``dist_harness``)."""
