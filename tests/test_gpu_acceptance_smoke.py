"""``bench/gpu_acceptance.py --smoke`` runs on the CPU: every section of the GPU acceptance check (issue 23) is
exercised with tiny shapes, so the script is known to run before a GPU is ever lent to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_acceptance_script_runs_every_section_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_acceptance.py"), "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    sections = ("tiny_t2v_resume", "expert_switch_memory", "block_activations", "gpu_step", "sync_debug")
    assert [s for s in sections if "error" in report[s]] == []
    resume = report["tiny_t2v_resume"]
    assert resume["status_resumed"] == "completed" and resume["compared"] == resume["tensors"] > 0
    assert resume["max_abs_diff_lora"] == 0.0  # on a CPU the resumed run is bit for bit the uninterrupted one
    rows = report["block_activations"]["rows"]
    assert len(rows) == 4 and all("error" not in r and r["estimate_bytes_per_token_per_width"] > 0 for r in rows)
    assert report["gpu_step"]["results"][0]["final_loss"] > 0
    assert report["sync_debug"]["status"] == "completed" and report["sync_debug"]["syncs"] == []
