"""One expert per group of GPUs (``model.expert_groups = 2``) with the alpha schedule and with the LR finder
(docs/distributed.md, "One expert per GPU"), on two gloo ranks forked from the test process, one per expert.

Each group trains its expert as a one-process run of that expert alone does, bit for bit (docs/distributed.md), so
the reference of each expert is such a run with the same settings: its decisions (``AlphaChanged``, the finder's
rungs and result) and its LoRA file must be the groups' run's. The groups' event log is rank 0's: it must hold the
low-noise group's decisions too, and ``replay`` must reproduce them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_end_to_end import copy_examples
from test_expert_groups_run import RUN_SETTINGS, _launch, launch_ranks

from wantrain.app.replay import replay
from wantrain.cli.main import main

pytestmark = pytest.mark.slow

EXPERTS = ("high_noise", "low_noise")
SCHEDULE = ('lora.alpha_schedule={enabled=true, window=4, min_samples=3, phases=[{name="a", alpha=4, min_steps=3, '
            'loss_improvement_rate_below=1000.0, max_loss_cv=10.0, min_gradient_stability=0.0}, {name="b", alpha=8}]}')
ALPHA = ["train.max_steps=6", "train.log_every=1", 'lr_scheduler.type="constant"', "lr_scheduler.warmup_steps=0",
         SCHEDULE]
"""A first phase that ends at the first look (step 4) on each expert's own statistics (a constant LR: a run of 3
steps resumed to 6 trains what 6 steps train)."""


def doc_example() -> list[str]:
    """docs/distributed.md's config example of the LR finder across the groups, as ``--set`` items."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text(encoding="utf-8")
    block = page.split("**The LR finder across the groups**", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    return [f"{section}.{key}={json.dumps(value)}" for section, table in tomllib.loads(block).items()
            for key, value in table.items()]


FINDER = ["lr_finder.steps=6", "lr_finder.burn_in=2", "lr_finder.probe_clips=1",
          "lr_finder.probe_timesteps=2", "model.lr_low_noise=1e-3"]
"""A short sweep, then 4 training steps; the low-noise expert's own configured LR (what it trains with when its
suggestion is not trusted, as on the tiny model) differs from the high-noise one's (``optimizer.lr``)."""
CONFIGURED = {"high_noise": 3e-3, "low_noise": 1e-3}  # RUN_SETTINGS' optimizer.lr, FINDER's model.lr_low_noise


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The demo data, 4 clips and 2 images, cached once for the module (the runs only read the cache)."""
    tmp = tmp_path_factory.mktemp("groups_compose")
    config = copy_examples(tmp)
    keep = {"clip_000", "clip_001", "clip_002", "clip_003", "image_000", "image_001"}
    for path in (tmp / "demo_data").iterdir():
        if path.stem not in keep:
            path.unlink()
    assert main(["cache", str(config)]) == 0
    return tmp


def one_expert(workspace: Path, name: str, expert: str, settings: list[str]) -> Path:
    """The quickstart training ``expert`` alone in this process, with the groups' run's settings; its folder."""
    args = ["run", str(workspace / "quickstart.toml"), "--set", f'run.output_dir="{workspace / name}"',
            "--set", f'model.experts="{expert}"']
    for item in [*RUN_SETTINGS, *settings]:
        args += ["--set", item]
    assert main(args) == 0
    return workspace / name


def events(run_dir: Path, kind: str) -> list[dict]:
    """The event log's records of type ``kind``, without their place in the log (sequence number, time)."""
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["_type"] == kind:
            out.append({k: v for k, v in record.items() if k not in ("seq", "wall_time")})
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def file_alphas(path: Path) -> set[float]:
    """The alphas a LoRA file carries (its ``.alpha`` keys), as ComfyUI reads them."""
    return {float(v) for k, v in load_file(str(path)).items() if k.endswith(".alpha")}


def test_each_group_moves_its_expert_to_the_next_alpha_as_a_one_expert_run_and_rank_0_records_both(workspace):
    # stopped at step 3 with a checkpoint, before the decision; resumed to step 6: each group's controller continues
    # from its leader's state (its windows, its step counts)
    saved = ["model.expert_groups=2", *ALPHA, "checkpoint.enabled=true", "checkpoint.every=3"]
    groups = _launch(workspace, "alpha", 2, [*saved, "train.max_steps=3"])
    launch_ranks(workspace, "alpha", 2, saved, flags=("--resume", str(groups)), code="_resumed")
    assert events(groups, "RunStarted")[-1]["resumed_from"].endswith("step_000003")
    changed = events(groups, "AlphaChanged")
    assert sorted(e["expert"] for e in changed) == list(EXPERTS)  # the low-noise group's decision is in the log
    for expert in EXPERTS:
        (reference,) = one_expert(workspace, f"alpha_{expert}", expert, ALPHA).iterdir()
        mine = [e for e in changed if e["expert"] == expert]
        # decided from that expert's own statistics, at the same step, as the one-expert run decides
        assert mine == events(reference, "AlphaChanged") and mine[0]["to_alpha"] == 8.0, expert
        name = f"quickstart_{expert}.safetensors"
        assert (groups / name).read_bytes() == (reference / name).read_bytes(), expert
        assert file_alphas(groups / name) == {8.0}  # applied on the ranks that hold it
    assert changed[0]["statistics"] != changed[1]["statistics"]
    # every figure of an expert comes from its own group (rank 0 counts no steps of the low-noise expert)
    last = metrics(groups)[-1]
    assert last["alpha/steps_in_phase/low_noise"] == last["alpha/steps_in_phase/high_noise"] == 6 - changed[0]["step"]
    lines = [json.loads(x) for x in (groups / "alpha_metrics.jsonl").read_text().splitlines()]
    assert sorted({x["expert"] for x in lines}) == list(EXPERTS)
    (sidecar,) = (groups / "checkpoints").glob("step_000006/*_alpha_scheduler.json")  # rank 0's, both experts
    experts = json.loads(sidecar.read_text())["experts"]
    assert experts["low_noise"]["steps_as_of_log_step"] and experts["low_noise"]["total_steps"] == 6
    assert [experts[e]["alpha"] for e in EXPERTS] == [8.0, 8.0] and len(experts["high_noise"]["losses"]) == 4
    replayed = replay(groups, out=workspace / "alpha_replay")
    assert len(replayed.replayed) == 2 and replayed.replayed == replayed.recorded


def test_the_groups_sweep_their_experts_side_by_side_and_each_trains_on_with_its_own_result(workspace):
    example = doc_example()
    assert {"model.expert_groups=2", "lr_finder.then_train=true"} <= set(example), example
    launch_ranks(workspace, "finder", 2, [*example, *FINDER])
    (sweep,) = (workspace / "finder").glob("*__lr_finder")
    (trained,) = [d for d in (workspace / "finder").iterdir() if d.is_dir() and d != sweep]
    rungs, results = events(sweep, "LrFinderRung"), events(sweep, "LrFinderResult")
    assert events(sweep, "RunStarted")[0]["total_steps"] == 6  # side by side: 6 rungs in 6 steps, both experts
    assert sorted(r["expert"] for r in results) == list(EXPERTS)
    config = tomllib.loads((trained / "config.toml").read_text())
    assert (config["model"]["experts"], config["model"]["expert_groups"]) == ("both", 2)
    assert not config["lr_finder"]["enabled"] and not config["lr_finder"]["then_train"]
    lrs = {}
    for expert in EXPERTS:
        reference = one_expert(workspace, f"finder_{expert}", expert, ["lr_finder.then_train=true", *FINDER])
        (ref_sweep,) = reference.glob("*__lr_finder")
        (ref_trained,) = [d for d in reference.iterdir() if d.is_dir() and d != ref_sweep]
        mine = [r for r in rungs if r["expert"] == expert]
        assert [r["step"] for r in mine] == list(range(1, 7))
        assert mine == events(ref_sweep, "LrFinderRung"), expert  # its own group's losses, rung by rung
        (result,) = [r for r in results if r["expert"] == expert]
        assert [result] == events(ref_sweep, "LrFinderResult"), expert
        # trained on with the result the event log holds: the suggestion when trusted, else its configured LR
        trusted = result["suggested_lr"] is not None and not result["invalid"] and result["suggested_lr"] <= 1.0
        base = config["model"].get(f"lr_{expert}") or config["optimizer"]["lr"]
        assert base == (result["suggested_lr"] if trusted else CONFIGURED[expert]), expert
        ref_config = tomllib.loads((ref_trained / "config.toml").read_text())
        assert config["model"].get(f"lr_{expert}") == ref_config["model"].get(f"lr_{expert}"), expert
        lrs[expert] = [r[f"train/lr/{expert}"] for r in metrics(trained)]
        assert lrs[expert] == [r["train/lr"] for r in metrics(ref_trained)], expert
        name = f"quickstart_{expert}.safetensors"
        assert (trained / name).read_bytes() == (ref_trained / name).read_bytes(), expert
    assert lrs["high_noise"] != lrs["low_noise"]  # each group's optimizer its own expert's LR
