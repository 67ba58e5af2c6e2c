"""The wandb observer (``[observers] wandb = true``) in wandb's offline mode: what the offline run directory holds
is read back from its transaction log (``run-<id>.wandb``)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import prewarmed
import pytest

from wantrain.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32768  # the transaction log is a LevelDB-style log: 32 KiB blocks of records with 7-byte headers


def log_records(path: Path):
    """The payloads of a .wandb file: a 7-byte file header (":W&B", magic, version), then records of
    (crc32c u32, length u16, type u8) + data, a record of type FIRST/MIDDLE/LAST split across blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb transaction log"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk


def read_offline_run(run_dir: Path) -> tuple[list[dict], dict, list[str]]:
    """(history rows, config, file paths) of the one offline wandb run under ``run_dir/wandb``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, config = [], {}
    for payload in log_records(log_file):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    media = [str(p.relative_to(log_file.parent / "files")) for p in log_file.parent.rglob("*.mp4")]
    return history, config, media


@pytest.mark.slow
def test_an_offline_wandb_run_of_the_quickstart_holds_the_metrics_history_samples_and_config(tmp_path):
    from tests.test_end_to_end import copy_examples

    config = copy_examples(tmp_path, validation_and_samples=True)
    code = main(["run", str(config), "--max-steps", "2", "--set", "observers.progress=false",
                 "--set", "observers.wandb=true", "--set", "observers.wandb_mode=offline",
                 "--set", 'observers.wandb_project="wantrain-test"', "--set", 'observers.wandb_tags=["quickstart"]'])
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    history, wandb_config, media = read_offline_run(run_dir)
    by_step: dict[int, dict] = {}
    for row in history:
        by_step.setdefault(row["_step"], {}).update(row)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:  # every metrics.jsonl value, under the same name, at the same step
        row = by_step[line["step"]]
        for name, value in line.items():
            if "/" in name and value is not None:
                assert row[name] == pytest.approx(value, rel=1e-12), (line["step"], name)
    assert "train/loss" in by_step[2] and "val/loss" in by_step[0] and "val/loss" in by_step[2]
    for step in (0, 2):  # the sample videos, at their steps, copied into the offline run
        assert by_step[step]["samples/00/_type"] == "video-file"
        assert by_step[step]["samples/00/path"] in media
    assert wandb_config["train"]["max_steps"] == 2 and wandb_config["model"]["variant"] == "tiny-t2v"


def observers_built(config: Path, *overrides: str) -> str:
    """In a process forked from the prewarmed server (which imports no wandb): the observers a config builds, and
    whether wandb got imported."""
    code = ("import sys; from wantrain.app.config import load_config; "
            "from wantrain.app.observers import build_observers; "
            f"cfg = load_config({str(config)!r}, {list(overrides)!r}); "
            f"from pathlib import Path; obs = build_observers(cfg, Path({str(config.parent)!r}), writes_files=True); "
            "print(sorted(type(o).__name__ for o in obs), 'wandb' in sys.modules)")
    done = prewarmed.run(["-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_nothing_imports_wandb_when_the_observer_is_off(tmp_path):
    from tests.test_end_to_end import copy_examples

    config = copy_examples(tmp_path)
    off = observers_built(config)
    assert off.endswith("False") and "WandbLogger" not in off
    on = observers_built(config, "observers.wandb=true")
    assert "WandbLogger" in on and on.endswith("False")  # built; wandb itself is imported when the run starts


def test_the_metrics_docs_wandb_example_is_a_valid_config(tmp_path):
    import re

    from wantrain.app.config import load_config

    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    example = re.search(r"## Weights & Biases.*?```toml\n(.*?)```", text, re.S).group(1)
    config = tmp_path / "run.toml"
    config.write_text('[data]\npath = "data"\n' + example, encoding="utf-8")
    observers = load_config(config).observers
    assert observers.wandb and observers.wandb_mode == "offline" and observers.wandb_tags == ["t2v", "rank16"]
