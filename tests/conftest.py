"""Fixtures every test gets."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _plenty_of_host_memory(monkeypatch):
    """Runs and ``check`` plan as if this machine had 1 TiB of RAM available: no test's outcome may depend on the
    RAM of the machine it runs on. Tests of the host-memory plan state ``model.host_ram_budget_gb`` or patch
    ``available_host_bytes`` themselves (subprocesses see the real machine)."""
    monkeypatch.setattr("wantrain.models.wan22.memory.available_host_bytes", lambda: float(2**40))


@pytest.fixture(autouse=True)
def _wantrain_logging_as_found():
    """A run configures the ``wantrain`` logger for the console (``app.logs.configure_logging``: its own handlers,
    ``propagate = False``) and leaves it so, as a process that ends after one run may. In the test process the next
    test would log to an earlier test's captured stderr, closed by then, and ``caplog`` would see nothing: each test
    starts from the logger as the process found it."""
    import logging

    logger = logging.getLogger("wantrain")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    for handler in list(logger.handlers):
        if handler not in handlers:
            logger.removeHandler(handler)
            handler.close()
    logger.propagate, logger.level = propagate, level
