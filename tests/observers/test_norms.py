"""Norms: global L2 norms of LoRA gradients (before clipping) and parameters, equal to a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from wantrain.core.bus import Bus, Observer, on
from wantrain.core.context import Context, DeviceMetrics, Live, TrainState
from wantrain.core.control import Control
from wantrain.core.events import ExpertSwitched, GradsReady, OptimizerStepped
from wantrain.observers.norms import Norms, sum_of_squares

from .fakes import FakeLoop, LoraAdapter


class RecordingMetrics(DeviceMetrics):
    """DeviceMetrics that also remembers the type of every value put (to check nothing was converted)."""

    def __init__(self) -> None:
        super().__init__()
        self.put_types: dict[str, type] = {}

    def put(self, name, value) -> None:
        self.put_types[name] = type(value)
        super().put(name, value)


def make_bus(adapter: LoraAdapter) -> tuple[Bus, Context]:
    ctx = Context(control=Control(), state=TrainState(), metrics=RecordingMetrics(), live=Live(), adapter=adapter)
    bus = Bus(ctx)
    bus.attach(Norms())
    return bus, ctx


def global_norm(tensors) -> float:
    return torch.cat([t.detach().double().flatten() for t in tensors]).norm().item()


def stepped(step: int, expert: str | None, is_log_step: bool = True) -> OptimizerStepped:
    return OptimizerStepped(step=step, expert=expert, skipped=False, skip_reason=None, lrs=(0.1, 0.1),
                            group_names=("high_noise", "low_noise"), is_log_step=is_log_step)


def set_grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_grad_norm_equals_the_global_l2_norm_of_all_gradients():
    adapter = LoraAdapter()
    set_grads(adapter.trainable_parameters("high_noise"), seed=1)
    bus, ctx = make_bus(adapter)
    bus.emit(GradsReady(step=3, is_log_step=True, expert="high_noise"))
    values = ctx.metrics.gather()
    expected = global_norm(p.grad for p in adapter.trainable_parameters("high_noise"))
    assert values["train/grad_norm"] == pytest.approx(expected, rel=1e-6)
    assert values["train/grad_norm/high_noise"] == pytest.approx(expected, rel=1e-6)
    assert "train/grad_norm/low_noise" not in values  # the inactive expert has no gradients


def test_grad_norm_over_both_experts_combines_their_sums_of_squares():
    adapter = LoraAdapter()
    set_grads(adapter.trainable_parameters(None), seed=2)
    bus, ctx = make_bus(adapter)
    bus.emit(GradsReady(step=1, is_log_step=True, expert="high_noise"))
    values = ctx.metrics.gather()
    high = global_norm(p.grad for p in adapter.trainable_parameters("high_noise"))
    low = global_norm(p.grad for p in adapter.trainable_parameters("low_noise"))
    assert values["train/grad_norm/high_noise"] == pytest.approx(high, rel=1e-6)
    assert values["train/grad_norm/low_noise"] == pytest.approx(low, rel=1e-6)
    assert values["train/grad_norm"] == pytest.approx(math.hypot(high, low), rel=1e-6)


def test_grad_norm_is_read_before_clipping_in_a_run():
    seen: dict[int, float] = {}

    class GradsSpy(Observer):  # the direct norm of the gradients Norms sees, at the same moment
        @on(GradsReady)
        def record(self, event, ctx):
            if event.is_log_step:
                seen[event.step] = global_norm(p.grad for p in ctx.adapter.trainable_parameters()
                                               if p.grad is not None)

    loop = FakeLoop([Norms(), GradsSpy()], total_steps=4, log_every=2, clip_grad_norm=0.01)
    logged = loop.run()
    assert {e.step: pytest.approx(e.values["train/grad_norm"], rel=1e-5) for e in logged} == seen
    assert all(e.values["train/grad_norm"] > 0.1 for e in logged)  # far above the clipped norm (0.01)


def test_total_param_norm_is_the_root_of_summed_squares_not_a_sum_of_norms():
    adapter = LoraAdapter()
    bus, ctx = make_bus(adapter)
    bus.emit(stepped(2, "high_noise"))
    values = ctx.metrics.gather()
    params = adapter.trainable_parameters()
    assert values["train/total_param_norm"] == pytest.approx(global_norm(params), rel=1e-6)
    assert values["train/total_param_norm"] < sum(p.norm().item() for p in params) * 0.9
    for expert in ("high_noise", "low_noise"):
        assert values[f"train/param_norm/{expert}"] == pytest.approx(
            global_norm(adapter.trainable_parameters(expert)), rel=1e-6)


def test_param_norm_of_an_expert_is_recomputed_once_it_is_trained_again():
    adapter = LoraAdapter()
    bus, ctx = make_bus(adapter)
    bus.emit(stepped(1, "high_noise"))  # low_noise is inactive: its norm is cached
    ctx.metrics.gather()
    with torch.no_grad():
        for p in adapter.trainable_parameters("low_noise"):
            p.mul_(3.0)  # what training low_noise does to it
    bus.emit(ExpertSwitched(step=2, previous="high_noise", expert="low_noise"))
    bus.emit(stepped(2, "low_noise"))
    values = ctx.metrics.gather()
    assert values["train/param_norm/low_noise"] == pytest.approx(
        global_norm(adapter.trainable_parameters("low_noise")), rel=1e-6)
    assert values["train/total_param_norm"] == pytest.approx(global_norm(adapter.trainable_parameters()), rel=1e-6)


def test_norms_of_a_single_transformer_model_have_no_expert_series():
    adapter = LoraAdapter(experts=(None,))
    set_grads(adapter.trainable_parameters(), seed=3)
    bus, ctx = make_bus(adapter)
    bus.emit(GradsReady(step=1, is_log_step=True, expert=None))
    bus.emit(stepped(1, None))
    values = ctx.metrics.gather()
    assert set(values) == {"train/grad_norm", "train/total_param_norm"}
    assert values["train/grad_norm"] == pytest.approx(global_norm(p.grad for p in adapter.trainable_parameters()))


def test_norms_put_nothing_on_steps_that_do_not_log():
    adapter = LoraAdapter()
    set_grads(adapter.trainable_parameters(), seed=4)
    bus, ctx = make_bus(adapter)
    bus.emit(GradsReady(step=1, is_log_step=False, expert="high_noise"))
    bus.emit(stepped(1, "high_noise", is_log_step=False))
    assert ctx.metrics.pending() == ()


def test_norms_are_put_as_device_tensors_for_the_core_to_gather():
    adapter = LoraAdapter()
    set_grads(adapter.trainable_parameters("high_noise"), seed=5)
    bus, ctx = make_bus(adapter)
    bus.emit(GradsReady(step=1, is_log_step=True, expert="high_noise"))
    bus.emit(stepped(1, "high_noise"))
    assert ctx.metrics.put_types and all(t is torch.Tensor for t in ctx.metrics.put_types.values())


def test_sum_of_squares_adds_partials_from_several_devices_without_a_transfer():
    cpu = [torch.full((3,), 2.0), torch.full((2, 2), 1.0, dtype=torch.bfloat16)]
    assert sum_of_squares(cpu).item() == pytest.approx(12 + 4)
    assert sum_of_squares([]) is None
    if torch.cuda.is_available():
        mixed = [*cpu, torch.full((4,), 3.0, device="cuda")]
        result = sum_of_squares(mixed)
        assert result.device.type == "cuda" and result.item() == pytest.approx(16 + 36)


def test_parameter_lists_are_built_once_per_run_not_on_every_log_step():
    adapter = LoraAdapter()
    calls = []
    listing = adapter.trainable_parameters
    adapter.trainable_parameters = lambda expert=None: calls.append(expert) or listing(expert)
    bus, ctx = make_bus(adapter)
    for step, expert in ((1, "high_noise"), (2, "high_noise"), (3, "low_noise"), (4, "low_noise")):
        if step == 3:
            bus.emit(ExpertSwitched(step=3, previous="high_noise", expert="low_noise"))
        set_grads(listing(expert), seed=step)
        bus.emit(GradsReady(step=step, is_log_step=True, expert=expert))
        bus.emit(stepped(step, expert))
        values = ctx.metrics.gather()
        assert values[f"train/grad_norm/{expert}"] == pytest.approx(global_norm([p.grad for p in listing(expert)]),
                                                                     rel=1e-6)
        assert values["train/total_param_norm"] == pytest.approx(global_norm(listing()), rel=1e-6)
    assert sorted(calls) == ["high_noise", "low_noise"]  # once per expert for the whole run


def test_grad_norm_is_the_cores_own_norm_unless_an_inactive_expert_has_gradients():
    adapter = LoraAdapter()
    set_grads(adapter.trainable_parameters("high_noise"), seed=6)
    bus, ctx = make_bus(adapter)
    ctx.live.grad_norm = torch.tensor(7.0)  # what the core computed for clipping: put as it is, nothing recomputed
    bus.emit(GradsReady(step=1, is_log_step=True, expert="high_noise"))
    values = ctx.metrics.gather()
    assert values["train/grad_norm"] == values["train/grad_norm/high_noise"] == 7.0
    set_grads(adapter.trainable_parameters("low_noise"), seed=7)  # a custom loop: both experts have gradients
    bus.emit(GradsReady(step=2, is_log_step=True, expert="high_noise"))
    values = ctx.metrics.gather()
    assert values["train/grad_norm"] == pytest.approx(global_norm(p.grad for p in adapter.trainable_parameters()),
                                                      rel=1e-6)
    assert values["train/grad_norm/low_noise"] == pytest.approx(
        global_norm(p.grad for p in adapter.trainable_parameters("low_noise")), rel=1e-6)


def test_the_trainer_logs_the_pre_clip_norm_of_the_gradients_it_stepped_with():
    from tests.core.fakes import LinearAdapter, LinearBatches
    from wantrain.core.events import MetricsLogged
    from wantrain.core.loop import LoopSettings, Trainer

    adapter = LinearAdapter(experts=("high_noise", "low_noise"), switch_every=2)
    seen, logged = {}, {}
    bus = Bus()
    bus.attach(Norms())
    bus.subscribe(GradsReady, lambda e, ctx: seen.setdefault(e.step, global_norm(
        p.grad for p in adapter.trainable_parameters() if p.grad is not None)))
    bus.subscribe(MetricsLogged, lambda e, ctx: logged.setdefault(e.step, e.values))
    optimizer = torch.optim.AdamW(adapter.param_groups(), lr=0.05)
    Trainer(adapter=adapter, batches=LinearBatches(), optimizer=optimizer, bus=bus,
            settings=LoopSettings(max_steps=4, log_every=1, clip_grad_norm=0.01)).run()
    for step, values in logged.items():
        expert = adapter.expert_for_step(step)
        assert values["train/grad_norm"] == values[f"train/grad_norm/{expert}"] == pytest.approx(seen[step], rel=1e-5)
        assert values["train/grad_norm"] > 0.1  # before clipping (at 0.01)


def test_an_expert_whose_block_ended_at_a_log_step_is_not_summed_again():
    adapter = LoraAdapter()
    calls = []
    bus, ctx = make_bus(adapter)
    import wantrain.observers.norms as norms

    real = norms.sum_of_squares_grouped
    norms.sum_of_squares_grouped = lambda grouped: calls.append(1) or real(grouped)
    previous = None
    try:
        for step, expert in ((1, "high_noise"), (2, "high_noise"), (3, "low_noise"), (4, "low_noise"),
                             (5, "high_noise")):
            if step in (3, 5):
                bus.emit(ExpertSwitched(step=step, previous=previous, expert=expert))
                with torch.no_grad():
                    for p in adapter.trainable_parameters(expert):
                        p.add_(0.5)  # the new expert changes from its first step on
            previous = expert
            if step % 2 == 0 or step == 5:  # log steps 2 and 4 end a block; 5 is the first of a new block
                calls.clear()
                bus.emit(stepped(step, expert))
                values = ctx.metrics.gather()
                assert values["train/total_param_norm"] == pytest.approx(global_norm(adapter.trainable_parameters()),
                                                                          rel=1e-6)
                # step 2: both experts (nothing cached yet); 4 and 5: only the active one
                assert len(calls) == (2 if step == 2 else 1), step
    finally:
        norms.sum_of_squares_grouped = real
