"""``wantrain report``: a PNG dashboard with named panels and a short text summary, from metrics.jsonl."""

from __future__ import annotations

import argparse
import json

import pytest

from wantrain.app import report as dashboard
from wantrain.cli import report
from wantrain.core.errors import UserError


def write_metrics(run_dir, n: int = 30, experts: bool = True, phases: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w", encoding="utf-8") as f:
        for i in range(1, n + 1):
            step = 10 * i
            expert = ("high_noise" if (i - 1) // 5 % 2 == 0 else "low_noise") if experts else None
            loss = 1.0 / i + (0.2 if expert == "high_noise" else 0.0)
            record = {"step": step, "time": 1.7e9 + step, "elapsed_s": 2.0 * step, "expert": expert,
                      "train/loss": loss, "train/lr": 1e-4, "train/grad_norm": 0.5 / i,
                      "train/total_param_norm": 10 + i / 10, "memory/ram_main_process_gb": 3.0,
                      "memory/ram_total_gb": 4.5, "train/skipped_steps": float(i >= 20)}
            if expert:
                record[f"train/loss/{expert}"] = loss if i != 7 else None  # a NaN loss, written as null
                record[f"train/lr/{expert}"] = 1e-4
                record[f"train/grad_norm/{expert}"] = 0.5 / i
            if phases:
                record["alpha/phase"] = float(min(i // 10, 2))
            f.write(json.dumps(record) + "\n")
        f.write('{"step": 310, "train/lo')  # a truncated last line (the run was killed)


def args_for(run_dir, out=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    return parser.parse_args([str(run_dir), *(["--out", str(out)] if out else [])])


def test_report_writes_a_png_dashboard_into_the_run_dir(tmp_path, capsys):
    write_metrics(tmp_path / "run")
    assert report.run(args_for(tmp_path / "run")) == 0
    png = tmp_path / "run" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert f"report: {png}" in capsys.readouterr().out


def test_report_panels_are_loss_lr_grad_norm_param_norm_memory_and_speed(tmp_path):
    write_metrics(tmp_path)
    _, records = dashboard.load_records(tmp_path)
    fig = dashboard.build_report(records)
    assert dashboard.panel_titles(fig) == ["Loss", "Learning rate", "Gradient norm", "Parameter norm",
                                        "Memory (GiB)", "Speed (steps/s)"]
    loss_labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {"high_noise (raw)", "high_noise (EMA 0.9)", "low_noise (raw)", "low_noise (EMA 0.9)"} <= set(loss_labels)


def test_report_shades_alpha_phases_when_the_metrics_have_them(tmp_path):
    write_metrics(tmp_path)
    _, records = dashboard.load_records(tmp_path)
    assert dashboard.phase_spans(records) == [(0.0, 10, 90), (1.0, 100, 190), (2.0, 200, 300)]
    fig = dashboard.build_report(records)
    assert {"alpha phase 0", "alpha phase 1", "alpha phase 2"} <= set(fig.axes[0].get_legend_handles_labels()[1])
    assert all(len(ax.patches) == 3 for ax in fig.axes)


def test_report_without_experts_or_phases_plots_the_overall_loss(tmp_path):
    write_metrics(tmp_path, experts=False, phases=False)
    _, records = dashboard.load_records(tmp_path)
    fig = dashboard.build_report(records)
    assert fig.axes[0].get_legend_handles_labels()[1] == ["loss (raw)", "loss (EMA 0.9)"]
    assert all(not ax.patches for ax in fig.axes)


def test_report_summary_names_steps_time_best_and_last_loss_per_expert_and_skipped_steps(tmp_path, capsys):
    write_metrics(tmp_path)
    report.run(args_for(tmp_path, out=tmp_path / "elsewhere" / "r.png"))
    out = capsys.readouterr().out
    assert "steps: 300 (first logged 10, 30 log lines)" in out
    assert "time: 0:10:00 (600.0 s)" in out
    assert "loss high_noise: best 0.24 at step 250, last 0.24 at step 250" in out
    assert "loss low_noise: best 0.03333 at step 300, last 0.03333 at step 300" in out
    assert "skipped steps: 1" in out
    assert (tmp_path / "elsewhere" / "r.png").is_file()


def test_report_on_a_missing_run_dir_is_a_one_line_user_error(tmp_path):
    with pytest.raises(UserError, match="run directory not found") as err:
        report.run(args_for(tmp_path / "nope"))
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_report_on_a_run_dir_without_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no metrics.jsonl in"):
        report.run(args_for(tmp_path))


def test_report_on_an_empty_metrics_file_is_a_user_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="holds no metrics lines"):
        report.run(args_for(tmp_path))


def _segments(line) -> int:
    """Pairs of neighbouring finite points on a plotted line: 0 means nothing is drawn between markers."""
    import math

    y = [float(v) for v in line.get_ydata()]
    return sum(1 for a, b in zip(y, y[1:], strict=False) if math.isfinite(a) and math.isfinite(b))


def alternating_alpha_records(n: int = 12) -> list[dict]:
    """A run with log_every == switch_every == 5 and an alpha schedule: each log line holds one expert's loss, and
    every line the alpha in force per expert (what AlphaController writes), which rises at step 30."""
    records = []
    for i in range(1, n + 1):
        step = 5 * i
        expert = "high_noise" if i % 2 else "low_noise"
        loss = 0.5 + 0.5 / i
        alpha = 4.0 if step < 30 else 8.0
        records.append({"step": step, "elapsed_s": float(step), "expert": expert, "train/loss": loss,
                        f"train/loss/{expert}": loss, "alpha/phase": float(step >= 30),
                        "alpha/linear_alpha/high_noise": alpha, "alpha/linear_alpha/low_noise": alpha,
                        "memory/vram_allocated_gb": 3.0})
    return records


def test_report_draws_each_experts_loss_average_and_the_alpha_curve_when_log_and_switch_intervals_are_equal():
    fig = dashboard.build_report(alternating_alpha_records())
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    for expert in ("high_noise", "low_noise"):
        assert _segments(lines[f"{expert} (EMA 0.9)"]) == 5  # 6 log lines each, joined across the other's stints
    alpha = dashboard.alpha_axis(fig)
    assert alpha is not None
    curves = {line.get_label(): line for line in alpha.get_lines()}
    assert set(curves) == {"alpha high_noise", "alpha low_noise"}
    assert list(curves["alpha high_noise"].get_ydata()) == [4.0] * 5 + [8.0] * 7
    assert dashboard.panel_titles(fig) == list(dashboard.PANEL_TITLES)  # the alpha axis is no seventh panel


def test_report_memory_axis_starts_at_zero_so_a_few_mb_do_not_look_like_a_cliff():
    records = alternating_alpha_records()
    for r in records:  # 3 GiB, then 6 MB more from step 30
        r["memory/vram_allocated_gb"] = 3.0 + (0.006 if r["step"] >= 30 else 0.0)
    fig = dashboard.build_report(records)
    memory = fig.axes[dashboard.PANEL_TITLES.index("Memory (GiB)")]
    bottom, top = memory.get_ylim()
    assert bottom == 0 and 3.006 <= top < 6  # the 6 MB step is 0.2 % of the axis, not all of it
