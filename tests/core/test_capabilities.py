"""Observers reach the model through what it declares: capabilities checked when an observer is attached, and the
model changes they decide (an alpha transition, experts brought in for an evaluation) carried out by the core."""

from __future__ import annotations

import contextlib

import pytest
import torch

from wantrain.core.adapter import AlphaChangeable, Evaluating, MissingCapability, ValidationCapable
from wantrain.core.bus import Bus, Observer, on
from wantrain.core.context import Context, DeviceMetrics, Live
from wantrain.core.control import Control
from wantrain.core.errors import UserError
from wantrain.core.events import CheckpointSaved, MetricsLogged, OptimizerStepped
from wantrain.core.loop import CheckpointPolicy, LoopSettings, Trainer
from wantrain.core.state import TrainState

from .fakes import LinearAdapter, linear_batches


class NeedsValidation(Observer):
    needs = (ValidationCapable,)

    @on(MetricsLogged)
    def handle(self, event, ctx) -> None:
        pass


class ModelWithAlpha(LinearAdapter):
    """Records each alpha change with the step it happened at and the optimizer it was handed."""

    def __init__(self, log: list, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log, self.state = log, None

    def change_lora_alpha(self, alpha, expert, optimizer=None, *, preserve_output=True) -> None:
        self.log.append(("alpha", self.state.step, expert, alpha, preserve_output, optimizer))


class ModelWithEvaluation(LinearAdapter):
    """Two experts; records activations (expert, optimizer) and eval-mode entries/exits."""

    def __init__(self, log: list) -> None:
        super().__init__(experts=("high_noise", "low_noise"), switch_every=100)
        self.log, self.active = log, "high_noise"

    def activate(self, expert, optimizer) -> None:
        self.log.append(("activate", expert, optimizer))
        self.active = expert

    @contextlib.contextmanager
    def evaluating(self):
        self.log.append(("eval",))
        try:
            yield
        finally:
            self.log.append(("train",))


def trainer_for(adapter, bus, tmp_path=None, steps=3, **settings) -> Trainer:
    model = torch.nn.ModuleList(adapter.models.values())
    optimizer = torch.optim.SGD([{"params": list(model.parameters()), "lr": 0.01, "name": "lora"}])
    checkpoints = CheckpointPolicy(directory=tmp_path / "checkpoints") if tmp_path is not None else None
    return Trainer(adapter=adapter, batches=linear_batches(), optimizer=optimizer, bus=bus,
                   settings=LoopSettings(max_steps=steps, log_every=1, **settings), checkpoints=checkpoints)


def test_an_observer_needing_a_capability_the_adapter_lacks_fails_at_attach_in_one_line():
    ctx = Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live(), adapter=LinearAdapter())
    bus = Bus(ctx)
    with pytest.raises(MissingCapability) as caught:
        bus.attach(NeedsValidation())
    message = str(caught.value)
    assert message.startswith("observer NeedsValidation needs ValidationCapable (active, evaluating, ")
    assert "validation_loss" in message and "LinearAdapter" in message and "\n" not in message
    assert isinstance(caught.value, UserError)  # the CLI prints it as one line, exit code 2
    assert bus.observers == ()  # nothing of it was subscribed


def test_the_trainer_checks_observers_attached_before_it_was_built():
    bus = Bus()
    bus.attach(NeedsValidation())  # no adapter yet: nothing to check against
    with pytest.raises(MissingCapability, match="^observer NeedsValidation needs ValidationCapable"):
        trainer_for(LinearAdapter(), bus)


def test_an_adapter_with_the_capability_is_accepted():
    class NeedsEvaluation(NeedsValidation):
        needs = (Evaluating,)

    bus = Bus()
    bus.attach(NeedsEvaluation())
    trainer_for(ModelWithEvaluation([]), bus)  # no error: the adapter has active, evaluating() and activate()
    assert isinstance(ModelWithAlpha([]), AlphaChangeable) and not isinstance(LinearAdapter(), AlphaChangeable)


def test_an_alpha_request_is_applied_by_the_core_after_the_log_step_and_before_its_checkpoint(tmp_path):
    log: list = []
    adapter = ModelWithAlpha(log)

    class Controller(Observer):
        needs = (AlphaChangeable,)

        @on(MetricsLogged)
        def decide(self, event, ctx) -> None:
            if event.step == 2:
                ctx.control.set_lora_alpha("lora", 8.0, preserve_output=True)
                log.append(("requested", event.step))

        @on(CheckpointSaved)
        def saved(self, event, ctx) -> None:
            log.append(("saved", event.step))

    bus = Bus()
    bus.attach(Controller())
    trainer = trainer_for(adapter, bus, tmp_path, steps=3, save_every=2)
    adapter.state = trainer.state
    assert trainer.run().status == "completed"
    assert log == [("requested", 2), ("alpha", 2, "lora", 8.0, True, trainer.optimizer), ("saved", 2),
                   ("saved", 3)]


def test_alpha_requests_are_checked_when_asked():
    control = Control()
    for bad in (0.0, -1.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
            control.set_lora_alpha("high_noise", bad, preserve_output=True)
    assert not control.has_model_requests


def test_an_evaluation_brings_experts_in_with_the_optimizer_and_puts_the_training_expert_back():
    log: list = []
    adapter = ModelWithEvaluation(log)

    class Evaluator(Observer):
        needs = (Evaluating,)

        @on(OptimizerStepped)
        def evaluate(self, event, ctx) -> None:
            if event.step == 1:
                with ctx.control.evaluation() as bring_in:
                    bring_in("low_noise")
                    log.append(("evaluated", adapter.active))

    bus = Bus()
    bus.attach(Evaluator())
    trainer = trainer_for(adapter, bus, steps=2)
    trainer.run()
    opt = trainer.optimizer
    assert log == [("activate", "high_noise", opt),  # the loop's, before step 1
                   ("eval",), ("activate", "low_noise", opt), ("evaluated", "low_noise"), ("train",),
                   ("activate", "high_noise", opt)]


def test_outside_a_run_control_evaluation_says_what_to_use():
    with pytest.raises(RuntimeError, match="evaluation_session"):
        Control().evaluation()
