"""The seed's I2V alpha-schedule example loads in the seed's spelling, builds on the tiny I2V twin, and its
schedule -- the real statistics and policy, the example's steps scaled down -- reaches every phase on both experts
within its max_steps on a loss that falls and flattens, and holds a rising loss."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from wantrain.app.config import load_config
from wantrain.models.wan22 import build_adapter

ROOT = Path(__file__).resolve().parents[2]


def test_the_seed_i2v_example_loads_in_the_seed_spelling_and_builds_on_the_tiny_twin(tiny_dir):
    example = ROOT / "examples" / "i2v_a14b_alpha_schedule.toml"
    as_written = load_config(example)
    assert as_written.model.variant == "i2v-a14b"
    schedule = as_written.lora.alpha_schedule
    assert [(p.name, p.alpha, p.min_steps) for p in schedule.phases] == [
        ("foundation", 8.0, 3000), ("balance", 14.0, 3000), ("emphasis", 20.0, 2000)]
    assert schedule.phases[0].exit_criteria.min_loss_r2 == 0.01  # read from the seed's exit_criteria ...
    assert schedule.phases[0].criterion("min_loss_r2", schedule.preset) is None  # ... and advisory, as in the seed
    assert schedule.phases[0].criterion("loss_improvement_rate_below", schedule.preset) == 0.005
    cfg = load_config(example, ["model.variant=tiny-i2v", f"model.path={tiny_dir('tiny-i2v')}"])
    adapter = build_adapter(cfg.model, cfg.lora, seed=0, device=torch.device("cpu"), base_lr=cfg.optimizer.lr)
    assert {adapter.lora_alpha(e) for e in adapter.experts} == {8.0}


@pytest.mark.slow
def test_the_shipped_example_makes_a_transition_per_expert_on_the_tiny_i2v_twin(tiny_dir, tmp_path):
    """The example on the tiny I2V twin and the demo clips, its steps scaled down (min_steps 20, window 40, 100 run
    steps: 50 per expert, the first look at 40) and delta raised to 0.3 per 100 steps (over a window of 40 steps
    the twin's per-step CV of 0.03-0.04 gives the rate a standard error of 0.03-0.05; measured upper bounds at the
    first look 0.065 and 0.088); gradient checkpointing off (the twin needs no memory saving): both experts leave
    their first phase through the real run, at their first look."""
    import json
    import shutil

    from wantrain.cli.main import main

    shutil.copytree(ROOT / "examples" / "demo_data", tmp_path / "demo_data",
                    ignore=shutil.ignore_patterns(".wantrain_cache"))
    config = tmp_path / "example.toml"
    shutil.copy(ROOT / "examples" / "i2v_a14b_alpha_schedule.toml", config)
    scaled = [f"lora.alpha_schedule.conv_alpha_phases.{name}.{key}" for name in ("foundation", "balance")
              for key in ("min_steps=20", "exit_criteria.loss_improvement_rate_below=0.3")]
    scaled += ["lora.alpha_schedule.window=40", "lora.alpha_schedule.min_samples=30"]
    args = ["run", str(config), "--max-steps", "100", "--set", "model.variant='tiny-i2v'",
            "--set", f"model.path='{tiny_dir('tiny-i2v')}'", "--set", "model.base_dtype='auto'",
            "--set", f"data.path='{tmp_path / 'demo_data'}'", "--set", "train.device='cpu'",
            "--set", f"run.output_dir='{tmp_path}'",
            "--set", "train.save_every=100000", "--set", "observers.progress=false",
            "--set", "model.gradient_checkpointing=false",
            "--set", "observers.tensorboard=false", *[x for item in scaled for x in ("--set", item)]]
    assert main(args) == 0
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir() and d.name != "demo_data"]
    changed = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()
               if json.loads(line)["event"] == "alpha_changed"]
    assert {c["expert"] for c in changed} == {"high_noise", "low_noise"}, changed
    assert all(c["phase"] == "foundation -> balance" for c in changed[:2])
    assert all(c["steps_in_phase"] == 40 for c in changed)  # at the first look: one window of 40 expert steps


SCALE = 10  # steps / 10; the per-step CV / 10^1.5 keeps every look's power (the rate's se ∝ CV·window^-1.5)


def _scaled_example():
    import attrs

    cfg = load_config(ROOT / "examples" / "i2v_a14b_alpha_schedule.toml")
    s = cfg.lora.alpha_schedule
    phases = [attrs.evolve(p, min_steps=p.min_steps // SCALE) for p in s.phases]
    scaled = attrs.evolve(s, phases=phases, window=s.resolved("window") // SCALE,
                          min_samples=s.resolved("min_samples") // SCALE)
    return cfg, scaled


def _transitions(schedule, cfg, mean, cv, seed):
    """Run the example's two experts (alternating every model.switch_every steps, logged every train.log_every)
    for max_steps / SCALE run steps through the real windows, statistics and policy, each expert's per-step loss
    ``mean(i) × log-normal noise of CV cv`` at its i-th step; returns the policy's transitions."""
    from wantrain.observers.alpha.controller import AlphaPolicy
    from wantrain.observers.alpha.stats import DeviceWindow, loss_statistics

    experts = ("high_noise", "low_noise")
    policy = AlphaPolicy(schedule, experts)
    windows = {e: DeviceWindow(schedule.resolved("window"), "cpu") for e in experts}
    count, trained, rng = dict.fromkeys(experts, 0), set(), np.random.default_rng(seed)
    sigma = math.sqrt(math.log(1 + cv * cv))
    for step in range(1, cfg.train.max_steps // SCALE + 1):
        expert = experts[((step - 1) // cfg.model.switch_every) % 2]
        loss = mean(count[expert]) * math.exp(rng.normal(-sigma * sigma / 2, sigma))
        windows[expert].push(torch.tensor(loss))
        count[expert] += 1
        trained.add(expert)
        if step % cfg.train.log_every:
            continue
        values = {}
        for e in sorted(trained):
            values.update({f"alpha/{k}/{e}": float(v) for k, v in loss_statistics(windows[e]).items()})
            values.update({f"alpha/steps/{e}": float(count[e]), f"alpha/gradient_stability/{e}": 0.75})
        trained.clear()
        policy.observe(step, values)
    return policy.history


@pytest.mark.parametrize("cv", [0.3, 0.5])
def test_the_example_reaches_every_phase_on_both_experts_on_a_loss_that_falls_and_flattens(cv):
    cfg, schedule = _scaled_example()
    falling = lambda i: 1 + 0.5 * math.exp(-i / 100)  # noqa: E731  decrease below 0.5 %/100 steps at i ~ 460
    history = _transitions(schedule, cfg, falling, cv / SCALE ** 1.5, seed=int(10 * cv))
    for expert in ("high_noise", "low_noise"):
        mine = [(t["from_phase"], t["to_phase"]) for t in history if t["expert"] == expert]
        assert mine == [("foundation", "balance"), ("balance", "emphasis")], history
        first = next(t for t in history if t["expert"] == expert)
        assert first["steps_in_phase"] >= 460  # not while the loss still fell faster than delta


def test_the_example_on_a_flat_loss_moves_at_its_looks_and_on_a_rising_loss_holds():
    cfg, schedule = _scaled_example()
    window = schedule.resolved("window")
    flat = _transitions(schedule, cfg, lambda i: 1.0, 0.5 / SCALE ** 1.5, seed=1)
    # documented: a flat loss ends each phase at its first or second look (min_steps or one window, plus one)
    for expert in ("high_noise", "low_noise"):
        steps = [t["steps_in_phase"] for t in flat if t["expert"] == expert]
        assert len(steps) == 2 and all(s in (window, 2 * window) for s in steps), flat
    rising = _transitions(schedule, cfg, lambda i: math.exp(0.01 / 100 * i), 0.5 / SCALE ** 1.5, seed=2)
    assert rising == []  # 1 % per 100 steps (the same se and delta as unscaled): held in foundation on both


def test_check_says_the_example_reaches_every_phase_within_its_max_steps():
    from wantrain.app.notes import alpha_schedule_lines

    cfg = load_config(ROOT / "examples" / "i2v_a14b_alpha_schedule.toml")
    lines = alpha_schedule_lines(cfg)
    assert lines[-1] == "  the run gives each expert 18000 steps; the schedule needs 18000", lines
    assert "below the CV 0.5 resolution" not in "\n".join(lines)
