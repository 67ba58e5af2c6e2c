"""TensorBoardWriter: every logged metric at its step, flattened hparams, and purge on resume."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from wantrain.core.bus import Bus
from wantrain.core.context import Context, DeviceMetrics, Live, TrainState
from wantrain.core.control import Control
from wantrain.core.events import MetricsLogged, RunEnded, RunStarted
from wantrain.observers.memory_probe import MemoryProbe
from wantrain.observers.norms import Norms
from wantrain.observers.tensorboard import TensorBoardWriter, flatten_hparams

from .fakes import FakeLoop


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_has_every_logged_metric_at_the_logged_steps(tmp_path):
    loop = FakeLoop([Norms(), MemoryProbe(), TensorBoardWriter(tmp_path / "tb")], total_steps=7, log_every=3)
    logged = loop.run()
    scalars = read_scalars(tmp_path / "tb")
    expected_tags = set().union(*(e.values for e in logged))
    assert {"train/loss", "train/lr", "train/lr/high_noise", "train/loss/low_noise", "train/grad_norm",
            "train/grad_norm/high_noise", "train/total_param_norm", "memory/ram_main_process_gb"} <= expected_tags
    assert set(scalars) == expected_tags
    assert [s for s, _ in scalars["train/loss"]] == [3, 6, 7]
    assert [s for s, _ in scalars["train/lr"]] == [3, 6, 7]
    for event in logged:
        for tag, value in event.values.items():
            assert dict(scalars[tag])[event.step] == pytest.approx(value, rel=1e-6)


def test_tensorboard_records_the_flattened_run_config_as_hparams(tmp_path):
    hparams = {"train": {"lr": 1e-4, "max_steps": 100, "clip_grad_norm": None}, "model": {"variant": "t2v-a14b"},
               "data": {"buckets": [480, 832]}, "seed": 7, "lora": {"use_dora": False}}
    loop = FakeLoop([TensorBoardWriter(tmp_path / "tb", hparams=hparams)], total_steps=2, log_every=1)
    loop.run(status="failed")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    values = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
              for k, v in start.session_start_info.hparams.items()}
    assert values == {"train.lr": 1e-4, "train.max_steps": 100.0, "train.clip_grad_norm": "none",
                      "model.variant": "t2v-a14b", "data.buckets": "[480, 832]", "seed": 7.0,
                      "lora.use_dora": False}
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["train/loss"]
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
    assert end.status == 2  # STATUS_FAILURE: the run's own status, not tensorboardX's fixed success


def test_flatten_hparams_joins_nested_keys_with_dots():
    assert flatten_hparams({"a": {"b": {"c": 1}, "d": "x"}, "e": (1, 2)}) == {"a.b.c": 1, "a.d": "x", "e": "(1, 2)"}


def test_resumed_run_purges_the_steps_after_the_resumed_step(tmp_path):
    def run(start_step: int, steps: range) -> None:
        ctx = Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live())
        bus = Bus(ctx)
        bus.attach(TensorBoardWriter(tmp_path / "tb"))
        bus.emit(RunStarted(step=start_step, run_dir="", total_steps=10, grad_accum=1, experts=(None,),
                            log_every=1))
        for step in steps:
            bus.emit(MetricsLogged(step=step, expert=None, values={"train/loss": float(start_step)},
                                   elapsed_s=0.0, total_steps=10))
        bus.emit(RunEnded(step=steps[-1], status="completed", reason=None))
        bus.close()

    run(0, range(1, 9))  # crashed after step 8, last checkpoint at step 5
    run(5, range(6, 11))
    loss = read_scalars(tmp_path / "tb")["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 11))
    assert [v for _, v in loss] == [0.0] * 5 + [5.0] * 5


def test_each_log_step_is_one_event_record_holding_all_its_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    loop = FakeLoop([Norms(), MemoryProbe(), TensorBoardWriter(tmp_path / "tb")], total_steps=7, log_every=3)
    logged = loop.run()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    records = [e for e in LegacyEventFileLoader(str(path)).Load() if e.HasField("summary")]
    assert [r.step for r in records] == [3, 6, 7]
    for record, event in zip(records, logged, strict=True):
        assert {v.tag: v.simple_value for v in record.summary.value} == pytest.approx(event.values, rel=1e-6)
