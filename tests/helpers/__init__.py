"""Test utilities: float64 references (``references``), the gloo process harness (``dist_harness``), tiny
hand-written rollouts (``batches``) and the package's import graph read from source (``import_graph``)."""
