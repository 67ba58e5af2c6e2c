"""Fixtures every test gets."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _plenty_of_host_memory(monkeypatch):
    """Runs and ``check`` plan as if this machine had 1 TiB of RAM available: no test's outcome may depend on the
    RAM of the machine it runs on. Tests of the host-memory plan state ``model.host_ram_budget_gb`` or patch
    ``available_host_bytes`` themselves (subprocesses see the real machine)."""
    monkeypatch.setattr("wantrain.models.wan22.memory.available_host_bytes", lambda: float(2**40))


_WANTRAIN_LOGGER = logging.getLogger("wantrain")
_AS_FOUND = (list(_WANTRAIN_LOGGER.handlers), _WANTRAIN_LOGGER.propagate, _WANTRAIN_LOGGER.level)


def _restore_wantrain_logger() -> None:
    handlers, propagate, level = _AS_FOUND
    for handler in list(_WANTRAIN_LOGGER.handlers):
        if handler not in handlers:
            _WANTRAIN_LOGGER.removeHandler(handler)
            handler.close()
    _WANTRAIN_LOGGER.propagate, _WANTRAIN_LOGGER.level = propagate, level
    for name, logger in list(logging.root.manager.loggerDict.items()):  # a dictConfig may have disabled them
        if name.startswith("wantrain") and isinstance(logger, logging.Logger):
            logger.disabled = False


@pytest.fixture(autouse=True)
def _wantrain_logging_as_found():
    """A run configures the ``wantrain`` logger for the console (``app.logs.configure_logging``: its own handlers,
    ``propagate = False``) and leaves it so, as a process that ends after one run may. In the test process the next
    test would log to an earlier test's captured stderr, closed by then, and ``caplog`` would see nothing: each test
    starts and ends with the logger as the process found it (a module-scoped fixture's run leaves it configured
    before the function-scoped fixtures start, so it is reset on both sides)."""
    _restore_wantrain_logger()
    yield
    _restore_wantrain_logger()
