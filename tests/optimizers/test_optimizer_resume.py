"""Every optimizer type on the core's tiny linear stand-in: a run stopped and restored from its checkpoint continues
bitwise like the uninterrupted run, with per-expert groups of different LRs, a one-step ``set_lr`` request,
clipping and non-finite steps; schedule-free saves its averaged weights; Prodigy's d * lr is logged."""

from __future__ import annotations

import pytest
import torch

from tests.core.fakes import LinearAdapter, LinearBatches
from tests.core.test_guards_and_state import StopAt
from tests.core.test_loop import ListSaver, Recorder
from wantrain.core.bus import Bus, Observer, on
from wantrain.core.checkpoint import read_checkpoint
from wantrain.core.events import MetricsLogged, OptimizerStepped, StepStarted
from wantrain.core.faults import inject_faults
from wantrain.core.loop import CheckpointPolicy, LoopSettings, Trainer
from wantrain.core.settings import FaultsConfig
from wantrain.core.state import TrainState
from wantrain.observers.adaptive_lr import AdaptiveLR
from wantrain.optimizers import OptimizerConfig, build_optimizer
from wantrain.schedulers import SchedulerConfig, build_scheduler

CPU_TYPES = ["adamw", "adamw8bit", "prodigy", "adafactor", "adamw_schedulefree"]
# min_8bit_size = 1: the stand-in's tensors are tiny; without it bitsandbytes would keep 32-bit state for them
ARGUMENTS = {"adamw8bit": {"min_8bit_size": 1}, "adafactor": {"beta1": 0.9}}
GROUP_LRS = {"prodigy": (1.0, 0.5)}  # Prodigy's lr multiplies its own estimate d


class SetLR(Observer):
    """A one-step LR request, as an observer would make it."""

    @on(StepStarted)
    def request(self, event, ctx):
        if event.step == 5 and event.accumulation_index == 1:
            ctx.control.set_lr("high_noise", ctx.optimizer.param_groups[0]["lr"] * 0.5)


def optimizer_config(kind: str) -> OptimizerConfig:
    extra = dict(ARGUMENTS.get(kind, {}))
    beta1 = extra.pop("beta1", None)
    return OptimizerConfig(type=kind, beta1=beta1, arguments=extra)


def build(tmp_path, kind, *, observers=(), **settings):
    adapter = LinearAdapter(experts=("high_noise", "low_noise"), switch_every=3)
    groups = adapter.param_groups()
    for group, lr in zip(groups, GROUP_LRS.get(kind, (0.05, 0.02)), strict=True):
        group["lr"] = lr
    optimizer = build_optimizer(optimizer_config(kind), groups, torch.device("cpu"))
    state = TrainState()
    model = inject_faults(adapter, optimizer, FaultsConfig(nan_at_steps=[8]), state)
    bus = Bus()
    rec = bus.attach(Recorder())
    for o in (SetLR(), *observers):
        bus.attach(o)
    defaults = dict(max_steps=12, grad_accum=2, log_every=2, save_every=3, clip_grad_norm=0.5)
    defaults.update(settings)
    trainer = Trainer(adapter=model, batches=LinearBatches(), optimizer=optimizer, settings=LoopSettings(**defaults),
                      bus=bus, saver=ListSaver(), state=state, seed=3,
                      checkpoints=CheckpointPolicy(directory=tmp_path / "checkpoints", keep_last=None),
                      scheduler=build_scheduler(SchedulerConfig(type="linear", end_factor=0.5), optimizer,
                                                total_steps=defaults["max_steps"]))
    return trainer, adapter, rec


def params(adapter):
    return [p.detach().clone() for p in adapter.trainable_parameters()]


def flat(tree, prefix=""):
    """(path, value) leaves of a state dict, tensors as they are."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}/{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from flat(v, f"{prefix}/{i}")
    else:
        yield prefix, tree


def assert_same_state(a, b):
    left, right = dict(flat(a)), dict(flat(b))
    assert left.keys() == right.keys()
    for key, x in left.items():
        y = right[key]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        else:
            assert x == y or (x != x and y != y), key


@pytest.mark.parametrize("kind", CPU_TYPES)
def test_a_restored_run_continues_bitwise_with_every_optimizer_type(tmp_path, kind):
    full, full_adapter, full_rec = build(tmp_path / "full", kind)
    assert full.run().status == "completed"
    losses = [e.values["train/loss"] for e in full_rec.events if isinstance(e, MetricsLogged)]
    assert losses[-1] < losses[0]  # it learns

    first, _, _ = build(tmp_path / "part", kind, observers=[StopAt(7)])
    assert first.run().status == "stopped"
    checkpoint = read_checkpoint(tmp_path / "part" / "checkpoints" / "step_000006")

    resumed, resumed_adapter, resumed_rec = build(tmp_path / "resumed", kind)
    resumed.load_state_dict(checkpoint.tree, source="step_000006")
    assert resumed.run().status == "completed"
    for a, b in zip(params(full_adapter), params(resumed_adapter), strict=True):
        assert torch.equal(a, b)
    assert_same_state(full.optimizer.state_dict(), resumed.optimizer.state_dict())
    stepped = [(e.step, e.lrs) for e in full_rec.events if isinstance(e, OptimizerStepped) and e.step > 6]
    assert stepped == [(e.step, e.lrs) for e in resumed_rec.events if isinstance(e, OptimizerStepped)]


def test_per_expert_lrs_and_a_set_lr_request_reach_prodigy(tmp_path):
    trainer, _, rec = build(tmp_path, "prodigy", observers=[AdaptiveLR("d")], max_steps=6)
    assert trainer.run().status == "completed"
    lrs = {e.step: e.lrs for e in rec.events if isinstance(e, OptimizerStepped)}
    assert lrs[4][0] == pytest.approx(2 * lrs[4][1])  # each group keeps its own base LR (1.0 and 0.5)
    assert lrs[5][0] == pytest.approx(lrs[5][1])  # the set_lr request halved the high-noise LR of step 5 only
    assert lrs[6][0] == pytest.approx(2 * lrs[6][1])
    logged = [e.values for e in rec.events if isinstance(e, MetricsLogged)]
    d = logged[-1]["optimizer/d"]
    assert d > 1e-6  # grew from d0
    assert logged[-1]["optimizer/effective_lr/high_noise"] == pytest.approx(d * lrs[6][0])
    assert logged[-1]["optimizer/effective_lr/low_noise"] == pytest.approx(d * lrs[6][1])


def test_schedule_free_saves_its_averaged_weights_and_trains_on_the_iterate(tmp_path):
    trainer, adapter, rec = build(tmp_path, "adamw_schedulefree", save_every=None, max_steps=6)
    iterate = {}
    trainer.bus.subscribe(OptimizerStepped, lambda e, c: iterate.__setitem__(e.step, params(adapter)))
    assert trainer.run().status == "completed"
    saved = read_checkpoint(tmp_path / "checkpoints" / "step_000006").tree
    assert [g["train_mode"] for g in saved["optimizer"]["param_groups"]] == [False, False]
    weights = list(saved["model"].values())
    # the checkpoint (and the LoRA saver, called in the same mode) holds the averaged weights x, not the iterate y
    assert all(torch.equal(a, b) for a, b in zip(weights, params(adapter), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(iterate[6], params(adapter), strict=True))
