"""The LR finder's default measurement, ``noise = "probe"``: each rung trains with the normal random draws and is
measured on a fixed no-grad probe through ``[validation]``'s own ``validate`` (docs/lr_finder.md). On a toy flow-
matching denoiser driven by the real ``Trainer``: the old ``fixed`` mode's bias (it trains on the draws it measures)
and its absence with the probe, the probe's fixed clips/timesteps/noise at every rung, replay of the event log, a
non-finite micro-loss under ``grad_accum = 2``, and the config-time refusal and warning."""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch

from wantrain.app.config import load_config
from wantrain.app.lr_finder import SweepOrder
from wantrain.core.bus import Bus, Observer, Priority, on
from wantrain.core.errors import ConfigError
from wantrain.core.events import MetricsLogged, OptimizerStepped, RunStarted, from_record
from wantrain.core.loop import LoopSettings, Trainer
from wantrain.observers.evaluation.validation import validate
from wantrain.observers.lr_finder.config import LrFinderConfig
from wantrain.observers.lr_finder.observer import PROBE_METRIC, LrFinder, Probe

DIM, CLIPS = 8, 4


class ToyDenoiser:
    """A linear flow-matching denoiser (velocity ``noise - x0`` predicted from ``[x_t, t]``) on fixed clips: the
    adapter interface the loop needs plus the validation capability. ``loss`` draws t ~ U(0, 1) and the noise from
    the trainer's generator, as the Wan adapter does."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.experts = (None,)
        self.active = None
        self.device = torch.device("cpu")
        self.model = torch.nn.Linear(DIM + 1, DIM)
        self.probe_calls: list[tuple[int, float, float]] = []  # (clip id, t, noise checksum) per probe forward
        self.nan_at_calls: set[int] = set()
        self.calls = 0

    def param_groups(self):
        return [{"params": list(self.model.parameters()), "lr": 0.01, "name": "lora"}]

    def expert_for_step(self, step):
        return None

    def activate(self, expert, optimizer):
        self.active = expert

    def trainable_parameters(self, expert=None):
        return list(self.model.parameters())

    def _mse(self, x0, t, noise):
        x_t = (1 - t) * x0 + t * noise
        pred = self.model(torch.cat([x_t, t.expand(x0.shape[0], 1)], dim=1))
        return ((pred - (noise - x0)) ** 2).mean()

    def loss(self, batch, expert, generator):
        self.calls += 1
        x0 = batch["latents"]
        t = torch.rand(1, 1, generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        loss = self._mse(x0, t, noise)
        return loss * math.nan if self.calls in self.nan_at_calls else loss

    # -- the validation capability --
    def expert_for_timestep(self, t):
        return None

    @contextlib.contextmanager
    def evaluating(self):
        with torch.no_grad():
            yield

    def validation_loss(self, batch, t, noise):
        self.probe_calls.append((int(batch["clip"]), float(t), float(noise.sum())))
        return self._mse(batch["latents"], torch.tensor([[t]]), noise)

    def fresh_draw_loss(self, clips, draws: int = 400) -> float:
        """The expected loss over the training distribution (fresh t and noise), estimated with many draws."""
        g = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            x0 = clips.repeat(draws, 1)
            t = torch.rand(x0.shape[0], 1, generator=g)
            noise = torch.randn(x0.shape, generator=g)
            x_t = (1 - t) * x0 + t * noise
            return float(((self.model(torch.cat([x_t, t], dim=1)) - (noise - x0)) ** 2).mean())


def toy_clips() -> torch.Tensor:
    return torch.randn(CLIPS, DIM, generator=torch.Generator().manual_seed(7)) * 2.0


def toy_batches(clips):
    """Endless one-clip batches in order (the stream the loop trains on)."""
    i = 0
    while True:
        yield {"latents": clips[i % CLIPS][None], "clip": torch.tensor(i % CLIPS)}
        i += 1


class FreshDrawLoss(Observer):
    """Test instrument: the fresh-draw loss of the weights each rung was measured at (the truth a rung's loss
    should estimate), taken at the same point as the probe."""

    priority = Priority.SINK

    def __init__(self, adapter, clips, steps_per_lr: int) -> None:
        self.adapter, self.clips, self.steps_per_lr = adapter, clips, steps_per_lr
        self.before: dict[int, float] = {}  # step -> fresh-draw loss before the step's update
        self.after: dict[int, float] = {}

    @on(RunStarted)
    def on_run_started(self, event, ctx):
        self.before[1] = self.adapter.fresh_draw_loss(self.clips)

    @on(OptimizerStepped)
    def on_optimizer_stepped(self, event, ctx):
        self.after[event.step] = self.before[event.step + 1] = self.adapter.fresh_draw_loss(self.clips)


def toy_probe(clips, timesteps: int = 4) -> Probe:
    batches = [{"latents": clips[i][None], "clip": torch.tensor(i)} for i in range(CLIPS)]
    ts = tuple((k + 0.5) / timesteps for k in range(timesteps))
    return Probe(batches=batches, timesteps={None: ts}, seed=3, evaluate=validate)


def toy_sweep(noise: str, *, steps: int = 40, grad_accum: int = 1, adapter=None, seed: int = 0):
    adapter = adapter or ToyDenoiser()
    clips = toy_clips()
    cfg = LrFinderConfig(enabled=True, steps=steps, start_lr=1e-3, end_lr=1.0, noise=noise, burn_in=5,
                         diverge_factor=1e6)
    probe = toy_probe(clips) if noise == "probe" else None
    finder = LrFinder(cfg, experts=(None,), grad_accum=grad_accum, probe=probe)
    bus = Bus()
    finder.attach_to(bus)
    truth = FreshDrawLoss(adapter, clips, cfg.steps_per_lr)
    bus.attach(truth)
    records: list[dict] = []
    bus.add_journal(records.append)
    opt = torch.optim.AdamW(adapter.param_groups(), lr=0.01, weight_decay=0.0)
    trainer = Trainer(adapter=SweepOrder(adapter, finder.steps_per_expert), batches=toy_batches(clips),
                      optimizer=opt, bus=bus, seed=seed,
                      settings=LoopSettings(max_steps=finder.total_steps, log_every=1, clip_grad_norm=None,
                                            grad_accum=grad_accum))
    result = trainer.run()
    return result, finder, truth, records, adapter


def rung_rows(finder):
    return finder.sweeps[0].rows


def test_fixed_noise_records_losses_far_below_the_fresh_draw_loss_and_the_probe_does_not():
    _, fixed, fixed_truth, _, _ = toy_sweep("fixed")
    _, probe, probe_truth, _, _ = toy_sweep("probe")
    # fixed: the rung's loss is the training loss on rung 0's draws, taken before the step's update
    fixed_ratio = [r["raw_loss"] / fixed_truth.before[r["step"]] for r in rung_rows(fixed)]
    # probe: measured after the rung's update, on draws it never trained on
    probe_ratio = [r["raw_loss"] / probe_truth.after[r["step"]] for r in rung_rows(probe)]
    assert min(fixed_ratio) < 0.2  # the failure: memorised draws (measured: 0.08)
    fixed_best = min(r["raw_loss"] for r in rung_rows(fixed))
    assert fixed_best < 0.2 * min(fixed_truth.before.values())  # below any loss the weights reach (0.26 vs 2.95)
    assert all(0.6 < x < 1.6 for x in probe_ratio), probe_ratio  # an estimate of the true loss at every rung
    best = min(rung_rows(probe), key=lambda r: r["raw_loss"])
    fresh_best = min(probe_truth.after.values())
    assert best["raw_loss"] > 0.6 * fresh_best  # its minimum is no memorised low


def test_the_probe_measures_the_same_clips_timesteps_and_noise_at_every_rung():
    _, finder, _, _, adapter = toy_sweep("probe", steps=12)
    calls = adapter.probe_calls
    per_rung = CLIPS * 4
    assert len(calls) == 12 * per_rung  # one probe of clips x timesteps forwards per rung
    rungs = [calls[i:i + per_rung] for i in range(0, len(calls), per_rung)]
    assert all(r == rungs[0] for r in rungs)  # identical clips, timesteps and noise
    assert {c for c, _, _ in rungs[0]} == set(range(CLIPS)) and len({t for _, t, _ in rungs[0]}) == 4
    assert len({n for _, _, n in rungs[0]}) == per_rung  # each (clip, timestep) its own noise
    losses = [r["raw_loss"] for r in rung_rows(finder)]
    assert len(set(losses)) == 12  # ... while the weights, and so the measured loss, change


def test_probe_losses_reach_the_event_log_and_a_replay_reproduces_the_sweep():
    result, finder, _, records, _ = toy_sweep("probe", steps=20)
    logged = [from_record(r) for r in records if r["_type"] == "MetricsLogged"]
    assert all(PROBE_METRIC in m.values for m in logged)  # host values in the log
    fresh = LrFinder(finder.cfg, experts=(None,), grad_accum=1, probe=None)

    class Control:
        def request_stop(self, reason):
            pass

    class Ctx:
        control = Control()

    for event in logged:  # replay: the logged values alone, no model
        fresh.on_metrics_logged(event, Ctx())
    assert fresh.sweeps[0].rows == finder.sweeps[0].rows
    assert fresh.results == finder.results and fresh.results[None].suggested_lr is not None


def test_a_non_finite_micro_loss_under_grad_accum_2_stops_the_sweep():
    adapter = ToyDenoiser()
    adapter.nan_at_calls = {13}  # the first micro-batch of optimizer step 7; the second is finite
    result, finder, _, records, _ = toy_sweep("probe", grad_accum=2, adapter=adapter)
    r = finder.results[None]
    assert r.rungs == 7 and r.stop_reason is not None and "not finite" in r.stop_reason
    assert result.status == "stopped"
    step7 = next(from_record(x) for x in records if x["_type"] == "MetricsLogged" and x["step"] == 7)
    assert math.isfinite(step7.values["train/loss"])  # the finite-only mean alone hides it


@pytest.mark.parametrize("noise", ["random", "stratified"])
def test_a_non_finite_micro_loss_stops_the_training_loss_modes_too(noise):
    adapter = ToyDenoiser()
    adapter.nan_at_calls = {14}  # the second micro-batch of optimizer step 7
    _, finder, _, _, _ = toy_sweep(noise, grad_accum=2, adapter=adapter)
    assert finder.results[None].rungs == 7 and "not finite" in finder.results[None].stop_reason


def test_a_run_id_too_long_for_the_lr_finder_suffix_is_refused_when_the_config_is_read(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\n[data]\npath = "d"\n', encoding="utf-8")
    fits = "a" * 89
    load_config(config, [f'run.run_id="{"a" * 100}"'])  # valid without the finder
    load_config(config, [f'run.run_id="{fits}"', "lr_finder.enabled=true"])
    with pytest.raises(ConfigError, match=r"run.run_id is 90 characters.*at most 89"):
        load_config(config, [f'run.run_id="{fits}a"', "lr_finder.enabled=true"])
    with pytest.raises(ConfigError, match="at most 89"):
        load_config(config, [f'run.run_id="{"a" * 100}"', "lr_finder.then_train=true"])


def test_linear_mode_over_more_than_a_decade_warns_when_the_config_is_read(caplog):
    with caplog.at_level(logging.WARNING, logger="wantrain.lr_finder"):
        LrFinderConfig(mode="linear", start_lr=1e-4, end_lr=1e-3)
        LrFinderConfig(mode="exp", start_lr=1e-7, end_lr=10.0)
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="wantrain.lr_finder"):
        LrFinderConfig(mode="linear", start_lr=1e-5, end_lr=1e-2)
    assert len(caplog.records) == 1 and "lr_finder.mode = 'linear'" in caplog.records[0].getMessage()
    assert "spans 3.0 decades" in caplog.records[0].getMessage()


def test_metrics_logged_outside_the_sweep_is_ignored():
    finder = LrFinder(LrFinderConfig(enabled=True, steps=5, burn_in=1, noise="random"), experts=(None,),
                      grad_accum=1)
    finder.on_metrics_logged(MetricsLogged(step=0, expert=None, values={"val/loss": 1.0}, elapsed_s=0.0,
                                           total_steps=5), None)
    assert finder.sweeps[0].rows == [] and finder.sweeps[0].rung_losses == []
