"""Fixtures every test gets."""

from __future__ import annotations

import logging
import os

import pytest


def pytest_configure(config):
    """Under pytest-xdist (the README's test command runs a worker per core), each worker and the runs it starts
    use one thread: two workers with torch's default of one thread per core would oversubscribe the cores, and
    OpenMP's spinning threads then slow every test down several times over."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[name] = "1"  # subprocesses (wantrain run, torchrun) inherit it
        import torch

        torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores (at most four, ``--maxprocesses``). About a quarter of the suite's
    time is spent waiting (for a checkpoint to appear before a kill, a torchrun rendezvous, a sleep before a signal),
    and the extra worker fills those gaps; each worker runs one thread, so three share two cores without spinning."""
    return (os.cpu_count() or 1) + 1


LONGEST_FIRST = (
    "tests/test_distributed.py", "tests/test_distributed_coverage.py", "tests/test_distributed_fsdp_evaluation.py",
    "tests/models/test_wan22_compile.py", "tests/test_compiled_runs.py", "tests/test_distributed_ulysses_evaluation.py",
    "tests/test_distributed_ulysses_memory.py", "tests/test_distributed_padding.py",
    "tests/test_resume.py", "tests/test_expert_groups_fsdp_run.py", "tests/test_adapter_type_runs.py",
    "tests/test_distributed_launch.py",
    "tests/test_newcomer_path.py", "tests/test_distributed_sequence.py", "tests/test_distributed_fsdp_sequence.py",
    "tests/test_first_hour.py", "tests/test_waiting_expert_runs.py", "tests/test_gpu_acceptance_smoke.py",
    "tests/observers/test_wandb.py", "tests/test_resume_storage.py", "tests/test_end_to_end.py",
    "tests/test_expert_groups_run.py", "tests/test_expert_groups_compose.py", "tests/test_distributed_fsdp_resume.py",
    "tests/test_distributed_fsdp_load.py", "tests/test_distributed_fsdp_groups.py",
    "tests/test_distributed_failures.py",
)
"""The files that take longest (docs/benchmarks.md, "Quickstart and test suite"), longest first: pytest-xdist hands
each worker one file at a time in this order (``--no-loadscope-reorder`` keeps it; xdist's default puts the files
with the most tests first), so the long ones overlap at the start instead of one of them running alone at the end."""


def pytest_collection_modifyitems(config, items):
    """:data:`LONGEST_FIRST`, then the other files marked ``slow`` (whole runs of the tiny model), then the rest, each
    in collection order: the parallel workers take one file at a time, and a long file started last would leave
    the other workers idle at the end."""
    def rank(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        if path in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(path)
        return (1 if item.get_closest_marker("slow") is not None else 2), 0

    items.sort(key=rank)


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
