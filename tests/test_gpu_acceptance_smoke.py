"""``bench/gpu_acceptance.py --smoke`` runs on the CPU: every section of the GPU acceptance check (issue 23) is
exercised with tiny shapes, so the script is known to run before a GPU is ever lent to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import prewarmed
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_acceptance_script_runs_every_section_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = prewarmed.run([ROOT / "bench" / "gpu_acceptance.py", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    sections = ("tiny_t2v_resume", "expert_switch_memory", "block_activations", "gpu_step", "sync_debug", "vram_plan")
    assert [s for s in sections if "error" in report[s]] == []
    resume = report["tiny_t2v_resume"]
    assert resume["status_resumed"] == "completed" and resume["compared"] == resume["tensors"] > 0
    assert resume["max_abs_diff_lora"] == 0.0  # on a CPU the resumed run is bit for bit the uninterrupted one
    rows = report["block_activations"]["rows"]
    assert len(rows) == 4 and all("error" not in r and r["estimate_bytes_per_token_per_width"] > 0 for r in rows)
    assert report["gpu_step"]["results"][0]["final_loss"] > 0
    # section d runs bench/gpu_step.py --smoke: each setting (bf16, swap, swap + offload) reports s/step, the traffic
    # over the host link and the planner's figure
    steps = {r["config"]: r for r in report["gpu_step"]["results"]}
    assert list(steps) == ["bf16", "bf16-swap1", "bf16-swap1-offload"]
    assert [r["blocks_to_swap"] for r in steps.values()] == [0, 1, 1]
    assert steps["bf16"]["link_bytes_per_step"] == 0 < steps["bf16-swap1-offload"]["link_bytes_per_step"]
    assert all(r["s_per_step"] > 0 and r["planned_allocated_gib"] > 0 and "s_per_step_vs_bf16" in r
               for r in steps.values())
    assert report["gpu_step"]["link_bytes_per_s"] > 0
    assert report["sync_debug"]["status"] == "completed" and report["sync_debug"]["syncs"] == []
    # the 24 GB plan's setting: named from the planner, its estimate recorded; on the CPU the tiny twin runs the
    # same swap and offload code with one block swapped, and its offload traffic is counted
    plan = report["vram_plan"]
    assert plan["plan"].startswith(("bf16-swap", "fp8-swap")) and plan["planned_card_gib"] <= 24.0
    assert plan["ran"] == "bf16-swap1-offload" and plan["link_bytes_per_step"] > 0
    assert "peak_allocated_gib" not in plan  # only CUDA measures it
    resume, judged = report["tiny_t2v_resume"], report["thresholds"]
    assert resume["state_checked"] > 0 and resume["state_off_device"] == []
    assert judged["optimizer_state_on_device"]["holds"] is True
    assert judged["planner_within_10_percent"]["holds"] is None  # a CPU measures no VRAM: not judged


def test_gpu_step_refuses_an_unknown_setting_in_one_line(capsys):
    """``bench/gpu_step.py``'s settings (every one runs in the acceptance smoke above): an unknown one is refused."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("gpu_step", ROOT / "bench" / "gpu_step.py")
        gpu_step = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gpu_step)
        with pytest.raises(SystemExit) as exit_:
            gpu_step.main(["--smoke", "--settings", "bf16-swap9"])
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert exit_.value.code == 2 and "unknown setting 'bf16-swap9'" in capsys.readouterr().err


def test_the_gpu_acceptance_run_exits_non_zero_naming_each_missed_threshold(monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_acceptance", ROOT / "bench" / "gpu_acceptance.py")
    acceptance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acceptance)
    figures = {"planner_error_pct": 12.5, "peak_reserved_gib": 23.1, "s_per_step_vs_bf16": 1.31}
    monkeypatch.setitem(acceptance.SECTIONS, "f", ("vram_plan", lambda device, smoke: dict(figures)))
    monkeypatch.setitem(acceptance.SECTIONS, "a", ("tiny_t2v_resume", lambda device, smoke: {
        "state_off_device": ["step 5: exp_avg on cpu, parameter on cuda:0"]}))
    assert acceptance.main(["--device", "cpu", "--only", "a,f"]) == 1
    err = capsys.readouterr().err
    missed = [line.split(" ")[1] for line in err.splitlines() if line.startswith("missed: ")]
    assert missed == ["planner_within_10_percent", "swap_plan_speed", "optimizer_state_on_device"]
    figures.update(planner_error_pct=-4.0, s_per_step_vs_bf16=1.1)
    monkeypatch.setitem(acceptance.SECTIONS, "a", ("tiny_t2v_resume", lambda device, smoke: {"state_off_device": []}))
    assert acceptance.main(["--device", "cpu", "--only", "a,f"]) == 0


def test_the_wheel_script_names_a_pinned_cpython_312_manylinux_download_of_exactly_the_missing_packages():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "fetch_wheels.py"), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cmd = done.stdout.split()
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "manylinux2014_x86_64" in cmd
    assert cmd[cmd.index("--dest") + 1].endswith(".whl")
    pinned = sorted(c.split("==")[0] for c in cmd if "==" in c)
    assert pinned == sorted(["diffusers", "structlog", "tensorboardX", "av", "ftfy", "wcwidth", "orjson", "cattrs",
                             "tomli-w", "crc32c"])
    assert not (ROOT / ".whl").exists() or subprocess.run(["git", "check-ignore", "-q", ".whl/x.whl"],
                                                          cwd=ROOT).returncode == 0
