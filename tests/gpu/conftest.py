"""Fixtures the GPU checks share."""

from __future__ import annotations

import pytest

from tests.gpu.common import single_rank_world


@pytest.fixture(scope="module")
def groups():
    """A one-rank world (``single_rank_world``) for the checks of one module."""
    with single_rank_world() as groups:
        yield groups
