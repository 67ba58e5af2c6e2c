from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from wantrain.core.errors import UserError
from wantrain.core.rundir import LOCK_FILE, create_run_dir, lock_run_dir, sanitize_run_id


def test_run_dir_is_timestamp_plus_run_id(tmp_path):
    run_dir = create_run_dir(tmp_path, "exp_v1.2-a", now=0)
    assert run_dir.parent == tmp_path and run_dir.is_dir()
    assert run_dir.name.endswith("__exp_v1.2-a") and len(run_dir.name.split("__")[0]) == 15


@pytest.mark.parametrize(
    "bad", ["../escape", "a/b", "..", "...", "a..b", "with space", "", "ü", "a\\b", "ok\n", "ok\r\n", "\nok"]
)
def test_unsafe_run_ids_are_refused(bad):
    with pytest.raises(UserError, match="run id"):
        sanitize_run_id(bad)


def test_existing_run_dir_is_never_reused(tmp_path):
    first = create_run_dir(tmp_path, "x", now=0)
    (first / "keep.txt").write_text("precious")
    second = create_run_dir(tmp_path, "x", now=0)
    assert second != first and second.name == first.name + "-2"
    assert (first / "keep.txt").read_text() == "precious"


def test_appending_through_a_symbolic_link_is_refused_and_the_target_is_untouched(tmp_path):
    from wantrain.core.rundir import open_append, refuse_links

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open_append(run_dir / "log.jsonl", text=True) as fh:
        fh.write("one\n")
    with open_append(run_dir / "log.jsonl") as fh:
        fh.write(b"two\n")
    assert (run_dir / "log.jsonl").read_text() == "one\ntwo\n"
    refuse_links(run_dir)  # no link: nothing to say
    target = tmp_path / "elsewhere.txt"
    target.write_text("theirs\n")
    (run_dir / "metrics.jsonl").symlink_to(target)
    with pytest.raises(UserError, match="is a symbolic link"):
        open_append(run_dir / "metrics.jsonl")
    with pytest.raises(UserError, match=r"holds 1 symbolic link\(s\), e.g. 'metrics.jsonl' -> "):
        refuse_links(run_dir)
    assert target.read_text() == "theirs\n"


# -- one writer per run directory ---------------------------------------------------------------------------------
HOLD_LOCK = """
import sys, time
from pathlib import Path
from wantrain.core.rundir import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold_lock(run_dir, seconds: float = 60) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir), str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_process_is_refused_in_one_line_naming_the_pid_holding_the_run_directory(tmp_path):
    run_dir = create_run_dir(tmp_path)
    holder = hold_lock(run_dir)
    try:
        with pytest.raises(UserError, match=f"in use by process {holder.pid}") as caught:
            lock_run_dir(run_dir)
        assert "\n" not in str(caught.value) and str(run_dir) in str(caught.value)
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_process_is_no_obstacle(tmp_path):
    run_dir = create_run_dir(tmp_path)
    holder = hold_lock(run_dir)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (run_dir / LOCK_FILE).read_text().strip() == str(holder.pid)  # the dead run's file stays
    with lock_run_dir(run_dir) as lock:
        assert lock.held and (run_dir / LOCK_FILE).read_text().strip() == str(os.getpid())
    assert not lock.held


def test_a_released_lock_can_be_taken_again_in_the_same_process(tmp_path):
    run_dir = create_run_dir(tmp_path)
    first = lock_run_dir(run_dir)
    with pytest.raises(UserError, match=f"in use by process {os.getpid()}"):
        lock_run_dir(run_dir)  # flock is per open file: a second lock in one process conflicts too
    first.release()
    lock_run_dir(run_dir).release()
