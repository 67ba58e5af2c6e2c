"""Atomic, durable writes (``core.atomic``) and storage errors as one line, on real small file systems (a tmpfs
mounted as root; skipped with the reason elsewhere) and with injected errors."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from wantrain.core import atomic
from wantrain.core.atomic import StorageError, atomic_write, critical_section, is_storage_error, raise_when_safe
from wantrain.core.checkpoint import CheckpointWriteError, latest_complete, write_checkpoint
from wantrain.data.cache import save_entry, write_verified
from wantrain.models.wan22.export import atomic_save

from .small_fs import fill, remount, small_tmpfs


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name)


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                        real_fsync(fd))[1])
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: (calls.append(("replace", str(b))), real_replace(a, b))[1])
    atomic_write(tmp_path / "a.json", "{}")
    kinds = [kind for kind, _ in calls]
    assert kinds == ["fsync", "replace", "fsync"]
    assert calls[0][1].startswith(str(tmp_path / ".a.json.tmp-")) and calls[2][1] == str(tmp_path)


@pytest.mark.parametrize("writer", ["lora", "cache"])
def test_lora_files_and_cache_entries_are_fsynced_before_their_rename(tmp_path, monkeypatch, writer):
    """The finding: both were renamed into place without an fsync (a power loss could leave a zero-length file)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    tensors = {"w": torch.ones(2, 2)}
    if writer == "lora":
        atomic_save(tensors, tmp_path / "x.safetensors", {"format": "pt"})
    else:
        save_entry(tmp_path / "latents" / "k.safetensors", tensors, {"format": "pt"})
    assert events[:3] == ["fsync", "replace", "fsync"], events


def test_a_failing_writer_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "config.toml"
    target.write_text("old")

    def broken(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(StorageError, match="No space left on device") as caught:
        atomic_write(target, broken, what="run file")
    assert target.read_text() == "old" and leftovers(tmp_path) == []
    assert str(target) in str(caught.value) and "free there" in str(caught.value)


def test_a_safetensors_error_is_a_storage_error_with_its_errno():
    from safetensors import SafetensorError

    exc = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert is_storage_error(exc)
    assert not is_storage_error(ValueError("a bug"))


def test_a_signal_raised_inside_a_critical_section_lands_at_its_end():
    done = []
    with pytest.raises(KeyboardInterrupt), critical_section():
        raise_when_safe(KeyboardInterrupt())
        done.append("the second rename")
    assert done == ["the second rename"]


# -- a real full disk (tmpfs) --------------------------------------------------------------------------------------
def test_a_checkpoint_on_a_full_tmpfs_is_one_line_keeping_the_previous_one(tmp_path):
    """safetensors raises SafetensorError, not OSError: it escaped as a traceback (exit 1)."""
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        write_checkpoint(disk, 4, {"w": torch.zeros(1000)})
        fill(disk, leave=8192)
        with pytest.raises(CheckpointWriteError) as caught:
            write_checkpoint(disk, 8, {"w": torch.zeros(200_000)})
        line = str(caught.value)
        assert "No space left on device" in line and "step_000008" in line and "free there" in line
        assert "\n" not in line
        best, torn = latest_complete(disk)
        assert best is not None and best.step == 4 and torn == []
        assert leftovers(disk) == []


def test_a_lora_file_on_a_full_tmpfs_is_one_line_and_the_previous_file_stays(tmp_path):
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        target = disk / "x_high_noise.safetensors"
        atomic_save({"w": torch.ones(10)}, target, {"format": "pt"})
        before = target.read_bytes()
        fill(disk, leave=4096)
        with pytest.raises(StorageError, match="cannot write LoRA file .*No space left on device"):
            atomic_save({"w": torch.ones(100_000)}, target, {"format": "pt"})
        assert target.read_bytes() == before and leftovers(disk) == []


def test_a_read_only_cache_folder_is_one_line_naming_data_cache_dir(tmp_path):
    with small_tmpfs(tmp_path / "data", "1m") as data:
        remount(data, "ro")
        cache = data / ".wantrain_cache"
        with pytest.raises(StorageError, match="Read-only file system.*data.cache_dir") as caught:
            save_entry(cache / "latents" / "k.safetensors", {"w": torch.ones(2)}, {})
        assert str(cache) in str(caught.value)
        with pytest.raises(StorageError, match="Read-only file system"):
            write_verified(cache, "abc", 9)


def test_a_cache_folder_without_write_permission_is_one_line(tmp_path, monkeypatch):
    """As root a permission bit does not stop a write: the EACCES the kernel gives other users is injected."""
    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(StorageError, match="Permission denied.*data.cache_dir"):
        save_entry(tmp_path / "cache" / "latents" / "k.safetensors", {"w": torch.ones(2)}, {})


def test_a_missing_folder_is_the_callers_bug_not_a_storage_error(tmp_path):
    with pytest.raises(FileNotFoundError):  # was a StorageError with a "free space" hint: exit 2 for a bug
        atomic_write(tmp_path / "nowhere" / "file.txt", b"x")


def test_atomic_write_reads_the_umask_and_never_sets_it(tmp_path, monkeypatch):
    umask = os.umask(0o027)
    os.umask(umask)

    def refuse(value):  # another thread creating a file between set and restore would get the wrong mode
        raise AssertionError("os.umask called")

    monkeypatch.setattr(atomic.os, "umask", refuse)
    path = atomic_write(tmp_path / "f.txt", lambda tmp: Path(tmp).write_bytes(b"x") and os.chmod(tmp, 0o600))
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_cut_back_writes_through_atomic_write_and_a_full_disk_is_one_line(tmp_path, monkeypatch):
    from wantrain.core.events.log import cut_back

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n')

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "fsync_file", full)
    with pytest.raises(StorageError, match="cannot write the run's log .*metrics.jsonl'.*No space left"):
        cut_back(log, 1)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n' and sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.jsonl"]
    monkeypatch.undo()
    assert [r["step"] for r in cut_back(log, 1)] == [1] and log.read_text() == '{"step": 1}\n'
