"""The side channel of failures (``core.parallel.failures``) on one store shared by two watches in one process:
the failing rank's record, the line another rank prints before ending, the first failure kept."""

from __future__ import annotations

import threading

import torch.distributed as dist

from wantrain.core.parallel.failures import FailureWatch, RankFailed


def test_another_ranks_failure_ends_this_rank_with_the_line_naming_rank_cause_and_checkpoint(tmp_path, capsys):
    store = dist.HashStore()
    (tmp_path / "checkpoints").mkdir()
    ended = threading.Event()
    codes: list[int] = []

    def exit_(code: int) -> None:
        codes.append(code)
        ended.set()

    rank0 = FailureWatch(store, 0, exit=exit_, interval_s=0.01, grace_s=0.05)
    rank0.checkpoints = tmp_path / "checkpoints"
    rank1 = FailureWatch(store, 1, exit=lambda code: None, interval_s=0.01)
    rank0.start()
    try:
        error = rank1.announce("out of memory at step 3")
        assert isinstance(error, RankFailed) and error.exit_code == 1
        assert ended.wait(10), "rank 0's watch did not end it"
    finally:
        rank0.stop()
    line = capsys.readouterr().err.strip()
    assert codes == [1]
    assert line == (f"wantrain run: error: rank 1 failed: out of memory at step 3; every rank stopped; no complete "
                    f"checkpoint in '{tmp_path / 'checkpoints'}' yet: run again")
    assert str(error) == line.removeprefix("wantrain run: error: ")  # rank 0's hint, the same on both


def test_the_first_failure_is_kept_and_a_rank_whose_collective_broke_reports_it():
    store = dist.HashStore()
    first, second = FailureWatch(store, 1), FailureWatch(store, 0)
    first.announce("a bug")
    assert "rank 1 failed: a bug" in str(second.announce("Connection closed by peer"))
    assert first.other_failure() is None  # its own record: raise its own error
    assert "rank 1 failed: a bug" in str(FailureWatch(store, 2).other_failure())


def test_a_watch_stopped_before_any_failure_ends_nothing():
    watch = FailureWatch(dist.HashStore(), 0, exit=lambda code: (_ for _ in ()).throw(AssertionError(code)),
                         interval_s=0.01)
    watch.start()
    watch.stop()
    assert watch.failure() is None


def test_a_failure_during_rank0s_save_names_that_checkpoint_on_every_rank_once_it_is_written(tmp_path, monkeypatch,
                                                                                               capsys):
    """Regression (CI, the Ulysses out-of-memory test): rank 1 failed at step 3 while rank 0 still wrote step 2's
    checkpoint; rank 0's watch published "no complete checkpoint yet" at once and both lines said so. Now rank 0's
    watch waits for the save it holds (``writing``), tells rank 1 it is saving, and both lines name step 2."""
    from wantrain.core import checkpoint
    from wantrain.core.parallel import failures

    monkeypatch.setattr(failures, "HINT_WAIT_S", 0.1)  # rank 1's first wait ends long before the save does
    store = dist.HashStore()
    checkpoints = tmp_path / "checkpoints"
    ended = threading.Event()
    rank0 = FailureWatch(store, 0, exit=lambda code: ended.set(), interval_s=0.01, grace_s=0.05)
    rank1 = FailureWatch(store, 1, exit=lambda code: None, interval_s=0.01)
    rank0.checkpoints = rank1.checkpoints = checkpoints
    errors: list[RankFailed] = []
    with rank0.writing:  # rank 0's main thread: step 2's save in progress
        rank0.start()
        failing = threading.Thread(target=lambda: errors.append(rank1.announce("out of memory at step 3")))
        failing.start()
        assert _waits_for(lambda: store.check([failures.SAVING_KEY])), "rank 0's watch did not say it is saving"
        assert not ended.is_set() and not errors  # neither line is written before the checkpoint is
        written = checkpoint.write_checkpoint(checkpoints, 2, {"step": 2})
    try:
        failing.join(10)
        assert ended.wait(10), "rank 0's watch did not end it"
    finally:
        rank0.stop()
    hint = f"resume from '{written}' (step 2) with --resume auto"
    assert errors and str(errors[0]).endswith(hint), errors
    assert capsys.readouterr().err.strip().endswith(hint)


def _waits_for(condition, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False
