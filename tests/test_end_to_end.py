"""End to end on the tiny real Wan model and the committed demo data: `wantrain run examples/quickstart.toml`,
shortened, then what the run directory holds, that the model learned, and the README's observer example."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from wantrain.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.toml"

pytestmark = pytest.mark.slow


def copy_examples(tmp: Path, *, validation_and_samples: bool = False) -> Path:
    """The quickstart config and demo data in a scratch folder, so caches and runs stay out of the repo. The
    quickstart's [validation] and [sample] sections are switched off unless asked for: the tests about them ask,
    the others save their cost."""
    shutil.copytree(ROOT / "examples" / "demo_data", tmp / "demo_data",
                    ignore=shutil.ignore_patterns(".wantrain_cache"))
    text = QUICKSTART.read_text(encoding="utf-8").replace('"../runs"', '"runs"')
    if not validation_and_samples:
        text, n = re.subn(r"(\[(?:validation|sample)\][^\n]*\nenabled = )true", r"\1false", text)
        assert n == 2, "the quickstart's [validation]/[sample] sections changed shape"
    config = tmp / "quickstart.toml"
    config.write_text(text, encoding="utf-8")
    return config


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("quickstart")
    config = copy_examples(tmp)
    code = main(["run", str(config), "--max-steps", "160", "--run-id", "e2e",
                 "--set", "optimizer.lr=3e-3", "--set", "train.save_every=80", "--set", "observers.progress=false"])
    assert code == 0
    (run_dir,) = (tmp / "runs").iterdir()
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_quickstart_run_dir_holds_config_tensorboard_metrics_logs_and_loras(quickstart_run):
    assert quickstart_run.name.endswith("__e2e")
    resolved = tomllib.loads((quickstart_run / "config.toml").read_text())
    assert resolved["train"]["max_steps"] == 160 and resolved["model"]["variant"] == "tiny-t2v"
    assert list((quickstart_run / "tensorboard").glob("events.out.tfevents.*"))
    assert metrics(quickstart_run)[-1]["step"] == 160
    log_lines = [json.loads(x) for x in (quickstart_run / "log.jsonl").read_text().splitlines()]
    assert {"run_started", "lora_saved", "run_ended"} <= {x["event"] for x in log_lines}
    for expert in ("high_noise", "low_noise"):
        assert (quickstart_run / f"quickstart_{expert}.safetensors").stat().st_size > 0
        assert (quickstart_run / f"quickstart_step000080_{expert}.safetensors").exists()
    for stem in ("quickstart", "quickstart_step000080"):  # a ComfyUI graph beside each LoRA set, its files named
        graph = json.loads((quickstart_run / f"{stem}.workflow.json").read_text())
        loras = {n["inputs"]["lora_name"] for n in graph.values() if n["class_type"] == "LoraLoaderModelOnly"}
        assert loras == {f"{stem}_high_noise.safetensors", f"{stem}_low_noise.safetensors"}
    assert json.loads((quickstart_run / "preflight.json").read_text())["steps_per_epoch"] > 0


def test_tiny_model_learns_the_demo_data(quickstart_run):
    losses = [row["train/loss"] for row in metrics(quickstart_run) if "train/loss" in row]  # not val/-only lines
    fifth = len(losses) // 5
    first, last = sum(losses[:fifth]) / fifth, sum(losses[-fifth:]) / fifth
    assert last < first * 0.95, (first, last)


def test_report_draws_the_quickstart_run(quickstart_run, capsys):
    out = quickstart_run / "report.png"
    assert main(["report", str(quickstart_run), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert "160" in capsys.readouterr().out


def test_readme_observer_example_runs_and_receives_events(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- observer-example:start -->\s*```python\n(.*?)```", readme, re.S)
    assert block, "README lost its observer example"
    config = copy_examples(tmp_path, validation_and_samples=True)  # the quickstart as a user has it
    (tmp_path / "my_observers.py").write_text(block.group(1), encoding="utf-8")
    toml_snippet = re.search(r"```toml\n(\[observers\]\nextra = .*?)```", readme, re.S).group(1)
    config.write_text(config.read_text().replace("[train]", toml_snippet + "\n[train]"), encoding="utf-8")
    typed = re.search(r"```bash\nwantrain run quickstart\.toml(.*?)\n```", readme).group(1).split()
    assert "--allow-code" in typed  # the README says to allow the code its config names (wantrain.core.trust)
    code = main(["run", str(config), *typed, "--max-steps", "10", "--set", "train.log_every=5",
                 "--set", "observers.progress=false"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "step 5: loss" in out and "step 10: loss" in out
    assert "LossWatch saw 2 log steps; run completed" in out
    assert "Traceback" not in out + err and "observer_error" not in err


def test_check_prints_the_preflight_report_for_the_quickstart(tmp_path, capsys):
    config = copy_examples(tmp_path)
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "steps per epoch" in out.lower()


def test_second_run_reads_every_latent_and_embedding_from_the_cache(quickstart_run):
    def cache_ready(run_dir: Path) -> dict:
        lines = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
        return next(x for x in lines if x["event"] == "cache_ready")

    first = cache_ready(quickstart_run)
    assert first["latents_encoded"] == 20 and first["texts_encoded"] == 20 and first["latents_hit"] == 0
    config = quickstart_run.parent.parent / "quickstart.toml"
    assert main(["run", str(config), "--max-steps", "2", "--run-id", "again",
                 "--set", "observers.progress=false"]) == 0
    (again,) = quickstart_run.parent.glob("*__again")
    second = cache_ready(again)
    assert (second["latents_encoded"], second["texts_encoded"]) == (0, 0)
    assert (second["latents_hit"], second["texts_hit"]) == (20, 20)


SEED_SCHEDULER_TABLES = {
    "decay": """[lr_scheduler_config]
type = 'cosine_annealing_warm_restarts_decay'
T_0 = 1000
T_mult = 1
eta_min = 1e-7
gamma = 0.9  # Decay factor for restarts
""",
    "external": """[lr_scheduler_config]
type = 'external'
class = 'torch.optim.lr_scheduler.StepLR'
step_size = 30
gamma = 0.1
""",
}


@pytest.mark.parametrize("name", sorted(SEED_SCHEDULER_TABLES))
def test_the_seeds_scheduler_config_examples_train(tmp_path, name):
    """The two [lr_scheduler_config] examples of the seed PR, verbatim, drive a real run."""
    config = copy_examples(tmp_path)
    text = config.read_text()
    start = text.index("[lr_scheduler]")
    assert "\n[" not in text[start:], "quickstart.toml: [lr_scheduler] is expected to be the last table"
    config.write_text(text[:start] + SEED_SCHEDULER_TABLES[name], encoding="utf-8")
    assert main(["run", str(config), "--max-steps", "4", "--set", "train.log_every=1",
                 "--set", "observers.progress=false"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    lrs = [row["train/lr"] for row in metrics(run_dir) if "train/lr" in row]  # not val/-only lines
    base = 2e-3  # optimizer.lr of the quickstart
    if name == "external":
        assert lrs == [base] * 4  # StepLR(step_size=30): no decay within 4 steps
    else:
        assert lrs[0] == pytest.approx(base) and lrs == sorted(lrs, reverse=True) and lrs[-1] < base
