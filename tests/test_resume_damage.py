"""A damaged checkpoint never resumes silently: the newest checkpoint of a real run (the tiny Wan model, the demo
data) is damaged in each way a disk, a copy or a hand edit can damage it, then resumed. Under `--resume auto` the
run falls back to the previous checkpoint with a warning naming the damaged one; under `--resume PATH` it is one
line naming the checkpoint, exit code 2, the run directory untouched. Never a traceback, and nothing outside the
run directory is written either way. A run directory holding a symbolic link is refused the same way."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_end_to_end import copy_examples

from wantrain.cli.main import main

pytestmark = pytest.mark.slow

SETTINGS = ["--max-steps", "8", "--set", "checkpoint.every=4", "--set", "train.log_every=2",
            "--set", "observers.progress=false", "--set", "observers.record_events=true"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """(the workspace: config and demo data with a filled cache, an 8-step run with checkpoints at 4 and 8)."""
    workspace = tmp_path_factory.mktemp("damage")
    config = copy_examples(workspace)
    assert main(["run", str(config), *SETTINGS]) == 0
    (run_dir,) = (workspace / "runs").iterdir()
    return workspace, run_dir


# -- ways to damage a checkpoint -----------------------------------------------------------------------------------
def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8:8 + length]), raw


def _rewrite_header(path: Path, edit: Callable[[dict], str]) -> str:
    """Edit one tensor's entry of the safetensors header in place (same length); returns the tensor's name."""
    length, header, raw = _header(path)
    name = edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    path.write_bytes(raw[:8] + text + b" " * (length - len(text)) + raw[8 + length:])
    return name


def _lora_a(header: dict) -> str:
    return next(k for k in sorted(header) if k.startswith("model/weights/") and "lora_A" in k)


def flip_a_data_byte(ck: Path) -> None:
    length, header, raw = _header(ck / "tensors.safetensors")
    offset = 8 + length + header[_lora_a(header)]["data_offsets"][0] + 2
    data = bytearray(raw)
    data[offset] ^= 0x10
    (ck / "tensors.safetensors").write_bytes(bytes(data))


def header_dtype_f32_to_i32(ck: Path) -> str:
    def edit(header: dict) -> str:
        name = _lora_a(header)
        header[name]["dtype"] = "I32"  # the same byte length: the file keeps its size
        return name
    return _rewrite_header(ck / "tensors.safetensors", edit)


def transpose_a_lora_tensor(ck: Path) -> str:
    def edit(header: dict) -> str:
        name = _lora_a(header)
        header[name]["shape"] = header[name]["shape"][::-1]  # [8, 24] -> [24, 8]
        return name
    return _rewrite_header(ck / "tensors.safetensors", edit)


def _edit_state(ck: Path, edit: Callable[[dict], None]) -> None:
    state = json.loads((ck / "state.json").read_text())
    edit(state)
    (ck / "state.json").write_text(json.dumps(state, indent=1))


def _edit_reference(ck: Path, name: str, **fields) -> None:
    def edit(state: dict) -> None:
        for ref in state["tree"]["model"]["weights"].values():
            if ref["__tensor__"] == name:
                ref.update(fields)
    _edit_state(ck, edit)


def transposed_in_both_files(ck: Path) -> None:  # state.json agrees: only the run can tell
    name = transpose_a_lora_tensor(ck)
    _edit_reference(ck, name, shape=_header(ck / "tensors.safetensors")[1][name]["shape"])


def dtype_in_both_files(ck: Path) -> None:
    _edit_reference(ck, header_dtype_f32_to_i32(ck), dtype="int32")


def drop_a_tensor_state_json_names(ck: Path) -> None:
    def edit(state: dict) -> None:
        state["tree"]["model"]["weights"]["high_noise/extra.lora_A.weight"] = {"__tensor__": "model/no/such"}
    _edit_state(ck, edit)


def drop_the_optimizer_section(ck: Path) -> None:
    _edit_state(ck, lambda state: state["tree"].pop("optimizer"))
    tensors = load_file(ck / "tensors.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("optimizer/")}, ck / "tensors.safetensors")


def remove_the_marker(ck: Path) -> None:
    (ck / "complete.json").unlink()


def truncate_the_tensors(ck: Path) -> None:
    path = ck / "tensors.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def rehash(ck: Path) -> None:
    """What a hand edit that also 'repairs' the marker leaves: sizes and checksums that match the damaged files."""
    marker = json.loads((ck / "complete.json").read_text())
    for name in marker["files"]:
        marker["files"][name] = (ck / name).stat().st_size
        marker["sha256"][name] = hashlib.sha256((ck / name).read_bytes()).hexdigest()
    (ck / "complete.json").write_text(json.dumps(marker))


# (damage, whether the marker is re-computed afterwards, what the one line says)
DAMAGES = {
    "data byte": (flip_a_data_byte, False, "does not match its sha256 checksum"),
    "header dtype": (header_dtype_f32_to_i32, False, "does not match its sha256 checksum"),
    "header dtype, marker re-computed": (header_dtype_f32_to_i32, True, "is int32 in tensors.safetensors"),
    "dtype in both files": (dtype_in_both_files, True, "is int32, this run's is float32"),
    "transposed shape": (transpose_a_lora_tensor, True, "has shape [24, 8] in tensors.safetensors"),
    "transposed in both files": (transposed_in_both_files, True, "has shape [24, 8], this run's has [8, 24]"),
    "missing tensor": (drop_a_tensor_state_json_names, True, "'model/no/such' named by state.json is missing"),
    "schema change": (drop_the_optimizer_section, True, "section 'optimizer' is missing"),
    "missing marker": (remove_the_marker, False, "no completion marker"),
    "truncation": (truncate_the_tensors, False, "'tensors.safetensors' is missing or has the wrong size"),
}


# -- helpers ---------------------------------------------------------------------------------------------------------
def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file() and (skip is None or not p.is_relative_to(skip))}


def resume_copy(finished: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """(a config whose runs go under tmp_path, a copy of the finished run there as a kill at its end would leave
    it: unfinished (no ``run_ended`` in its log) and a run of that config file, which ``--resume auto`` continues)."""
    workspace, run_dir = finished
    copy = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, copy, symlinks=True)
    config = tmp_path / "quickstart.toml"
    config.write_text((workspace / "quickstart.toml").read_text()
                      .replace('output_dir = "runs"', f'output_dir = "{tmp_path / "runs"}"')
                      .replace('path = "demo_data"', f'path = "{workspace / "demo_data"}"'))
    log = copy / "log.jsonl"
    log.write_text("".join(x for x in log.read_text().splitlines(keepends=True) if '"run_ended"' not in x))
    (copy / "config_source.json").write_text(json.dumps({"config_dir": str(tmp_path), "config_file": str(config)}))
    return config, copy


def damaged_copy(finished: tuple[Path, Path], tmp_path: Path, damage: str) -> tuple[Path, Path, Path, str]:
    """(config, run directory, its damaged newest checkpoint, what the refusal says) of a fresh copy."""
    config, run_dir = resume_copy(finished, tmp_path)
    newest = run_dir / "checkpoints" / "step_000008"
    fn, repair, says = DAMAGES[damage]
    fn(newest)
    if repair:
        rehash(newest)
    return config, run_dir, newest, says


def resumed_from(run_dir: Path) -> list[str]:
    lines = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    return [Path(x["checkpoint"]).name for x in lines if x["event"] == "run_resumed"]


# -- the tests -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", DAMAGES, ids=DAMAGES)
def test_resume_auto_falls_back_over_a_damaged_checkpoint_with_a_warning_naming_it(finished, tmp_path, capsys,
                                                                                 damage):
    config, run_dir, newest, _ = damaged_copy(finished, tmp_path, damage)
    outside = snapshot(finished[0]) | snapshot(tmp_path, skip=run_dir)
    capsys.readouterr()
    assert main(["run", str(config), *SETTINGS, "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"checkpoint '{newest}'" in err and ("skipped damaged" in err or "skipped torn" in err)
    assert resumed_from(run_dir) == ["step_000004"]  # never from the damaged one
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]  # steps 5-8 trained again, once
    assert snapshot(finished[0]) | snapshot(tmp_path, skip=run_dir) == outside


@pytest.mark.parametrize("damage", DAMAGES, ids=DAMAGES)
def test_resume_from_a_damaged_checkpoints_path_is_one_line_naming_it_and_touches_nothing(finished, tmp_path,
                                                                                         capsys, damage):
    config, _, newest, says = damaged_copy(finished, tmp_path, damage)
    before = snapshot(finished[0]) | snapshot(tmp_path)
    capsys.readouterr()
    assert main(["run", str(config), *SETTINGS, "--resume", str(newest)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("wantrain run: error: ") and "Traceback" not in err
    assert str(newest) in err and says in err
    assert "LoRA rank" not in err and "another config" not in err  # the config is not to blame
    assert snapshot(finished[0]) | snapshot(tmp_path) == before  # nothing written, in the run directory or out


@pytest.mark.parametrize("link", ["log.jsonl", "metrics.jsonl", "events.jsonl"])
def test_a_run_directory_holding_a_symbolic_link_is_refused_before_anything_is_written(finished, tmp_path, capsys,
                                                                                     link):
    config, run_dir = resume_copy(finished, tmp_path)
    target = tmp_path / "elsewhere.txt"
    target.write_text("not wantrain's\n")
    (run_dir / link).unlink()
    (run_dir / link).symlink_to(target)
    before = snapshot(finished[0]) | snapshot(tmp_path)
    capsys.readouterr()
    assert main(["run", str(config), *SETTINGS, "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{link}' -> '{target}'" in err and "symbolic link" in err
    assert target.read_text() == "not wantrain's\n"
    assert snapshot(finished[0]) | snapshot(tmp_path) == before
