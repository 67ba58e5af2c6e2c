"""``wantrain report`` draws the val/ series on the loss panel without breaking the training curves."""

from __future__ import annotations

import json
import math

from wantrain.app import report as dashboard
from wantrain.cli import report


def write_run(run_dir) -> None:
    run_dir.mkdir()
    lines = [{"step": 0, "elapsed_s": 1.0, "expert": None, "val/loss": 2.0, "val/loss/high_noise": 2.5}]
    for step in range(5, 35, 5):
        lines.append({"step": step, "elapsed_s": float(step), "expert": "high_noise", "train/loss": 1.0 / step,
                      "train/loss/high_noise": 1.0 / step, "train/lr": 1e-4})
        if step == 15:  # a validation between log steps writes a line of its own
            lines.append({"step": 17, "elapsed_s": 99.0, "expert": "high_noise", "val/loss": 1.5,
                          "val/loss/high_noise": 1.8})
    lines[-1].update({"val/loss": 1.2, "val/loss/high_noise": 1.3})  # the last log step carries its validation
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_report_draws_val_loss_on_the_loss_panel_and_keeps_train_curves_whole(tmp_path, capsys):
    write_run(tmp_path / "run")
    _, records = dashboard.load_records(tmp_path / "run")
    fig = dashboard.build_report(records)
    loss_ax = fig.axes[0]
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    val = lines["val/loss"]
    assert list(val.get_xdata()) == [0, 17, 30] and list(val.get_ydata()) == [2.0, 1.5, 1.2]
    assert list(lines["val/loss/high_noise"].get_ydata()) == [2.5, 1.8, 1.3]
    raw = lines["high_noise (raw)"]
    assert list(raw.get_xdata()) == [5, 10, 15, 20, 25, 30]
    assert all(math.isfinite(y) for y in raw.get_ydata())
    speed = next(line for line in fig.axes[5].get_lines() if line.get_label() == "steps/s")
    assert all(y == 1.0 for y in speed.get_ydata())  # val-only lines do not enter the speed curve
    assert report.run(report_args(tmp_path / "run")) == 0
    assert "val/loss: 2 at step 0, last 1.2 at step 30" in capsys.readouterr().out


def report_args(run_dir):
    import argparse

    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    return parser.parse_args([str(run_dir)])
