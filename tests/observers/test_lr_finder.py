"""The LR finder observer on the real ``Trainer`` with the core's linear stand-in model: the sweep through
``control.set_lr``, the stop rule on an exploding and on a NaN loss, pinned draws, two experts in turn, the exact
restore of ``--lr-finder-then-train``, and the outputs (CSV, PNG, TensorBoard scalars and chart image)."""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path

import attrs
import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.core.fakes import LinearAdapter, LinearBatches, linear_batches
from wantrain.app.lr_finder import SweepOrder, load_initial_state
from wantrain.core.bus import Bus
from wantrain.core.checkpoint import copy_tree
from wantrain.core.events import OptimizerStepped, from_record, to_record
from wantrain.core.faults import inject_faults
from wantrain.core.loop import LoopSettings, Trainer
from wantrain.core.settings import FaultsConfig
from wantrain.core.state import TrainState
from wantrain.observers.lr_finder.config import LrFinderConfig
from wantrain.observers.lr_finder.math import sweep_lrs
from wantrain.observers.lr_finder.observer import LrFinder, LrFinderResult, LrFinderRung, Probe, van_der_corput


def linear_probe_loss(adapter, batches, timesteps, seed, control):
    """The linear stand-in's probe: its MSE on fixed batches without grad (``validate``'s signature; the stand-in
    has no timesteps)."""
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(adapter.models[adapter.activated[-1]](b["x"]), b["y"]) for b in batches]
    return {"val/loss": float(torch.stack(losses).mean())}


def linear_probe(adapter) -> Probe:
    batches = list(itertools.islice(linear_batches(seed=99), 2))
    return Probe(batches=batches, timesteps={e: (0.5,) for e in adapter.experts}, seed=0, evaluate=linear_probe_loss)


def finder_trainer(cfg: LrFinderConfig, *, experts=(None,), optimizer: str = "sgd", run_dir: Path | None = None,
                   tensorboard: bool = False, adapter=None, faults: FaultsConfig | None = None, batches=None,
                   grad_accum: int = 1, probe=None):
    adapter = adapter or LinearAdapter(experts=experts)
    probe = probe or (linear_probe(adapter) if cfg.noise == "probe" else None)
    finder = LrFinder(cfg, experts=tuple(adapter.experts), grad_accum=grad_accum, run_dir=run_dir,
                      tensorboard=tensorboard, probe=probe)
    groups = adapter.param_groups()
    opt = torch.optim.SGD(groups, lr=0.01) if optimizer == "sgd" else torch.optim.AdamW(groups, lr=0.01)
    bus = Bus()
    finder.attach_to(bus)
    seen = []
    bus.subscribe(OptimizerStepped, lambda e, ctx: seen.append(e))
    records = []
    bus.add_journal(records.append)
    state = TrainState()
    model = SweepOrder(adapter, finder.steps_per_expert)
    if faults is not None:
        model = inject_faults(model, opt, faults, state)
    trainer = Trainer(adapter=model, batches=batches or LinearBatches(), optimizer=opt, state=state,
                      settings=LoopSettings(max_steps=finder.total_steps, log_every=1, clip_grad_norm=None,
                                            grad_accum=grad_accum),
                      bus=bus, run_dir=run_dir)
    return trainer, finder, seen, records


def test_the_sweep_sets_each_rungs_lr_through_the_control_object_exactly_end_to_end():
    cfg = LrFinderConfig(enabled=True, steps=12, start_lr=1e-5, end_lr=1e-2, steps_per_lr=2, burn_in=3)
    trainer, finder, seen, _ = finder_trainer(cfg)
    result = trainer.run()
    assert result.status == "completed" and result.steps == 24
    used = [e.lrs[0] for e in seen]
    expected = [lr for lr in sweep_lrs(1e-5, 1e-2, 12) for _ in range(2)]
    assert used == expected and used[-1] == 1e-2
    assert finder.finished and finder.results[None].rungs == 12


def test_divergence_stop_fires_on_an_exploding_loss():
    # SGD on a linear regression diverges once the LR passes 2 / largest curvature: the loss grows geometrically
    cfg = LrFinderConfig(enabled=True, steps=60, start_lr=1e-4, end_lr=100.0, burn_in=5)
    trainer, finder, seen, records = finder_trainer(cfg)
    result = trainer.run()
    r = finder.results[None]
    assert result.status == "stopped" and finder.finished
    assert r.stop_reason is not None and "exceeds 4 x its lowest" in r.stop_reason
    assert 5 < r.rungs < 60 and result.steps == r.rungs
    stopped_at = sweep_lrs(1e-4, 100.0, 60)[r.rungs - 1]
    assert r.suggested_lr is not None and r.suggested_lr < stopped_at
    rungs = [from_record(x) for x in records if x["_type"] == "LrFinderRung"]
    assert [x.rung for x in rungs] == list(range(r.rungs))  # the event log holds the whole sweep
    raw = [x.raw_loss for x in rungs]  # the stop rule's level: the median of the last 5 raw losses
    levels = [float(np.median(raw[max(0, k - 4): k + 1])) for k in range(len(raw))]
    assert levels[-1] > 4 * min(levels) and levels[-2] <= 4 * min(levels[:-1])


def test_divergence_stop_fires_on_a_nan_loss():
    cfg = LrFinderConfig(enabled=True, steps=40, start_lr=1e-6, end_lr=1e-3, burn_in=10)
    trainer, finder, _, _ = finder_trainer(cfg, faults=FaultsConfig(nan_at_steps=[7]))
    result = trainer.run()
    r = finder.results[None]
    assert result.status == "stopped"
    assert r.rungs == 7 and "not finite" in r.stop_reason  # at once, inside the burn-in
    nan_lr = sweep_lrs(1e-6, 1e-3, 40)[6]
    assert r.suggested_lr is not None and r.suggested_lr < nan_lr  # from the six finite rungs before it
    assert r.suggested_lr in sweep_lrs(1e-6, 1e-3, 40)[:6]


class DrawRecorder(LinearAdapter):
    """Records the first number each forward pass draws from the trainer's generator (the noise stand-in)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.draws: list[float] = []

    def loss(self, batch, expert, generator):
        self.draws.append(float(torch.rand(1, generator=generator)))
        return super().loss(batch, expert, generator)


def test_fixed_noise_gives_every_rung_the_first_rungs_draws_and_random_does_not():
    draws = {}
    for noise in ("fixed", "random"):
        adapter = DrawRecorder()
        cfg = LrFinderConfig(enabled=True, steps=8, start_lr=1e-5, end_lr=1e-3, steps_per_lr=2, noise=noise,
                             burn_in=2)
        trainer, _, _, _ = finder_trainer(cfg, adapter=adapter)
        assert trainer.run().status == "completed"
        draws[noise] = adapter.draws
    fixed = draws["fixed"]
    assert fixed[0] != fixed[1]  # two different draws inside the rung ...
    assert fixed == fixed[:2] * 8  # ... replayed at every rung
    assert len(set(draws["random"])) == 16


def test_stratified_noise_walks_a_van_der_corput_sequence_of_timestep_quantiles():
    class QuantileRecorder(LinearAdapter):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.quantiles: list[float] = []

        def set_timestep_quantile(self, q):
            self.quantiles.append(q)

    adapter = QuantileRecorder()
    cfg = LrFinderConfig(enabled=True, steps=8, start_lr=1e-5, end_lr=1e-3, noise="stratified", burn_in=2)
    trainer, _, _, _ = finder_trainer(cfg, adapter=adapter)
    trainer.run()
    assert adapter.quantiles == [0.5, 0.25, 0.75, 0.125, 0.625, 0.375, 0.875, 0.0625]
    assert adapter.quantiles == [van_der_corput(i) for i in range(1, 9)]


def test_two_experts_are_swept_in_turn_each_with_its_own_group_and_suggestion():
    cfg = LrFinderConfig(enabled=True, steps=10, start_lr=1e-5, end_lr=1e-2, burn_in=2)
    trainer, finder, seen, _ = finder_trainer(cfg, experts=("high_noise", "low_noise"))
    assert trainer.run().status == "completed"
    assert [e.expert for e in seen] == ["high_noise"] * 10 + ["low_noise"] * 10
    lrs = sweep_lrs(1e-5, 1e-2, 10)
    assert [e.lrs[0] for e in seen[:10]] == lrs and [e.lrs[1] for e in seen[10:]] == lrs
    assert set(finder.results) == {"high_noise", "low_noise"}
    assert all(r.suggested_lr is not None for r in finder.results.values())


def test_a_diverged_first_expert_skips_its_remaining_steps_and_the_second_still_sweeps():
    cfg = LrFinderConfig(enabled=True, steps=40, start_lr=1e-4, end_lr=100.0, burn_in=5)
    trainer, finder, seen, _ = finder_trainer(cfg, experts=("high_noise", "low_noise"))
    result = trainer.run()
    high, low = finder.results["high_noise"], finder.results["low_noise"]
    assert high.stop_reason is not None and high.rungs < 40
    skipped = [e for e in seen if e.expert == "high_noise" and e.skipped]
    assert len(skipped) == 40 - high.rungs  # the rest of its steps change nothing
    assert low.rungs >= 1 and low.stop_reason is not None  # the same explosion on the second expert ...
    assert result.status == "stopped" and finder.finished  # ... which then ends the run


def test_then_train_restore_is_bitwise_for_lora_and_optimizer_state_after_a_sweep():
    adapter = LinearAdapter()
    opt_cfg = LrFinderConfig(enabled=True, then_train=True, steps=20, start_lr=1e-4, end_lr=1.0, burn_in=5)
    trainer, finder, _, _ = finder_trainer(opt_cfg, adapter=adapter, optimizer="adamw")
    # give the optimizer a real state first: a few ordinary steps with another trainer on the same objects
    warm = Trainer(adapter=adapter, batches=trainer.batches, optimizer=trainer.optimizer,
                   settings=LoopSettings(max_steps=3, log_every=1))
    warm.run()
    assert trainer.optimizer.state  # Adam moments exist
    before = copy_tree(trainer.state_dict())
    trainer.run()
    moved = [k for k, v in trainer.state_dict()["model"].items() if not torch.equal(v, before["model"][k])]
    assert moved  # the sweep did change the weights
    compared = load_initial_state(trainer, before)
    now = trainer.state_dict()
    for key, value in before["model"].items():
        assert torch.equal(now["model"][key], value), key
    states = before["optimizer"]["state"]
    assert compared == len(before["model"]) + sum(len(s) for s in states.values())
    for index, entry in states.items():
        for name, value in entry.items():
            assert torch.equal(now["optimizer"]["state"][index][name], value), (index, name)
    assert trainer.batches.state_dict() == before["data"]
    assert torch.equal(trainer.generator.get_state(), before["generator"])


def test_restore_check_refuses_a_state_that_differs_from_the_copy():
    adapter = LinearAdapter()
    trainer, _, _, _ = finder_trainer(LrFinderConfig(enabled=True, steps=5, burn_in=1), adapter=adapter)
    before = copy_tree(trainer.state_dict())

    original = trainer.load_state_dict

    def tampered(tree, **kw):
        out = original(tree, **kw)
        with torch.no_grad():
            adapter.trainable_parameters()[0].add_(1.0)
        return out

    trainer.load_state_dict = tampered
    try:
        load_initial_state(trainer, before)
    except RuntimeError as exc:
        assert "differs from the copy" in str(exc)
    else:
        raise AssertionError("a tampered restore was not detected")


def test_outputs_csv_png_and_tensorboard_scalars_and_chart_image(tmp_path):
    cfg = LrFinderConfig(enabled=True, steps=15, start_lr=1e-5, end_lr=1e-1, burn_in=3)
    trainer, finder, _, _ = finder_trainer(cfg, run_dir=tmp_path, tensorboard=True)
    assert trainer.run().status == "completed"
    rows = list(csv.DictReader((tmp_path / "lr_finder.csv").open()))
    assert len(rows) == 15 and float(rows[-1]["lr"]) == 0.1
    assert all(math.isfinite(float(r["smoothed_loss"])) for r in rows)
    assert (tmp_path / "lr_finder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "lr_finder.json").exists()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    tags = acc.Tags()
    assert {"lr_finder/raw_loss", "lr_finder/smoothed_loss", "lr_finder/learning_rate"} <= set(tags["scalars"])
    assert [s.value for s in acc.Scalars("lr_finder/learning_rate")] == \
        [float(torch.tensor(x, dtype=torch.float32)) for x in sweep_lrs(1e-5, 1e-1, 15)]
    assert "lr_finder/chart" in tags["images"]
    (image,) = acc.Images("lr_finder/chart")
    assert image.width > 300 and image.height > 200 and image.encoded_image_string[:4] == b"\x89PNG"


def test_finder_events_round_trip_through_the_event_record():
    rung = LrFinderRung(step=3, expert="low_noise", rung=2, lr=1e-3, raw_loss=0.5, smoothed_loss=0.6)
    result = LrFinderResult(step=9, expert=None, suggestions={"valley": 1e-3, "steepest": None, "minimum": 2e-4},
                            default="valley", suggested_lr=1e-3, stop_reason=None, warnings=("w",), rungs=9)
    for event in (rung, result):
        assert from_record(to_record(event, 1, 0.0)) == event
    assert attrs.asdict(result)["suggestions"]["steepest"] is None


def test_timestep_quantile_places_the_batch_at_evenly_spread_quantiles_of_the_band():
    from wantrain.models.wan22.timesteps import Band, TimestepSampler

    sampler = TimestepSampler(method="logit_normal", shift=1.0)
    g = torch.Generator().manual_seed(0)
    t = sampler.sample(4, Band(low=0.0, high=1.0), g, torch.device("cpu"), quantile=0.5)
    expected = torch.sigmoid(torch.special.ndtri(torch.tensor([0.5, 0.75, 0.0, 0.25], dtype=torch.float64)))
    assert torch.allclose(t, expected)
    high = sampler.sample(2, Band(low=0.9, high=1.0), g, torch.device("cpu"), quantile=0.25)
    assert (high >= 0.9).all() and high[0] < high[1]  # inside the expert's band, in quantile order
