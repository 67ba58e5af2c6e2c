"""The first hour, round 4 (issue 49), findings 7 and 8: what the page, the LR finder, `check` and the console say
is true and says it the same way everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import wantrain
from wantrain.observers.lr_finder.math import suggest
from wantrain.observers.lr_finder.observer import LrFinderResult, summary_lines
from wantrain.observers.progress import format_duration


def grid(n: int = 61) -> list[float]:
    return [float(x) for x in np.logspace(-6, 1, n)]


def test_the_lr_finder_does_not_advise_the_probe_it_already_measured_on():
    """Finding 7: a flat sweep measured on the probe said "use lr_finder.noise = 'probe'"."""
    lrs = grid()
    flat = [1.0 + 0.01 * ((-1) ** k) for k in range(len(lrs))]
    probed = suggest(lrs, flat, beta=0.0, probe=True).warnings
    drawn = suggest(lrs, flat, beta=0.0).warnings
    assert probed and all("noise = 'probe'" not in w for w in probed), probed
    assert any("steps_per_lr" in w for w in probed), probed
    assert any("noise = 'probe'" in w for w in drawn), drawn  # the other noise modes still get the advice


def test_the_minimum_suggestion_is_named_a_tenth_of_the_lowest_loss_lr_as_on_the_chart():
    """Finding 7: `minimum 1` printed beside "the lowest loss is at LR 10"; only the PNG said "minimum / 10"."""
    result = LrFinderResult(step=9, expert=None, suggestions={"valley": 3.79, "steepest": 0.08, "minimum": 1.0},
                            default="minimum", suggested_lr=1.0, stop_reason=None,
                            warnings=("the lowest loss is at the end of the sweep (LR 10)",), rungs=20)
    lines = summary_lines({None: result})
    assert lines[0] == "lr_finder [lora]: suggested LR 1 (minimum / 10)", lines
    assert "  minimum / 10 1  <- default" in lines and not any(x.startswith("  minimum  ") for x in lines), lines


def test_the_page_memory_plan_box_shows_the_plans_lines_as_text_and_no_frame_statistics(tmp_path):
    """Finding 7: the box's filter `/memory|vram|ram|plan/` matched "frames_left_over" and showed the plan as a
    JSON array of lines; it now shows the lines `check` prints, read from the report's own keys."""
    from tests.serve.test_server import client_of, make_run
    from wantrain.app.serve.server import Site

    root = tmp_path / "runs"
    run = make_run(root)
    plan = {"budget_gib": None, "bucket": "256x256x17", "lines": ["  base weights  9.50 GiB", "  total  12.00 GiB"],
            "settings": {"base_dtype": "bf16", "blocks_to_swap": 0, "offload_activations": False}}
    host = {"lines": ["  pinned staging  2.00 GiB"]}
    (run / "preflight.json").write_text(json.dumps({"frames_left_over_pct": 93.7, "source_frames_total": 320,
                                                    "memory_plan": plan, "host_memory": host}), encoding="utf-8")
    memory = client_of(Site(root, token="t")).get(f"/api/runs/{run.name}").json()["memory"]
    assert memory.splitlines() == [
        "memory plan for 256x256x17, one expert resident (settings as given): bf16 base, 0 blocks swapped, "
        "activation offload off (docs/models.md, Memory):", "  base weights  9.50 GiB", "  total  12.00 GiB", "",
        "host memory (RAM), part by part (docs/models.md, Host memory):", "  pinned staging  2.00 GiB"], memory
    script = (Path(wantrain.__file__).parent / "app" / "serve" / "static" / "app.js").read_text(encoding="utf-8")
    assert "/memory|vram|ram|plan/" not in script and 'el("pre", {}, info.memory)' in script


def test_check_does_not_ask_for_the_presets_min_steps_in_the_last_phase_which_never_ends():
    """Finding 7: a quickstart experiment (window 40, short phases) reached every phase in 200 steps, yet `check`
    said "the schedule needs 4160 -- raise train.max_steps": the last phase's min_steps, unset, counted the video
    preset's 4000."""
    from wantrain.observers.alpha.config import AlphaPhase, AlphaScheduleConfig
    from wantrain.observers.alpha.report import resolution_lines

    def schedule(last_min_steps):
        phases = [AlphaPhase(name="foundation", alpha=4, min_steps=20),
                  AlphaPhase(name="balance", alpha=7, min_steps=20),
                  AlphaPhase(name="emphasis", alpha=10, min_steps=last_min_steps)]
        return AlphaScheduleConfig(enabled=True, window=40, min_samples=20, phases=phases)

    lines = resolution_lines(schedule(None), experts=2, max_steps=400)
    assert lines[-2].endswith("entered by expert step 160 on a flat loss (every phase before it ending by its second "
                              "look), then the rest of the run"), lines
    assert lines[-1] == "  the run gives each expert 200 steps; the schedule needs 160", lines
    short = resolution_lines(schedule(100), experts=2, max_steps=400)[-1]  # a min_steps set on the last phase counts
    assert short == "  the run gives each expert 200 steps; the schedule needs 260 -- every phase is reached; the " \
                    "last gets 40 of its min_steps 100", short
    unreached = resolution_lines(schedule(None), experts=2, max_steps=200)[-1]
    assert unreached.endswith("the schedule needs 160 -- raise train.max_steps or lower min_steps/window to reach "
                              "every phase"), unreached


def test_the_page_names_units_and_suggestions_as_the_report_and_the_console_do():
    """Findings 7 and 8: the page's LR suggestions said `minimum 1` (the console and chart: "minimum / 10"), and its
    memory chart said GB where the memory metrics and the report are GiB (2**30 bytes)."""
    from wantrain.observers.lr_finder.math import LABELS

    script = (Path(wantrain.__file__).parent / "app" / "serve" / "static" / "app.js").read_text(encoding="utf-8")
    assert f'const LR_LABELS = {{minimum: "{LABELS["minimum"]}"}};' in script
    assert script.count("LR_LABELS[n") == 2 and '"Memory (GiB): RAM and VRAM"' in script and "(GB)" not in script


def test_serve_on_a_taken_port_names_the_option_that_picks_another(tmp_path, capsys):
    """Finding 8: `wantrain run --serve` on a taken port said only "Address already in use"; the page's child
    process now names `--serve PORT` (a direct `wantrain serve`: `--port PORT`)."""
    import socket

    from wantrain.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tmp_path), "--port", str(port), "--exit-with-parent"]) == 2
        from_run = capsys.readouterr().err
        assert main(["serve", str(tmp_path), "--port", str(port)]) == 2
        direct = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in from_run and "--serve PORT" in from_run and "Traceback" not in from_run, from_run
    assert "--port PORT" in direct and "--serve" not in direct, direct


def test_every_route_of_the_page_server_is_documented_with_its_method():
    """Finding 8: `POST /api/runs/<id>/control` (what a script posts to) was in no document."""
    from wantrain.app.serve.server import Site, build_app

    doc = (Path(wantrain.__file__).parents[1] / "docs" / "serve.md").read_text(encoding="utf-8")
    routes = [r for r in build_app(Site(Path("."), token="t" * 16)).app.routes if getattr(r, "methods", None)]
    assert any("POST" in r.methods for r in routes)
    for route in routes:  # the Mount of /static has no methods: the page's code, nothing to call
        path = route.path.replace("{run}", "RUN").replace("{path:path}", "PATH")
        if path.startswith("/api") or path.startswith("/files"):
            for method in sorted(route.methods - {"HEAD"}):
                assert f"`{method} {path}" in doc, f"{method} {path} is not in docs/serve.md"


def test_a_loss_is_written_with_four_significant_digits_everywhere_and_the_console_says_it_is_the_ema():
    """Finding 8: "last loss" read 1.21 (console), 1.180 (page) and 1.1802 (`wantrain report`); the console's is
    the EMA, the others the last logged loss."""
    import io

    from wantrain.app.report import summarize
    from wantrain.core.events import MetricsLogged
    from wantrain.observers.progress import ProgressLine

    summary = summarize([{"step": 5, "elapsed_s": 1.0, "train/loss": 1.18024}])
    assert "loss all: best 1.18 at step 5, last 1.18 at step 5" in summary, summary
    line = ProgressLine(stream=io.StringIO())
    line.on_metrics_logged(MetricsLogged(step=5, expert=None, values={"train/loss": 1.18024}, elapsed_s=1.0,
                                         total_steps=10), None)
    assert "loss 1.18 (EMA)" in line.render(), line.render()
    script = (Path(wantrain.__file__).parent / "app" / "serve" / "static" / "app.js").read_text(encoding="utf-8")
    assert "String(Number(v.toPrecision(digits)))" in script  # the page's fmt(): "{:.4g}", no trailing zeros


def test_the_console_eta_counts_the_pauses_that_recur_as_the_run_page_does(tmp_path):
    """Finding 8: the console said ETA 1:12 (the last 50 steps' pace) while the page said 4 min (the pace since the
    first logged step, every sample round included); both now use the page's rule."""
    import io

    from tests.serve.test_server import make_run
    from wantrain.app.serve.rundata import RunData
    from wantrain.core.events import MetricsLogged, OptimizerStepped, RunStarted
    from wantrain.observers.progress import ProgressLine

    now = [0.0]
    line = ProgressLine(stream=io.StringIO(), clock=lambda: now[0])
    line.on_run_started(RunStarted(step=0, run_dir="", total_steps=100, grad_accum=1, experts=(None,),
                                   log_every=10), None)
    rows = []
    for step in range(1, 91):
        now[0] += 1.0 + (100.0 if step % 40 == 0 else 0.0)  # 1 s a step, a 100 s sample round every 40 steps
        line.on_optimizer_stepped(OptimizerStepped(step=step, expert=None, skipped=False, skip_reason=None,
                                                   lrs=(1e-4,), group_names=("lora",), is_log_step=step % 10 == 0),
                                  None)
        if step % 10 == 0:
            rows.append({"step": step, "time": now[0], "elapsed_s": now[0], "expert": None, "train/loss": 1.0})
            line.on_metrics_logged(MetricsLogged(step=step, expert=None, values={"train/loss": 1.0},
                                                 elapsed_s=now[0], total_steps=100), None)
    rendered = line.render()
    run = make_run(tmp_path / "runs", steps=())
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    data = RunData(run)
    data.refresh()
    page_eta = data.summary()["eta_s"]
    # 80 steps in 280 s since the first log step (step 10): the 10 left take 35 s; the last 50 steps' pace said 30
    assert page_eta == pytest.approx(10 * 280 / 80)
    assert f"ETA {format_duration(page_eta)}" in rendered, rendered
