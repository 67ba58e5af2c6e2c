"""One pre-flight (issue 59): every refusal rule a capability declares is reported, together with the others, in one
pass; no config refusal is left inline outside the capabilities' ``problems`` functions; ``check`` plans without the
data and for a CUDA card on a machine without one, and ``--set`` paths resolve against the current directory."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from wantrain.app.config import RunConfig, load_config, peer_key_problems
from wantrain.app.launch import sequence_bucket_problems
from wantrain.app.preflight import declared_rules, problems
from wantrain.cli.main import main
from wantrain.core.config import structure
from wantrain.core.problems import Machine, Refused
from wantrain.data.report import BucketRow

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "examples" / "demo_data")
SCHEDULE = {"enabled": True, "phases": [{"name": "a", "alpha": 4}, {"name": "b", "alpha": 8}]}
ONE = {"model.experts": "high_noise"}  # fsdp trains one expert per run

# each declared rule: the keys that trigger it (dotted), and the launch it is judged on
TRIGGERS: dict[str, tuple[dict, dict]] = {
    "offload-device": ({"model.offload_device": "meta"}, {}),
    "swap-beyond-blocks": ({"model.blocks_to_swap": 9}, {}),
    "swap-needs-checkpointing": ({"model.blocks_to_swap": 1, "model.gradient_checkpointing": False}, {}),
    "lean-needs-checkpointing": ({"model.recompute": "lean", "model.gradient_checkpointing": False}, {}),
    "budget-chooses-swap": ({"model.vram_budget_gb": 10, "model.blocks_to_swap": 1}, {}),
    "fp8-needs-checkpointing": ({"model.base_dtype": "fp8", "model.gradient_checkpointing": False}, {}),
    "sage-cannot-train": ({"model.attention": "sage"}, {}),
    "dynamic-needs-compile": ({"model.compile_dynamic": True}, {}),
    "one-transformer-keys": ({"model.variant": "tiny-ti2v", "model.experts": "high_noise"}, {}),
    "transformer-file-on-a14b": ({"model.transformer_file": "t.safetensors"}, {}),
    "expert-groups-need-both": ({"model.expert_groups": 2, "model.experts": "high_noise"}, {}),
    "timestep-range": ({"model.min_t": 0.5, "model.max_t": 0.4}, {}),
    "shard-degree-needs-fsdp": ({"model.shard_degree": 2}, {}),
    "fsdp-memory-settings": ({"model.parallel": "fsdp", **ONE, "model.base_dtype": "fp8"}, {}),
    "sequence-degree-heads": ({"model.sequence_degree": 3}, {}),
    "sequence-expert-groups": ({"model.sequence_degree": 2, "model.expert_groups": 2}, {}),
    "lokr-factor-zero": ({"lora.type": "lokr", "lora.lokr_factor": 0}, {}),
    "lokr-keys-on-other-type": ({"lora.lokr_factor": 4}, {}),
    "dropout-on-lokr-loha": ({"lora.type": "loha", "lora.dropout": 0.1}, {}),
    "lora-plus-on-lokr-loha": ({"lora.type": "loha", "lora.plus_lr_ratio": 4.0}, {}),
    "module-pattern": ({"lora.include": ["("]}, {}),
    "waiting-expert-disk": ({"model.waiting_expert": "disk", **ONE}, {}),
    "control-variant": ({"model.condition": "first_last"}, {}),
    "fsdp-optimizer": ({"model.parallel": "fsdp", **ONE, "optimizer.type": "adamw8bit"}, {}),
    "modules-match": ({"lora.include": ["no_such_module"]}, {}),
    "attention-kernel-package": ({"model.attention": "flash"}, {}),
    "attention-kernel-cuda-only": ({"model.attention": "xformers", "train.device": "cpu"}, {}),
    "flash-dtype": ({"model.attention": "flash", "model.base_dtype": "fp32"}, {}),
    "compiler-missing": ({"model.compile": "default", "train.device": "cpu"}, {}),  # PATH without a compiler
    "i2v-single-frame-bucket": ({"model.variant": "tiny-i2v", "data.frames": [1, 5]}, {}),
    "expert-lr-multiplier": ({"model.lr_high_noise": 50.0}, {}),
    "preserve-output-optimizer-state": ({"optimizer.type": "prodigy", "optimizer.lr": 1.0,
                                         "lora.alpha_schedule": SCHEDULE}, {}),
    "lr-finder-adaptive-optimizer": ({"optimizer.type": "prodigy", "optimizer.lr": 1.0, "lr_finder.enabled": True},
                                     {}),
    "warmup-fits-run": ({"lr_scheduler.warmup_steps": 8}, {}),
    "alpha-vs-first-phase": ({"lora.alpha": 2.0, "lora.alpha_schedule": SCHEDULE}, {}),
    "validation-signal": ({"lora.alpha_schedule": {**SCHEDULE, "signal": "validation"}}, {}),
    "lr-finder-run-id": ({"lr_finder.enabled": True, "run.run_id": "a" * 95}, {}),
    "other-expert-lora-expert-groups": ({"model.expert_groups": 2, "sample.enabled": True,
                                         "sample.other_expert_lora": "other.safetensors",
                                         "sample.prompts": ["a cat"]}, {"world_size": 2}),
    "device-name": ({"train.device": "abacus"}, {}),
    "device-no-cuda": ({"train.device": "cuda"}, {"cuda": False}),
    "shard-degree-divides": ({"model.parallel": "fsdp", **ONE, "model.shard_degree": 3}, {"world_size": 4}),
    "sequence-degree-launch": ({"model.sequence_degree": 2}, {"world_size": 1}),
    "expert-groups-launch": ({"model.expert_groups": 2}, {"world_size": 1}),
    "evaluation-under-layout": ({"model.parallel": "fsdp", "model.expert_groups": 2, "sample.enabled": True,
                                 "sample.prompts": ["a cat"]}, {"world_size": 2}),
    "lr-finder-resume": ({"lr_finder.enabled": True}, {"resuming": True}),
    "sequence-degree-buckets": ({"model.sequence_degree": 2, "data.resolutions": [48]}, {"world_size": 2}),
}

# the others each rule must be reported with: 2 bad values and 2 peer keys (one a table's argument)
OTHERS = {"train.log_every": 0, "checkpoint.keep_last": "two", "train.mixed_precision": "bf16",
          "optimizer.learning_rate": 1e-4}


def document(keys: dict) -> dict:
    data: dict = {"model": {"variant": "tiny-t2v"}, "data": {"path": DEMO}, "train": {"max_steps": 8}}
    for dotted, value in keys.items():
        *tables, key = dotted.split(".")
        table = data
        for name in tables:
            table = table.setdefault(name, {})
        table[key] = value
    return data


def reported(keys: dict, machine: dict) -> tuple[list, str]:
    """Every problem one pass finds and where: the loader's (keys, values, the rules across keys: "load"), else
    the pre-flight's of the launch ("launch")."""
    data = document(keys)
    try:
        cfg = structure(RunConfig, data, found=peer_key_problems(data))
    except Refused as exc:
        return list(exc.problems), "load"
    found = problems(cfg, Machine(**{"cuda": False, **machine}))
    if cfg.model.sequence_degree > 1:  # the one rule of the data's buckets (asked once the data is probed)
        found += sequence_bucket_problems(cfg, [BucketRow(48, 48, 9, 1, 1, 1, 0)])
    return found, "launch"


def test_every_declared_rule_has_a_trigger():
    assert sorted(r.id for r in declared_rules()) == sorted(TRIGGERS)


@pytest.mark.parametrize("rule", sorted(TRIGGERS))
def test_each_rule_is_reported_together_with_the_others_in_one_pass(rule, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no C++ compiler (compiler-missing)
    monkeypatch.setenv("CXX", "no-such-compiler")
    keys, machine = TRIGGERS[rule]
    alone, stage = reported(keys, machine)
    assert rule in {p.rule for p in alone}, [p.line() for p in alone]
    if stage == "launch":
        # judged by the pre-flight on a valid config: reported with another of its kind (a warmup as long as the
        # run; for that one, a device that does not exist)
        other = {"train.device": "abacus"} if rule == "warmup-fits-run" else {"lr_scheduler.warmup_steps": 8}
        together, _ = reported({**keys, **other}, machine)
        assert {rule, "device-name" if rule == "warmup-fits-run" else "warmup-fits-run"} <= {p.rule for p in together}
        return
    together, _ = reported({**keys, **OTHERS}, machine)
    lines = [p.line() for p in together]
    assert rule in {p.rule for p in together}, lines
    for needle in ("train.log_every", "checkpoint.keep_last", "mixed_precision", "optimizer.learning_rate"):
        assert any(needle in line for line in lines), (needle, lines)


# a value each section refuses by itself (keys), with a rule across sections that reads another key of it (rule id)
VALUE_AND_RULE = {
    "data": ({"model.variant": "tiny-i2v", "data.frames": [1, 5], "data.tag_separator": " "},
             "data.tag_separator", "i2v-single-frame-bucket"),
    "optimizer": ({"optimizer.type": "prodigy", "optimizer.lr": 1.0, "optimizer.no_such_argument": 1,
                   "lr_finder.enabled": True}, "optimizer.no_such_argument", "lr-finder-adaptive-optimizer"),
    "alpha schedule": ({"optimizer.type": "prodigy", "optimizer.lr": 1.0,
                        "lora.alpha_schedule": {**SCHEDULE, "min_samples": 50, "window": 10}},
                       "lora.alpha_schedule.min_samples", "preserve-output-optimizer-state"),
    "sample": ({"sample.frames": 6, "model.expert_groups": 2, "sample.enabled": True,
                "sample.other_expert_lora": "other.safetensors", "sample.prompts": ["a cat"]},
               "sample.frames", "other-expert-lora-expert-groups"),
}


@pytest.mark.parametrize("section", sorted(VALUE_AND_RULE))
def test_a_value_a_section_refuses_keeps_the_rules_that_read_its_other_keys(section):
    """A section's own refusal of one value is a problem beside the others: the section is still built, so a rule
    across sections reading another of its keys is reported in the same pass (it was dropped with the section)."""
    keys, bad_key, rule = VALUE_AND_RULE[section]
    found, stage = reported({**keys, **OTHERS}, {})
    assert stage == "load"
    assert rule in {p.rule for p in found}, [p.line() for p in found]
    assert [p.keys for p in found if p.rule == "value"] == [(bad_key,)], [p.line() for p in found]
    assert sum("optimizer.learning_rate" in p.line() for p in found) == 1  # a peer key, with them


def test_every_section_refusing_a_value_is_named_beside_an_unknown_key():
    """One check names every problem: a section that refuses a value of its own after a wrong key elsewhere is
    reported, not lost (each of these once stopped at, or vanished behind, the first problem)."""
    bad = {"train.no_such_key": 1, "data.tag_separator": " ", "optimizer.no_such_argument": 1,
           "lr_scheduler.T_mult": 2, "lora.alpha_schedule": {**SCHEDULE, "targets": "conv"},
           "validation.timesteps": [0.5, 0.5], "sample.frames": 6, "train.max_epochs": 2}
    found, _ = reported(bad, {})
    lines = [p.line() for p in found]
    for needle in ("train.no_such_key", "data.tag_separator", "optimizer.no_such_argument", "lr_scheduler.T_mult",
                   "lora.alpha_schedule.targets", "validation.timesteps", "sample.frames", "train.max_epochs"):
        assert sum(needle in line for line in lines) == 1, (needle, lines)
    assert len(lines) == 8, lines


def test_three_peer_keys_two_bad_values_and_a_refused_pair_are_named_each_on_its_line(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nvariant = "tiny-t2v"\nparallel = "fsdp"\nexperts = "high_noise"\n'
                      f'[lora]\nnetwork_module = "networks.lora_wan"\n[data]\npath = "{DEMO}"\n'
                      '[train]\nmax_steps = 8\nlog_every = 0\nmixed_precision = "bf16"\n'
                      '[checkpoint]\nkeep_last = "two"\n[optimizer]\ntype = "adafactor"\nlearning_rate = 1e-4\n')
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "wantrain check: error: 6 problems in the config, all of them:", err
    body = "\n".join(err[1:])
    for needle in ("network_module", "mixed_precision", "optimizer.learning_rate", "train.log_every",
                   "checkpoint.keep_last", "optimizer.type = 'adafactor'"):
        assert sum(needle in line for line in err[1:]) == 1, (needle, body)
    assert len(err) == 7 and all(line.startswith("  [") for line in err[1:]), body


def test_no_config_refusal_is_left_inline_outside_the_capabilities():
    """The files the issue found refusals in, and the sections' own value checks, raise only what is no config rule:
    files, --set syntax, checkpoints, what a loaded model allows (each listed with why). A section's check of its
    own values states problems (``core.problems.bad_value``), collected by the loader beside the others."""
    allowed = {
        "app/config.py": ("--set", "config file", "is a folder", "ConfigError(problem"),  # the command line, the file
        "app/preflight.py": (),
        "app/run_plan.py": ("below the step of checkpoint", "{where}"),  # the checkpoint resumed and its data
        "app/memory_plan.py": ("largest bucket", "vram_budget_gb = {model", "host memory"),  # the data's buckets
        "app/device_plan.py": (),
        "app/notes.py": (),
        "app/lr_finder.py": (),
        "app/launch.py": (),
        "models/wan22/config.py": (),
        "models/wan22/rules.py": (),
        "models/wan22/attention.py": ("cannot be used",),  # diffusers' own check of a loaded transformer
        "models/wan22/compile.py": ("cache folder", "LyCORIS module dropout", "layerwise casting", "_one_line"),
        # the guard of the launch rule app.launch reports
        "core/parallel/expert_groups.py": ("needs a torchrun launch",),
        "core/settings.py": (),
        "data/config.py": (),
        # the external class resolved when the optimizer is built; the section's check states each as a problem
        "optimizers/config.py": ("dotted class path", "refusal(", "cannot import module", "not an optimizer class"),
        # the warmup against the run's length: the launch rule warmup-fits-run states it (scheduler_problems)
        "schedulers/config.py": ("leaves no step",),
        "observers/alpha/config.py": (),
        "observers/evaluation/config.py": (),
    }
    raise_at = re.compile(r"raise (?:UserError|ConfigError)\((.*)")
    for name, reasons in allowed.items():
        text = (ROOT / "wantrain" / name).read_text()
        lines = text.splitlines()
        for i, line in enumerate(lines):
            match = raise_at.search(line)
            if match:
                context = " ".join(lines[i:i + 2])
                assert any(r in context for r in reasons), f"{name}:{i + 1}: a refusal left inline: {line.strip()}"


def test_check_plans_without_the_data_and_for_cuda_on_a_machine_without_it_and_run_refuses(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\n[data]\npath = "/path/to/dataset"\nframes = [9]\n'
                      '[train]\nmax_steps = 8\ndevice = "cuda"\n')
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "memory plan for" in out, out
    assert "data not found (/path/to/dataset): the plan is made from the config's buckets" in out
    assert "this machine has no CUDA GPU, so it cannot run this config" in out
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "asks for CUDA but no CUDA GPU is available" in err and not (tmp_path / "runs").exists()


def test_a_set_path_resolves_against_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.toml").write_text('[model]\nvariant = "tiny-t2v"\n[data]\npath = "media"\n')
    monkeypatch.chdir(tmp_path)
    typed = load_config("configs/run.toml", ["data.path=mine"])
    assert typed.data.path == tmp_path / "mine"  # as typed in the shell, not configs/mine
    assert load_config("configs/run.toml").data.path == tmp_path / "configs" / "media"  # the file's: its folder


def test_the_compose_table_of_docs_config_md_lists_every_refused_pair():
    page = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    pairs = [r for r in declared_rules() if r.pair is not None]
    assert len(pairs) >= 20
    for rule in pairs:
        assert f"| {rule.pair[0]} | {rule.pair[1]} | `{rule.id}` |" in page, rule.id


def test_the_assembly_enters_the_pre_flight_through_plan_run_alone():
    """``prepare`` asks the pre-flight once (``app.run_plan.plan_run``) and loads what it returns: the assembly
    imports no other pre-flight module (it called six of their functions in turn; bench/trace_preflight.py counts
    the calls)."""
    preflight = {f"wantrain.app.{name}" for name in ("preflight", "run_plan", "launch", "memory_plan", "device_plan",
                                                     "notes")}
    tree = ast.parse((ROOT / "wantrain" / "app" / "assemble.py").read_text(encoding="utf-8"))
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module in preflight for alias in node.names}
    assert imported == {("wantrain.app.run_plan", name) for name in ("RunPlan", "check_resume_data", "plan_run")}

