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
