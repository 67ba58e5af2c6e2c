"""Checkpoint files: the tree encoding, atomic writes, torn checkpoints, retention and disk errors."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch

from wantrain.core.checkpoint import (
    MARKER,
    CheckpointReadError,
    CheckpointWriteError,
    copy_tree,
    join_tree,
    latest_complete,
    list_checkpoints,
    prune,
    read_checkpoint,
    split_tree,
    write_checkpoint,
)


def sample_tree():
    return {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)}, 1: {}},
        "groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "name": "high_noise", "params": [0, 1]}],
        "rng": torch.ByteTensor([1, 2, 3]),
        "nested": {"inf": float("inf"), "none": None, "flag": True, "bf16": torch.ones(2, dtype=torch.bfloat16)},
    }


def assert_trees_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for k in a:
            assert_trees_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_trees_equal(x, y)
    else:
        assert a == b and type(a) is type(b)


def test_tree_round_trips_int_keys_tuples_dtypes_and_non_finite_floats_through_json(tmp_path):
    tree = sample_tree()
    data, tensors = split_tree(tree)
    text = json.dumps(data)
    assert_trees_equal(join_tree(json.loads(text), tensors), tree)
    path = write_checkpoint(tmp_path, 7, tree, meta={"config_hash": "abc"})
    loaded = read_checkpoint(path)
    assert loaded.step == 7 and loaded.meta == {"config_hash": "abc"}
    assert_trees_equal(loaded.tree, tree)


def test_objects_that_json_cannot_hold_are_refused_naming_their_path():
    with pytest.raises(TypeError, match="'observers/Mine/when' is a set"):
        split_tree({"observers": {"Mine": {"when": {1, 2}}}})


def test_copy_tree_is_independent_of_the_live_tensors():
    live = {"w": torch.zeros(3)}
    snap = copy_tree(live)
    live["w"].add_(1)
    assert torch.equal(snap["w"], torch.zeros(3))


def test_checkpoint_without_marker_or_with_a_short_file_is_torn_and_never_read(tmp_path):
    good = write_checkpoint(tmp_path, 10, sample_tree())
    later = write_checkpoint(tmp_path, 20, sample_tree())
    (later / MARKER).unlink()
    best, torn = latest_complete(tmp_path)
    assert best.path == good and [c.path for c in torn] == [later]
    with pytest.raises(CheckpointReadError, match="no completion marker"):
        read_checkpoint(later)
    with open(good / "tensors.safetensors", "ab") as fh:
        fh.write(b"x")
    assert not list_checkpoints(tmp_path)[0].complete
    assert latest_complete(tmp_path)[0] is None


def test_a_temporary_directory_of_an_interrupted_save_is_reported_torn(tmp_path):
    write_checkpoint(tmp_path, 4, sample_tree())
    (tmp_path / ".step_000008.tmp-12345").mkdir()
    best, torn = latest_complete(tmp_path)
    assert best.step == 4 and torn[0].step == 8 and "interrupted save" in torn[0].problem


def test_rewriting_the_same_step_replaces_it_whole(tmp_path):
    write_checkpoint(tmp_path, 5, {"x": torch.zeros(2)})
    write_checkpoint(tmp_path, 5, {"x": torch.ones(2)})
    assert torch.equal(read_checkpoint(tmp_path / "step_000005").tree["x"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005"]


def test_sidecars_are_written_inside_the_checkpoint_and_pruned_with_it(tmp_path):
    def sidecar(directory, stem):
        (directory / f"{stem}_alpha_scheduler.json").write_text("{}")

    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, {"x": torch.zeros(1)}, sidecars=[sidecar])
    assert (tmp_path / "step_000006" / "step_000006_alpha_scheduler.json").exists()
    removed = prune(tmp_path, keep_last=1, keep_every=None)
    assert [p.name for p in removed] == ["step_000002", "step_000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006"]


def test_retention_keeps_the_newest_and_the_multiples_of_keep_every(tmp_path):
    for step in range(5, 55, 5):
        write_checkpoint(tmp_path, step, {"x": torch.zeros(1)})
    prune(tmp_path, keep_last=2, keep_every=20, protect=(15,))
    assert [c.step for c in list_checkpoints(tmp_path)] == [15, 20, 40, 45, 50]


def test_disk_full_gives_one_line_removes_partial_files_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    previous = write_checkpoint(tmp_path, 10, sample_tree())
    real_write_text = type(tmp_path).write_text

    def full(self, *args, **kwargs):
        if self.name == "state.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "write_text", full)
    with pytest.raises(CheckpointWriteError) as info:
        write_checkpoint(tmp_path, 20, sample_tree())
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message and "step_000020" in message
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010"]
    assert read_checkpoint(previous).step == 10


def test_the_same_tensors_and_metadata_always_give_the_same_bytes(tmp_path):
    from safetensors.torch import load_file, save_file

    from wantrain.core.checkpoint import canonicalize_safetensors

    tensors = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(12)}
    metadata = {f"key{i}": "v" * i for i in range(12)}
    contents = set()
    for n in range(6):
        path = tmp_path / f"{n}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        canonicalize_safetensors(path)
        contents.add(path.read_bytes())
    assert len(contents) == 1
    assert all(torch.equal(load_file(str(path))[k], v) for k, v in tensors.items())


def test_the_marker_holds_each_files_sha256_and_a_changed_byte_is_damage(tmp_path):
    import hashlib

    from wantrain.core.checkpoint import CheckpointDamaged, verify_checkpoint

    path = write_checkpoint(tmp_path, 3, sample_tree())
    marker = json.loads((path / MARKER).read_text())
    assert marker["sha256"] == {name: hashlib.sha256((path / name).read_bytes()).hexdigest()
                                for name in marker["files"]}
    verify_checkpoint(path)
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-3] ^= 0x01  # a flipped bit in the tensor data: same size, so the checkpoint is not torn
    (path / "tensors.safetensors").write_bytes(bytes(data))
    assert latest_complete(tmp_path)[0].path == path
    with pytest.raises(CheckpointDamaged, match="'tensors.safetensors' does not match its sha256 checksum"):
        read_checkpoint(path)


def test_a_tensor_reference_records_dtype_and_shape_and_a_file_that_disagrees_is_damage(tmp_path):
    from safetensors.torch import load_file, save_file

    from wantrain.core.checkpoint import CheckpointDamaged, file_checksum

    path = write_checkpoint(tmp_path, 3, {"w": torch.zeros(2, 3)})
    state = json.loads((path / "state.json").read_text())
    assert state["tree"]["w"] == {"__tensor__": "w", "dtype": "float32", "shape": [2, 3]}

    def replace_tensors(tensors):
        save_file(tensors, str(path / "tensors.safetensors"))
        marker = json.loads((path / MARKER).read_text())  # a marker that agrees: only the references can tell
        marker["files"]["tensors.safetensors"] = (path / "tensors.safetensors").stat().st_size
        marker["sha256"]["tensors.safetensors"] = file_checksum(path / "tensors.safetensors")
        (path / MARKER).write_text(json.dumps(marker))

    original = load_file(str(path / "tensors.safetensors"))
    for tensors, says in (({"w": torch.zeros(3, 2)}, "has shape [3, 2] in tensors.safetensors, state.json records"),
                          ({"w": torch.zeros(2, 3, dtype=torch.int32)}, "'w' is int32 in tensors.safetensors"),
                          ({}, "'w' named by state.json is missing from tensors.safetensors"),
                          ({**original, "x": torch.zeros(1)}, "holds 1 tensors state.json does not name")):
        replace_tensors(tensors)
        with pytest.raises(CheckpointDamaged, match=re.escape(says)):
            read_checkpoint(path)
