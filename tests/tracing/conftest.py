from __future__ import annotations

import pytest

from tracing.store import Store


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """One embedded store for the whole session: chDB allows one directory per process."""
    s = Store(f"chdb://{tmp_path_factory.mktemp('chdb') / 'store'}")
    s.migrate()
    yield s
    s.close()
