"""The core's guards (out of memory, non-finite steps), stops, and its state: checkpoints written at saves and
restored into a fresh trainer that then continues bitwise. Tiny linear stand-in model."""

from __future__ import annotations

import pytest
import torch

from wantrain.core.bus import Bus, Observer, on
from wantrain.core.checkpoint import latest_complete, read_checkpoint
from wantrain.core.events import MetricsLogged, OptimizerStepped, OutOfMemory, StepStarted
from wantrain.core.faults import inject_faults
from wantrain.core.loop import CheckpointPolicy, LoopSettings, Trainer, is_out_of_memory
from wantrain.core.settings import FaultsConfig
from wantrain.core.state import TrainState

from .fakes import LinearAdapter, LinearBatches
from .test_loop import ListSaver, Recorder


class Counter(Observer):
    """A stateful observer: counts optimizer steps; its state travels in checkpoints, with a sidecar file."""

    def __init__(self):
        self.steps = 0

    @on(OptimizerStepped)
    def count(self, event, ctx):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]

    def write_sidecars(self, directory, stem):
        (directory / f"{stem}_counter.json").write_text(str(self.steps))


class StopAt(Observer):
    def __init__(self, step):
        self.step = step

    @on(OptimizerStepped)
    def stop(self, event, ctx):
        if event.step == self.step:
            ctx.control.request_stop("test stop")


def build(tmp_path=None, *, faults=None, optimizer="adamw", observers=(), experts=("high_noise", "low_noise"),
          **settings):
    adapter = LinearAdapter(experts=experts, switch_every=3)
    groups = adapter.param_groups()
    opt = (torch.optim.AdamW(groups, lr=0.05, fused=True) if optimizer == "adamw"
           else torch.optim.SGD(groups, lr=0.05))
    state = TrainState()
    model = inject_faults(adapter, opt, faults or FaultsConfig(), state)
    bus = Bus()
    rec = bus.attach(Recorder())
    for o in observers:
        bus.attach(o)
    defaults = dict(max_steps=12, grad_accum=2, log_every=4, save_every=4)
    defaults.update(settings)
    policy = CheckpointPolicy(directory=tmp_path / "checkpoints", keep_last=None) if tmp_path else None
    trainer = Trainer(adapter=model, batches=LinearBatches(), optimizer=opt, settings=LoopSettings(**defaults),
                      bus=bus, saver=ListSaver(), state=state, checkpoints=policy, seed=3,
                      scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    return trainer, adapter, rec


def params(adapter):
    return [p.detach().clone() for p in adapter.trainable_parameters()]


def losses(rec):
    return [(e.step, e.values.get("train/loss")) for e in rec.events if isinstance(e, MetricsLogged)]


def test_out_of_memory_is_counted_per_optimizer_step_and_stops_with_an_emergency_checkpoint(tmp_path):
    # grad_accum 2 and an OOM on every second micro-step: each optimizer step loses its second micro-step
    faults = FaultsConfig(oom_probability=0.0, oom_at_steps=[], nan_at_steps=[])
    trainer, adapter, rec = build(tmp_path, faults=faults, max_consecutive_oom=3)
    trainer.adapter.loss = _oom_on_even_micro_steps(trainer.adapter.loss, trainer.state)
    before = params(adapter)
    result = trainer.run()
    assert result.status == "failed" and "out of memory on 3 optimizer steps in a row" in result.reason
    stepped = [e for e in rec.events if isinstance(e, OptimizerStepped)]
    assert [(e.step, e.skipped, e.skip_reason) for e in stepped] == [(i, True, "out of memory") for i in (1, 2, 3)]
    assert [e.consecutive for e in rec.events if isinstance(e, OutOfMemory)] == [1, 2, 3]
    assert all(torch.equal(a, b) for a, b in zip(before, params(adapter), strict=True))  # no update was applied
    best, _ = latest_complete(tmp_path / "checkpoints")
    assert best.step == 3 and read_checkpoint(best.path).meta["reason"] == "emergency: out of memory"
    assert trainer.saver.saves == []  # no LoRA file for a failed run


def _oom_on_even_micro_steps(loss, state):
    def wrapped(batch, expert, generator):
        if state.micro_step % 2 == 0:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return loss(batch, expert, generator)

    return wrapped


def test_an_out_of_memory_error_inside_the_optimizer_step_skips_that_step():
    trainer, adapter, rec = build(faults=FaultsConfig(oom_at_steps=[2], oom_phase="optimizer"), max_steps=4)
    result = trainer.run()
    assert result.status == "completed"
    stepped = {e.step: e for e in rec.events if isinstance(e, OptimizerStepped)}
    assert stepped[2].skipped and stepped[2].skip_reason == "out of memory" and not stepped[3].skipped
    assert [e.phase for e in rec.events if isinstance(e, OutOfMemory)] == ["optimizer"]
    assert trainer.state.skipped_steps == 1 and trainer.state.consecutive_oom == 0


def test_the_cpu_allocator_message_counts_as_out_of_memory():
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't "
                                         "allocate memory: you tried to allocate 1099511627776 bytes."))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_backward_phase_injection_is_caught_like_a_real_one():
    trainer, _, rec = build(faults=FaultsConfig(oom_at_steps=[1], oom_phase="backward"), max_steps=2)
    assert trainer.run().status == "completed"
    assert [(e.step, e.phase) for e in rec.events if isinstance(e, OutOfMemory)] == [(1, "backward")]


def _nan_run(optimizer, *, device_skip: bool = False):
    trainer, adapter, rec = build(faults=FaultsConfig(nan_at_steps=[3]), optimizer=optimizer, max_steps=4,
                                  log_every=4, save_every=None)
    # the found_inf path is what a GPU takes; on the CPU the core reads the flag instead (free there)
    assert trainer._device_skip is False
    trainer._device_skip = device_skip
    snapshots = {}
    trainer.bus.subscribe(StepStarted, lambda e, c: snapshots.setdefault(e.step, params(adapter)))
    result = trainer.run()
    return trainer, adapter, rec, result, snapshots


@pytest.mark.parametrize("device_skip", [True, False], ids=["found_inf", "flag_read"])
def test_a_nan_loss_skips_the_step_with_fused_adamw(device_skip):
    trainer, adapter, rec, result, snapshots = _nan_run("adamw", device_skip=device_skip)
    assert result.status == "completed"
    # step 3 changed nothing: the parameters before step 4 equal those before step 3
    assert all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3], strict=True))
    steps = {int(s["step"].item()) for s in trainer.optimizer.state.values()}
    # Adam's own counters did not count the skipped step: high_noise stepped at 1 and 2, low_noise at 4
    assert steps == {2, 1}
    (logged,) = [e for e in rec.events if isinstance(e, MetricsLogged)]
    assert logged.values["train/nan_skipped_steps"] == 1 and logged.values["train/skipped_steps"] == 1
    assert torch.isfinite(torch.tensor(logged.values["train/loss"]))  # the NaN loss is left out of the mean
    assert all(torch.isfinite(p).all() for p in params(adapter))


def test_a_nan_loss_skips_the_step_with_an_optimizer_without_found_inf():
    trainer, adapter, rec, result, snapshots = _nan_run("sgd")
    assert result.status == "completed"
    assert all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4], strict=True))
    assert all(torch.isfinite(p).all() for p in params(adapter))


def test_non_finite_steps_in_a_row_stop_the_run_failed_without_saving(tmp_path):
    trainer, _, rec = build(tmp_path, faults=FaultsConfig(nan_at_steps=[5, 6, 7, 8]), max_consecutive_nan=3,
                            log_every=4, save_every=4)
    result = trainer.run()
    assert result.status == "failed" and "non-finite loss or gradients on 4 optimizer steps" in result.reason
    assert result.steps == 8
    assert [c.step for c in latest_complete(tmp_path / "checkpoints")[:1]] == [4]  # the last good one
    assert trainer.saver.saves == [(4, False)]


def test_a_stop_between_log_steps_logs_the_partial_interval_and_checkpoints(tmp_path):
    trainer, _, rec = build(tmp_path, observers=[StopAt(6)], log_every=4, save_every=None)
    result = trainer.run()
    assert result.status == "stopped" and result.steps == 6
    assert [s for s, _ in losses(rec)] == [4, 6]
    assert latest_complete(tmp_path / "checkpoints")[0].step == 6


def test_a_restored_trainer_continues_bitwise_like_the_uninterrupted_run(tmp_path):
    faults = FaultsConfig(oom_at_steps=[3, 9], nan_at_steps=[5, 10])  # step 7, the first resumed one, is normal
    full, full_adapter, full_rec = build(tmp_path / "full", faults=faults, observers=[Counter()], log_every=2,
                                         save_every=3)
    assert full.run().status == "completed"

    first, _, _ = build(tmp_path / "part", faults=faults, observers=[Counter(), StopAt(7)], log_every=2,
                        save_every=3)
    assert first.run().status == "stopped"
    checkpoint = read_checkpoint(tmp_path / "part" / "checkpoints" / "step_000006")
    assert (tmp_path / "part" / "checkpoints" / "step_000006" / "step_000006_counter.json").read_text() == "6"

    counter = Counter()
    resumed, resumed_adapter, resumed_rec = build(tmp_path / "resumed", faults=faults, observers=[counter],
                                                  log_every=2, save_every=3)
    notes = resumed.load_state_dict(checkpoint.tree, source="step_000006")
    assert notes == [] and counter.steps == 6 and resumed.state.step == 6
    assert resumed.run().status == "completed"
    for a, b in zip(params(full_adapter), params(resumed_adapter), strict=True):
        assert torch.equal(a, b)
    assert losses(resumed_rec) == [x for x in losses(full_rec) if x[0] > 6]
    assert counter.steps == 12
    a, b = full.state_dict(), resumed.state_dict()
    for key in ("train_state", "scheduler", "data"):
        assert a[key] == b[key], key


def _signatures(rec, after_step=0):
    out = []
    for e in rec.events:
        if e.step > after_step and type(e).__name__ in ("ExpertSwitched", "CheckpointSaved", "OptimizerStepped"):
            out.append((type(e).__name__, e.step, getattr(e, "expert", None), getattr(e, "checkpoint", None)))
    return out


def test_a_run_resumed_at_an_expert_boundary_emits_the_expert_switch_the_uninterrupted_run_emitted(tmp_path):
    full, _, full_rec = build(tmp_path / "full", save_every=3, log_every=3)  # switch_every 3: boundaries 4, 7, 10
    assert full.run().status == "completed"
    checkpoint = read_checkpoint(tmp_path / "full" / "checkpoints" / "step_000006")
    resumed, _, rec = build(tmp_path / "resumed", save_every=3, log_every=3)
    resumed.load_state_dict(checkpoint.tree, source=str(checkpoint.path), meta=checkpoint.meta)
    assert resumed.run().status == "completed"
    switches = [(e.step, e.previous, e.expert) for e in rec.events if type(e).__name__ == "ExpertSwitched"]
    assert switches == [(7, "low_noise", "high_noise"), (10, "high_noise", "low_noise")]


def test_a_checkpoint_whose_event_was_cut_off_has_it_delivered_by_the_resumed_run(tmp_path):
    from wantrain.core.checkpoint import ANNOUNCED

    first, _, _ = build(tmp_path / "part", save_every=3, log_every=3, max_steps=6)
    assert first.run().status == "completed"
    path = tmp_path / "part" / "checkpoints" / "step_000003"
    assert (path / ANNOUNCED).exists()  # delivered in the run that wrote it
    (path / ANNOUNCED).unlink()  # as a kill right after the rename leaves it
    checkpoint = read_checkpoint(path)
    resumed, _, rec = build(tmp_path / "resumed", save_every=3, log_every=3, max_steps=6)
    resumed.load_state_dict(checkpoint.tree, source=str(path), meta=checkpoint.meta)
    assert resumed.run().status == "completed"
    saved = [e for e in rec.events if type(e).__name__ == "CheckpointSaved"]
    assert (saved[0].step, saved[0].checkpoint, saved[0].reason) == (3, str(path), "every 3 steps")
    assert saved[0].paths == tuple(checkpoint.meta["lora_paths"]) and saved[0].final is False
    assert [type(e).__name__ for e in rec.events[:2]] == ["RunStarted", "CheckpointSaved"]
    assert (path / ANNOUNCED).exists()
    # an announced checkpoint is not delivered again
    again, _, rec2 = build(tmp_path / "again", save_every=3, log_every=3, max_steps=6)
    again.load_state_dict(checkpoint.tree, source=str(path), meta=checkpoint.meta)
    again.run()
    assert [e.step for e in rec2.events if type(e).__name__ == "CheckpointSaved"] == [6]


def test_kill_faults_kill_at_the_step_or_right_after_the_checkpoint_rename(tmp_path, monkeypatch):
    import signal as signals

    import wantrain.core.faults as faults_module

    kills = []
    monkeypatch.setattr(faults_module.os, "kill", lambda pid, sig: kills.append((sig, state.step + 1)))
    state = TrainState()
    adapter = LinearAdapter()
    model = inject_faults(adapter, torch.optim.SGD(adapter.param_groups()), FaultsConfig(kill_at_steps=[2]), state)
    for step in (1, 2):
        state.step, state.micro_step = step - 1, step
        model.loss(next(iter(LinearBatches())), None, torch.Generator())
    assert kills == [(signals.SIGKILL, 2)]  # at step 2's first micro-step, nowhere else

    kills.clear()
    policy = CheckpointPolicy(directory=tmp_path, keep_last=None)
    faults = FaultsConfig(kill_at_steps=[3], kill_phase="after_checkpoint")
    inject_faults(adapter, torch.optim.SGD(adapter.param_groups()), faults, TrainState(), checkpoints=policy)
    policy.write(tmp_path, 2, {"x": torch.zeros(1)})
    assert kills == []
    policy.write(tmp_path, 3, {"x": torch.zeros(1)})
    assert [k for k, _ in kills] == [signals.SIGKILL]
    assert (tmp_path / "step_000003" / "complete.json").exists()  # renamed into place before the kill


def test_a_cublas_allocation_failure_counts_as_out_of_memory():
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))


def test_the_oom_guard_empties_the_cache_after_the_failed_graph_is_released(monkeypatch):
    """``empty_cache()`` can only return blocks nothing references: it must run after the failed micro-step's loss
    (and with it the graph) is gone, not inside the ``except`` block whose locals and traceback still hold it."""
    import weakref

    trainer, _, rec = build(faults=FaultsConfig(oom_at_steps=[1], oom_phase="backward"), max_steps=1, grad_accum=1)
    forward = trainer.adapter.loss
    graphs = []

    def loss(*args, **kwargs):
        out = forward(*args, **kwargs)
        graphs.append(weakref.ref(out))
        return out

    trainer.adapter.loss = loss
    alive_when_emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_when_emptied.append(graphs[-1]() is not None))
    assert trainer.run().status == "completed"
    assert [e.phase for e in rec.events if isinstance(e, OutOfMemory)] == ["backward"]
    assert alive_when_emptied == [False]


def test_a_cuda_generator_state_resumes_in_a_cpu_trainer_reseeded_with_a_note():
    """``train.device`` may change on resume: a CUDA generator's 16-byte state cannot go into a CPU generator, so the
    trainer's stream is reseeded from it (deterministically) and the resume says so."""
    trainer, _, _ = build(max_steps=2)
    assert trainer.run().status == "completed"
    tree = trainer.state_dict()
    tree["generator"] = torch.arange(16, dtype=torch.uint8)  # what a CUDA (Philox) generator saves
    notes = []
    for _ in range(2):
        again, _, _ = build(max_steps=4)
        notes.append(again.load_state_dict(tree))
        assert again.run().status == "completed"
    assert "the trainer's random stream was saved on another device type (16 bytes of state" in notes[0][0]
    assert notes[0] == notes[1]


def test_the_cuda_stream_is_restored_to_the_training_device_only(monkeypatch):
    """A checkpoint written on an 8-GPU machine resumes on one GPU: only the training device's CUDA state is
    restored (old checkpoints hold one per visible GPU; restoring all of them was an IndexError)."""
    from wantrain.core.state import capture_rng, restore_rng

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]), device)))

    def one_gpu(states):
        if len(states) > 1:
            raise IndexError("list index out of range")

    monkeypatch.setattr(torch.cuda, "set_rng_state_all", one_gpu)
    rng = capture_rng()
    eight = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    restore_rng({**rng, "cuda": eight}, torch.device("cuda", 0))  # written before: one state per GPU
    restore_rng({**rng, "cuda": eight[5]}, torch.device("cuda", 0))  # written now: the training device's
    restore_rng({**rng, "cuda": eight}, torch.device("cpu"))  # a CPU run has no CUDA stream to restore
    assert restored == [(0, torch.device("cuda", 0)), (5, torch.device("cuda", 0))]
