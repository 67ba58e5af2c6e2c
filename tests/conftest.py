"""Fixtures every test gets."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _plenty_of_host_memory(monkeypatch):
    """Runs and ``check`` plan as if this machine had 1 TiB of RAM available: no test's outcome may depend on the
    RAM of the machine it runs on. Tests of the host-memory plan state ``model.host_ram_budget_gb`` or patch
    ``available_host_bytes`` themselves (subprocesses see the real machine)."""
    monkeypatch.setattr("wantrain.models.wan22.memory.available_host_bytes", lambda: float(2**40))
