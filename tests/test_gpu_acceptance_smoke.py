"""``bench/gpu_acceptance.py`` before a GPU is lent to it (issues 23 and 50): ``--smoke`` runs every default section
on the CPU with tiny shapes and writes one JSON file per section; the deadline skips what would overrun and says so;
each threshold fed a failing figure makes the run exit non-zero naming it."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import prewarmed
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def test_the_gpu_acceptance_script_runs_every_section_on_the_cpu_and_writes_each_to_its_file(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("OUT", None)
    done = prewarmed.run([ROOT / "bench" / "gpu_acceptance.py", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    sections = ("plan_24gb", "tiny_t2v_resume", "sync_debug", "rows", "expert_switch_memory", "block_activations")
    # one file per section, numbered in the order they ran (the judged ones first), each as the report has it
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "00_environment.json", *(f"{i:02d}_{name}.json" for i, name in enumerate(sections, 1)), "99_summary.json"]
    for i, name in enumerate(sections, 1):
        assert json.loads((tmp_path / f"{i:02d}_{name}.json").read_text()) == report[name]
        assert "error" not in report[name] and "skipped" not in report[name]
    env_file = json.loads((tmp_path / "00_environment.json").read_text())
    assert env_file["missing_imports"] == [] and env_file["torch"] and env_file["packages"]["blinker"]
    resume = report["tiny_t2v_resume"]
    assert resume["status_resumed"] == "completed" and resume["compared"] == resume["tensors"] > 0
    assert resume["max_abs_diff_lora"] == 0.0  # on a CPU the resumed run is bit for bit the uninterrupted one
    assert resume["state_checked"] > 0 and resume["state_off_device"] == []
    rows = report["block_activations"]["rows"]
    assert len(rows) == 4 and all("error" not in r and r["estimate_bytes_per_token_per_width"] > 0 for r in rows)
    assert report["sync_debug"]["status"] == "completed" and report["sync_debug"]["syncs"] == []
    # the 24 GB plan's setting, named from the planner; on the CPU the tiny twin runs the same swap and offload code
    # with one block swapped, from the same random weights as plain bf16: its first step is plain's, bit for bit
    plan = report["plan_24gb"]
    assert plan["plan"].startswith(("bf16-swap", "fp8-swap")) and plan["planned_card_gib"] <= 24.0
    assert plan["ran"] == "bf16-swap1-offload" and plan["link_bytes_per_step"] > 0
    assert plan["planned_link_bytes_per_step"] > 0 and "link_bytes_vs_planned_pct" in plan
    assert plan["same_as_bf16"] == {"loss_rel_diff": 0.0, "grad_rel_l2": 0.0, "grad_worst_tensor_rel_l2": 0.0,
                                    "tensors": 40, "missing": 0}
    assert "peak_allocated_gib" not in plan  # only CUDA measures it
    # fp8_scaled, I2V (36 input channels) and TI2V-5B (48-channel latents) step on their tiny twins; issue 44's
    # speed rows say they do not run on a CPU
    by_row = {r["row"].split(" ")[0] + " " + r["row"].split(" ")[1]: r for r in report["rows"]["rows"]}
    assert by_row["fp8_scaled t2v-a14b"]["config"] == "fp8_scaled"
    assert by_row["int8 t2v-a14b"]["config"] == "int8" and by_row["nf4 t2v-a14b"]["config"] == "nf4"
    assert by_row["bf16 i2v-a14b"]["variant"] == "i2v-a14b" and by_row["bf16 ti2v-5b"]["latents"][1] == 48
    assert all(r["final_loss"] > 0 and r["s_per_step"] > 0 for r in report["rows"]["rows"] if "config" in r)
    # issue 61's row: VACE-A14B's 24 GB plan named from the planner (VACE blocks swapped, lean recompute); on the CPU
    # the tiny VACE twin with 3 of its 4 blocks swapped (VACE block 1 among them), offload and lean recompute
    vace = by_row["vace-t2v-a14b 24GB-plan"]
    assert vace["plan"].startswith(("bf16-swap", "fp8-swap")) and vace["planned_card_gib"] <= 24.0
    assert vace["variant"] == "vace-t2v-a14b" and vace["config"] == "bf16-swap3-offload-lean"
    assert vace["recompute"] == "lean" and vace["link_bytes_per_step"] > 0
    assert [r["skipped"].split(":")[0] for r in report["rows"]["rows"] if "skipped" in r] == ["smoke", "smoke"]
    judged = report["thresholds"]
    assert judged["optimizer_state_on_device"]["holds"] is True and judged["swapped_equals_plain"]["holds"] is True
    assert judged["planner_within_5_percent"]["holds"] is None  # a CPU measures no VRAM: not judged
    assert judged["vace_planner_within_5_percent"]["holds"] is None
    # stderr ends with one line per threshold
    assert len([line for line in done.stderr.splitlines()
                if line.startswith(("PASS ", "missed: ", "not judged: "))]) == len(judged)


def test_gpu_step_refuses_an_unknown_setting_in_one_line(capsys):
    """``bench/gpu_step.py``'s settings (the smoke above runs bf16, a swap with offload and fp8_scaled)."""
    gpu_step = _load("gpu_step")
    for bad in ("bf16-swap9", "fp8_scaled-swap1", "nf4-swap1"):
        with pytest.raises(SystemExit) as exit_:
            gpu_step.main(["--smoke", "--settings", bad])
        assert exit_.value.code == 2 and f"unknown setting {bad!r}" in capsys.readouterr().err


PASSING = {"plan_24gb": {"planner_error_pct": -2.0, "link_bytes_vs_planned_pct": 3.0, "s_per_step_vs_bf16": 1.1,
                         "mfu_bf16": 0.41, "same_as_bf16": {"loss_rel_diff": 0.0, "grad_rel_l2": 2e-3,
                                                            "grad_worst_tensor_rel_l2": 5e-3, "missing": 0}},
           "tiny_t2v_resume": {"state_off_device": []}, "sync_debug": {"syncs": []},
           "rows": {"rows": [], "vace_planner_error_pct": 3.1}}
FAILING = {  # threshold -> (section, figure, a value that misses it)
    "planner_within_5_percent": ("plan_24gb", "planner_error_pct", 5.6),
    "vace_planner_within_5_percent": ("rows", "vace_planner_error_pct", -5.2),
    "swapped_equals_plain": ("plan_24gb", "same_as_bf16", {"loss_rel_diff": 0.0, "grad_rel_l2": 0.04,
                                                           "grad_worst_tensor_rel_l2": 0.3, "missing": 0}),
    "offload_bytes_as_planned": ("plan_24gb", "link_bytes_vs_planned_pct", -48.0),
    "swap_plan_speed": ("plan_24gb", "s_per_step_vs_bf16", 1.16),
    "mfu_at_least_30_percent": ("plan_24gb", "mfu_bf16", 0.29),
    "optimizer_state_on_device": ("tiny_t2v_resume", "state_off_device",
                                  ["step 5: exp_avg on cpu, parameter on cuda:0"]),
    "no_sync_on_non_log_steps": ("sync_debug", "syncs", ["loop.py:210: called a synchronizing CUDA operation"]),
}


def _fed(monkeypatch, acceptance, figures: dict) -> None:
    """The judged sections replaced by ones that return ``figures``; no environment probe."""
    for key in "paer":
        name, _, seconds, judged = acceptance.SECTIONS[key]
        monkeypatch.setitem(acceptance.SECTIONS, key, (name, lambda d, s, dl, name=name: json.loads(
            json.dumps(figures[name])), seconds, judged))
    monkeypatch.setattr(acceptance, "environment", lambda device: {"torch": "x", "cuda": None, "python": "3",
                                                                   "missing_imports": []})


@pytest.mark.parametrize("threshold", sorted(FAILING))
def test_each_threshold_fed_a_failing_figure_makes_the_run_exit_non_zero_naming_it(threshold, monkeypatch, capsys,
                                                                                  tmp_path):
    acceptance = _load("gpu_acceptance")
    assert set(FAILING) == set(acceptance.THRESHOLDS)  # a new threshold gets its failing figure here
    _fed(monkeypatch, acceptance, PASSING)
    assert acceptance.main(["--device", "cpu", "--only", "p,a,e,r", "--out", str(tmp_path)]) == 0
    assert "missed" not in capsys.readouterr().err
    section, key, value = FAILING[threshold]
    figures = json.loads(json.dumps(PASSING))
    figures[section][key] = value
    _fed(monkeypatch, acceptance, figures)
    assert acceptance.main(["--device", "cpu", "--only", "p,a,e,r", "--out", str(tmp_path)]) == 1
    missed = [line.split(" ")[1] for line in capsys.readouterr().err.splitlines() if line.startswith("missed: ")]
    assert missed == [threshold]
    assert json.loads((tmp_path / "99_summary.json").read_text())["failed"] == [threshold]


def test_the_deadline_skips_each_section_that_would_overrun_says_so_and_fails_the_unjudged_thresholds(
        monkeypatch, capsys, tmp_path):
    acceptance = _load("gpu_acceptance")
    _fed(monkeypatch, acceptance, PASSING)
    # 60 s: the plan section's estimate (over 100 s) does not fit, the resume's and the sync check's do
    assert acceptance.SECTIONS["p"][2] > 100 and acceptance.SECTIONS["a"][2] + acceptance.SECTIONS["e"][2] < 60
    assert acceptance.main(["--device", "cpu", "--only", "p,a,e", "--out", str(tmp_path), "--deadline-s", "60"]) == 1
    err = capsys.readouterr().err
    plan = json.loads((tmp_path / "01_plan_24gb.json").read_text())
    assert plan["skipped"].startswith(f"skipped: needs ~{acceptance.SECTIONS['p'][2]} s, 60 s left of the 60 s")
    assert json.loads((tmp_path / "02_tiny_t2v_resume.json").read_text())["state_off_device"] == []
    summary = json.loads((tmp_path / "99_summary.json").read_text())
    unjudged = ["planner_within_5_percent", "swapped_equals_plain", "offload_bytes_as_planned", "swap_plan_speed",
                "mfu_at_least_30_percent", "vace_planner_within_5_percent"]  # (the rows section did not run)
    assert summary["failed"] == unjudged  # on CUDA a threshold left unjudged fails the run
    assert [line.split(" ")[2] for line in err.splitlines() if line.startswith("not judged: ")] == unjudged
    assert "PASS optimizer_state_on_device" in err and "PASS no_sync_on_non_log_steps" in err


def test_the_rows_stop_at_the_deadline_and_say_which_were_skipped(monkeypatch):
    acceptance = _load("gpu_acceptance")
    ran, now = [], [0.0]

    def gpu_step(argv):  # a row takes 60 s
        ran.append(argv)
        now[0] += 60.0
        return {"results": [{"s_per_step": 1.0}]}

    monkeypatch.setattr(acceptance, "_gpu_step", gpu_step)
    deadline = acceptance.Deadline(100.0, clock=lambda: now[0])
    now[0] = 100.0 - acceptance.VACE_ROW[1]  # time for the VACE row, the first; after it, too little for the others
    rows = acceptance.section_rows("cuda", False, deadline)["rows"]
    assert len(ran) == 1 and "vace-t2v-a14b" in ran[0] and "24.0" in ran[0]  # under the 24 GiB cap
    assert rows[0]["row"] == acceptance.VACE_ROW[0] and rows[0]["s_per_step"] == 1.0
    assert rows[0]["plan"].endswith("-lean") and "planner_error_pct" not in rows[0]  # no peak: not judged
    last = len(acceptance.ROWS) + 1
    assert [r["skipped"].split(",")[0] for r in rows[1:last]] == [f"skipped: needs ~{row[2]} s"
                                                                  for row in acceptance.ROWS]
    assert [r["row"] for r in rows[last:]] == [row[0] for row in acceptance.SPEED_ROWS]
    assert all(r["skipped"].startswith("skipped: needs ~") for r in rows[last:]) and len(ran) == 1


def test_the_compile_and_kernel_rows_report_each_beside_eager_bf16_from_the_same_run(monkeypatch):
    acceptance = _load("gpu_acceptance")
    calls = []

    def gpu_step(argv):
        calls.append(argv)
        if "bf16,bf16-compile" in argv:
            return {"results": [{"config": "bf16", "s_per_step": 2.0},
                                {"config": "bf16-compile", "s_per_step": 1.6, "s_per_step_vs_bf16": 0.8}]}
        if "bf16,bf16-flash" in argv:
            raise RuntimeError("model.attention = 'flash' needs the flash-attn package")
        if "vace-t2v-a14b" in argv:  # CUDA's peak: the VACE row's planner error is judged
            return {"results": [{"s_per_step": 3.0, "peak_vram_gib": 22.0}]}
        return {"results": [{"s_per_step": 1.0}]}

    monkeypatch.setattr(acceptance, "_gpu_step", gpu_step)
    section = acceptance.section_rows("cuda", False, acceptance.Deadline(1e6))
    rows = {r["row"]: r for r in section["rows"]}
    from wantrain.models.wan22.memory import plan

    chosen, _ = plan("vace-t2v-a14b", 24.0, base_dtype="auto", width=832, height=480, frames=81, rank=32)
    error = round(100 * (chosen.training_peak / 2**30 / 22.0 - 1), 1)
    assert rows[acceptance.VACE_ROW[0]]["planner_error_pct"] == section["vace_planner_error_pct"] == error
    compiled, flash = (rows[name] for name, _, _ in acceptance.SPEED_ROWS)
    assert compiled["config"] == "bf16-compile" and compiled["eager_s_per_step"] == 2.0
    assert compiled["s_per_step_vs_bf16"] == 0.8
    assert "flash-attn" in flash["error"]  # a kernel the machine lacks is the row's one line, the others still ran
    assert sum("--smoke" in argv for argv in calls) == 0 and len(calls) == len(acceptance.ROWS) + 3  # + VACE row
