"""Spawned gloo multi-process tests (``@pytest.mark.distributed``)."""
