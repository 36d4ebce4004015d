"""Suite-wide fixtures."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """Engines freeze the garbage collector's view of everything alive at start-up (see
    `LLMEngine.__init__`); a test process builds hundreds of engines, so hand their
    objects back to the collector after each test or cyclic garbage would pile up."""
    yield
    gc.unfreeze()
