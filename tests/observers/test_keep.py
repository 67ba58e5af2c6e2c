"""The step to keep (wantrain/app/keep.py) on crafted validation series, and in ``wantrain report``'s summary."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from wantrain.app.keep import pick_step
from wantrain.app.report import summarize

TIMESTEPS = (0.1, 0.3, 0.5, 0.7, 0.9)
BASE = {0.1: 0.05, 0.3: 0.2, 0.5: 0.4, 0.7: 0.6, 0.9: 0.9}  # the loss grows with t, as a real one does


def series(offsets: dict[int, float], wiggle: dict[int, float] | None = None,
           motion: dict[int, float] | None = None) -> list[dict]:
    """Validation lines: each timestep's loss is BASE + the step's offset + the step's wiggle with signs
    (+, -, +, -, 0) over the timesteps (a spread that leaves the mean alone); ``motion``: samples/motion_ratio per
    step."""
    out = []
    for step, offset in offsets.items():
        record = {"step": step}
        for i, t in enumerate(TIMESTEPS):
            record[f"val/loss/t_{t:g}"] = BASE[t] + offset + (wiggle or {}).get(step, 0.0) * (1, -1, 1, -1, 0)[i]
        if motion and step in motion:
            record["samples/motion"] = 2.0 * motion[step]
            record["samples/motion_ratio"] = motion[step]
        out.append(record)
    return out


OFFSETS = {100: 0.5, 200: 0.3, 300: 0.1, 400: 0.2, 500: 0.4}


def test_a_clear_minimum_is_kept_and_said_to_be_separated():
    pick = pick_step(series(OFFSETS, wiggle={s: 1e-4 * (s // 100) for s in OFFSETS}))
    # smoothed offsets (3 validations): 0.4, 0.3, 0.2, 0.233, 0.3 -> step 300, then 400 by 0.033
    assert (pick.step, pick.lowest, pick.runner_up) == (300, 300, 400)
    assert abs(pick.difference - 0.1 / 3) < 1e-3 and pick.standard_error < 1e-3
    assert pick.not_separated == (300,) and not pick.by_motion
    assert "the loss separates step 300" in "\n".join(pick.lines())


def test_steps_the_per_timestep_spread_cannot_separate_are_named_and_the_motion_ratio_closest_to_1_decides():
    flat = {100: 0.201, 200: 0.2, 300: 0.199, 400: 0.2, 500: 0.201}  # differences far below the spread
    wiggle = {100: 0.05, 200: -0.04, 300: 0.03, 400: -0.05, 500: 0.04}  # alternating per-timestep noise
    motion = {100: 3.0, 200: 1.2, 300: 0.5, 400: 1.6, 500: 0.95}
    pick = pick_step(series(flat, wiggle, motion))
    assert pick.lowest == 300 and pick.not_separated == (100, 200, 300, 400, 500)  # smoothed: 300 by 0.0003
    assert (pick.step, pick.motion_ratio, pick.by_motion) == (500, 0.95, True)
    text = "\n".join(pick.lines())
    assert "does not separate steps 100, 200, 300, 400, 500" in text and "closest to 1" in text


def test_only_steps_with_lora_files_are_candidates_and_their_files_are_named(tmp_path):
    lora = {"diffusion_model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(1, 1)}
    for step in (200, 400):
        for expert in ("high_noise", "low_noise"):
            save_file(lora, str(tmp_path / f"hero_step{step:06d}_{expert}.safetensors"), metadata={"step": str(step)})
    save_file(lora, str(tmp_path / "hero_high_noise.safetensors"), metadata={"step": "500"})  # the final files
    pick = pick_step(series(OFFSETS, wiggle={s: 1e-4 * (s // 100) for s in OFFSETS}), tmp_path)
    assert pick.step == 400  # 300 has the lowest loss but no files; smoothed 200: 0.3, 400: 0.233, 500: 0.3
    assert pick.files == ("hero_step000400_high_noise.safetensors", "hero_step000400_low_noise.safetensors")
    assert pick_step(series({500: 0.1}), tmp_path).files == ("hero_high_noise.safetensors",)


def test_report_summary_names_the_step_to_keep_and_the_motion_or_says_why_it_cannot():
    text = summarize([{"step": 10, "train/loss": 0.5},
                      *series(OFFSETS, wiggle={s: 1e-4 for s in OFFSETS}, motion={s: 1.0 for s in OFFSETS})])
    assert "keep: step 300" in text and "samples/motion" in text and "(1.00x)" in text
    assert "keep: no validation loss" in summarize([{"step": 10, "train/loss": 0.5}])


def test_the_page_shows_the_same_step_to_keep_as_the_report(tmp_path):
    from wantrain.app.serve.rundata import RunData

    records = series(OFFSETS, wiggle={s: 1e-4 for s in OFFSETS}, motion={s: 1.0 for s in OFFSETS})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    keep = RunData(tmp_path).details()["keep"]
    assert keep[0] == "keep: step 300" and keep == pick_step(records, tmp_path).lines()


def test_a_run_whose_saves_never_meet_a_validation_is_told_how_to_get_a_pick(tmp_path):
    save_file({"x.lora_A.weight": torch.zeros(1, 1)}, str(tmp_path / "hero_step000250_high_noise.safetensors"))
    text = summarize([*series({100: 0.1, 200: 0.2}), {"step": 250, "train/loss": 0.5}], tmp_path)
    assert "keep: no step with saved LoRA files has a validation loss" in text and "save_every" in text


def test_steps_validated_at_other_timesteps_after_a_resume_are_named_not_compared_and_nothing_breaks(tmp_path):
    """Issue 58: a resume that changed validation.timesteps left two candidates without a shared timestep, and the
    mean difference divided by zero in report and on the page."""
    from wantrain.app.serve.rundata import RunData

    before = series({100: 0.3, 200: 0.2, 300: 0.25})
    after = [{"step": s, "val/loss/t_0.2": 0.1 + o, "val/loss/t_0.4": 0.3 + o} for s, o in ((400, 0.05), (500, 0.0))]
    records = [*before, *after]
    pick = pick_step(records)
    assert (pick.lowest, pick.runner_up, pick.not_compared, pick.timesteps) == (500, 400, (100, 200, 300), 2)
    text = "\n".join(pick.lines())
    assert "steps 100, 200, 300: validated at other timesteps (validation.timesteps changed), not compared" in text
    assert "keep: step 500" in summarize(records)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert RunData(tmp_path).details()["keep"] == pick.lines()


def test_the_yardstick_is_the_standard_error_of_the_mean_paired_difference_and_says_what_it_is():
    wiggle = {s: 0.01 * (s // 100) for s in OFFSETS}
    pick = pick_step(series(OFFSETS, wiggle=wiggle))
    smoothed_wiggle = {300: 0.03, 400: (0.03 + 0.04 + 0.05) / 3}  # the windows' means around 300 and 400
    diffs = [(OFFSETS[400] + OFFSETS[300] + OFFSETS[500]) / 3 - (OFFSETS[200] + OFFSETS[300] + OFFSETS[400]) / 3
             + (smoothed_wiggle[400] - smoothed_wiggle[300]) * sign for sign in (1, -1, 1, -1, 0)]
    mean = sum(diffs) / 5
    expected = (sum((d - mean) ** 2 for d in diffs) / 4 / 5) ** 0.5
    assert abs(pick.difference - mean) < 1e-9 and abs(pick.standard_error - expected) < 1e-9
    assert "sd of the 5 per-timestep differences / sqrt(5): a yardstick, not a confidence interval" in "\n".join(
        pick.lines())
