"""``lora.type``: LoRA, LoKr, LoHa and DoRA on the tiny T2V twin. Each trains both experts, exports in the LyCORIS
keys ComfyUI loads, and the exported file applied through ComfyUI's formulas (written here from the documented
math, independently of the trainer) gives the training model's output (fp32 to 1e-6); it starts a run again
(``lora.init_from_*``), keeps its output through an alpha change, and ``wantrain inspect-lora`` names its type."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from wan22_helpers import make_adapter, raw_batch, train_steps

from wantrain.cli.inspect_lora import inspect
from wantrain.core.errors import ConfigError, UserError
from wantrain.models.wan22 import LoraConfig, architecture
from wantrain.models.wan22.adapter_types import DIFFUSERS_TO_WAN, select_modules
from wantrain.models.wan22.export import lora_layers
from wantrain.models.wan22.variants import VARIANTS

WAN_TO_DIFFUSERS = {w: d for d, w in DIFFUSERS_TO_WAN.items()}
# rank != alpha everywhere, so a loader that ignored alpha or applied it twice could not pass
CASES = {
    "lora": {"type": "lora"},
    "dora": {"type": "dora"},
    "loha": {"type": "loha"},
    "lokr": {"type": "lokr"},  # tiny layers: both Kronecker factors full (the scale is folded into lokr_w1)
    "lokr-decomposed": {"type": "lokr", "lokr_factor": 4},  # rank 2: lokr_w2 as lokr_w2_a @ lokr_w2_b
}
RANKS = {"lokr-decomposed": 2}
FILE_KEYS = {
    "lora": {"lora_A.weight", "lora_B.weight", "alpha"},
    "dora": {"lora_A.weight", "lora_B.weight", "alpha", "dora_scale"},
    "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
    "lokr": {"lokr_w1", "lokr_w2"},
    "lokr-decomposed": {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"},
}


def comfyui_weight(weight: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The patched weight ComfyUI computes at strength 1 (comfy/weight_adapter: lora, loha, lokr, DoRA's
    weight_decompose), in float32, from the documented formulas."""
    alpha = float(parts["alpha"]) if "alpha" in parts else None
    if "hada_w1_a" in parts:
        scale = alpha / parts["hada_w1_b"].shape[0] if alpha is not None else 1.0
        return weight + scale * (parts["hada_w1_a"] @ parts["hada_w1_b"]) * (parts["hada_w2_a"] @ parts["hada_w2_b"])
    if any(k.startswith("lokr_") for k in parts):
        w1 = parts["lokr_w1"] if "lokr_w1" in parts else parts["lokr_w1_a"] @ parts["lokr_w1_b"]
        w2 = parts["lokr_w2"] if "lokr_w2" in parts else parts["lokr_w2_a"] @ parts["lokr_w2_b"]
        dim = (parts["lokr_w2_b"].shape[0] if "lokr_w2_b" in parts
               else parts["lokr_w1_b"].shape[0] if "lokr_w1_b" in parts else None)
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
        return weight + scale * torch.kron(w1, w2)
    up, down = parts["lora_B.weight"], parts["lora_A.weight"]
    scale = alpha / down.shape[0] if alpha is not None else 1.0
    patched = weight + scale * (up @ down)
    if "dora_scale" in parts:
        assert parts["dora_scale"].shape == (weight.shape[0], 1)  # on the output axis: ComfyUI norms the base rows
        norm = weight.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps
        patched = patched * (parts["dora_scale"] / norm)
    return patched


def comfyui_patched(expert: str, file: str) -> torch.nn.Module:
    """A fresh base transformer of ``expert`` with ``file`` applied to its weights as ComfyUI applies it."""
    transformer = architecture.tiny_transformer(VARIANTS["tiny-t2v"], 0, expert).eval()
    tensors = load_file(file)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        prefix, _, rest = key.partition(".blocks.")
        block, wan_group, wan_leaf, part = rest.split(".", 3)
        assert prefix == "diffusion_model"
        name = f"blocks.{block}.{WAN_TO_DIFFUSERS[f'{wan_group}.{wan_leaf}']}"
        modules.setdefault(name, {})[part] = value.float()
    layers = dict(transformer.named_modules())
    with torch.no_grad():
        for name, parts in modules.items():
            layers[name].weight.copy_(comfyui_weight(layers[name].weight.float(), parts))
    return transformer


def inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    return dict(hidden_states=torch.randn(2, 16, 3, 8, 8, generator=g), timestep=torch.tensor([950.0, 100.0]),
                encoder_hidden_states=torch.randn(2, 16, 32, generator=g), return_dict=False)


def forward(transformer) -> torch.Tensor:
    with torch.no_grad():
        return transformer(**inputs())[0]


def trained(case: str, tmp_path, **model):
    model.setdefault("gradient_checkpointing", False)
    adapter = make_adapter("tiny-t2v", rank=RANKS.get(case, 4), alpha=7.0, switch_every=1,
                           lora={**CASES[case], "save_dtype": "fp32"}, **model)
    train_steps(adapter, adapter.encode_batch(raw_batch()), steps=4, lr=2e-2)
    files = adapter.saver(tmp_path, "demo").save(step=4, final=True)
    return adapter, dict(zip(adapter.experts, files, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_exported_file_through_comfyui_formulas_equals_the_training_forward(case, tmp_path):
    adapter, files = trained(case, tmp_path)
    for expert, file in files.items():
        keys = {k.split(".", 5)[5] for k in load_file(file)}
        assert keys == FILE_KEYS[case]
        training = adapter.transformer_for(expert)
        adapter.activate(expert, None)
        with adapter.evaluating():
            expected = forward(training)
        base = forward(architecture.tiny_transformer(VARIANTS["tiny-t2v"], 0, expert).eval())
        assert (expected - base).abs().max() > 1e-3, f"{case} {expert}: the adapter changed nothing"
        got = forward(comfyui_patched(expert, file))
        assert torch.allclose(got, expected, rtol=0, atol=1e-6), (case, expert, (got - expected).abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_started_from_the_exported_files_has_the_trained_output(case, tmp_path):
    adapter, files = trained(case, tmp_path)
    again = make_adapter("tiny-t2v", rank=None, switch_every=1, gradient_checkpointing=False,
                         lora={**CASES[case], **{f"init_from_{e}": f for e, f in files.items()}})
    assert again.lora_config.type == CASES[case]["type"]
    for expert in files:
        for a in (adapter, again):
            a.activate(expert, None)
        with adapter.evaluating(), again.evaluating():
            want, got = forward(adapter.transformer_for(expert)), forward(again.transformer_for(expert))
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (case, expert, (got - want).abs().max())


def test_a_file_of_another_type_is_refused_in_one_line(tmp_path):
    _, files = trained("loha", tmp_path)
    with pytest.raises(UserError) as err:
        make_adapter("tiny-t2v", rank=None, lora={"type": "lokr", "init_from_high_noise": files["high_noise"]})
    assert "LoHa file" in str(err.value) and "lora.type = 'loha'" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", ["dora", "loha", "lokr", "lokr-decomposed"])
def test_an_alpha_change_keeping_the_output_keeps_it_and_the_export_follows(case, tmp_path):
    adapter, _ = trained(case, tmp_path)
    transformer = adapter.transformer_for("low_noise")
    adapter.activate("low_noise", None)
    with adapter.evaluating():
        before = forward(transformer)
    adapter.change_lora_alpha(2.5, "low_noise", None, preserve_output=True)
    assert adapter.lora_alpha("low_noise") == 2.5
    with adapter.evaluating():
        after = forward(transformer)
    assert torch.allclose(after, before, rtol=0, atol=1e-5)
    (file,) = [f for f in adapter.saver(tmp_path / "after", "x").save(step=5, final=True) if "low_noise" in f]
    assert torch.allclose(forward(comfyui_patched("low_noise", file)), after, rtol=0, atol=1e-6)


def test_include_and_exclude_select_the_adapted_modules_and_the_file_keys(tmp_path):
    adapter = make_adapter("tiny-t2v", lora={"type": "loha", "include": ["attn2", "ffn"], "exclude": [r"blocks\.1\.",
                                                                                                      r"ffn\.2"]})
    adapted = [n for n, _ in lora_layers(adapter.transformer_for("high_noise"))]
    assert adapted == ["blocks.0.attn2.to_q", "blocks.0.attn2.to_k", "blocks.0.attn2.to_v", "blocks.0.attn2.to_out.0",
                       "blocks.0.ffn.net.0.proj"]
    (file, _) = adapter.saver(tmp_path, "x").save(step=1, final=True)
    modules = {k.rsplit(".", 1)[0] for k in load_file(file)}
    assert modules == {f"diffusion_model.blocks.0.{m}" for m in ("cross_attn.q", "cross_attn.k", "cross_attn.v",
                                                                   "cross_attn.o", "ffn.0")}


def test_a_pattern_that_matches_nothing_is_refused_naming_the_nearest_module_names():
    names = [f"blocks.{i}.{m}" for i in range(2) for m in DIFFUSERS_TO_WAN]
    with pytest.raises(UserError) as err:
        select_modules(names, ["self_atn"], [])
    message = str(err.value)
    assert "lora.include pattern 'self_atn' matches no module" in message and "self_attn." in message
    assert "\n" not in message
    with pytest.raises(UserError, match="leave no module to adapt"):
        select_modules(names, ["attn1"], ["to_"])


def test_module_patterns_are_checked_against_the_variant_when_the_config_loads(tmp_path):
    from wantrain.app.config import load_config

    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\n[lora]\ntype = "lokr"\nexclude = ["blocks\\\\.7\\\\."]\n')
    with pytest.raises(ConfigError, match=r"lora.exclude pattern 'blocks\\\\.7\\\\.' matches no module") as err:
        load_config(config)
    assert "nearest names: blocks.1." in str(err.value)  # tiny-t2v has blocks 0 and 1


@pytest.mark.parametrize("keys, message", [
    ({"type": "lora", "lokr_factor": 4}, "'lora.lokr_factor' applies to lora.type = 'lokr'"),
    ({"type": "loha", "dropout": 0.1}, "'lora.dropout' is LoRA's input dropout"),
    ({"type": "lokr", "plus_lr_ratio": 4.0}, "'lora.plus_lr_ratio' (LoRA+)"),
    ({"type": "lora", "lokr_factor": 0}, "'lora.lokr_factor' = 0"),
    ({"type": "lora", "include": ["("]}, "'lora.include' = '(' is not a regular expression"),
])
def test_each_types_keys_are_checked_at_construction(keys, message):
    with pytest.raises(ConfigError) as err:
        LoraConfig(**keys)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_dora_with_a_vram_budget_plans_the_storages_every_type_plans(tmp_path, capsys, monkeypatch):
    """DoRA reads its base rows dequantised (``adapter_types.base_rows``), so ``auto`` goes on from bf16 to the
    quantised storages for it as for the other types: 16 GiB takes nf4 (bf16 alone, as planned while DoRA was
    refused on quantised storage, fits nothing there)."""
    from tests.models.test_memory_plan import a14b_config
    from wantrain.cli.main import main

    monkeypatch.setattr("wantrain.app.preflight.check_model_files", lambda model, **_: None)  # no A14B weights here
    monkeypatch.setattr("wantrain.app.preflight.missing_model_files", lambda model: [])
    lines = {}
    for budget in (20, 16):
        (tmp_path / str(budget)).mkdir()
        config = a14b_config(tmp_path / str(budget), budget)
        config.write_text(config.read_text() + '\n[lora]\ntype = "dora"\nrank = 32\n')
        main(["check", str(config)])
        lines[budget] = capsys.readouterr().out
    assert "budget 20 GiB: bf16 base," in lines[20] and "budget 16 GiB: nf4 base," in lines[16]


@pytest.mark.parametrize("case, title", [("lora", "LoRA"), ("dora", "DoRA"), ("loha", "LoHa"),
                                         ("lokr", "LoKr (factors full"), ("lokr-decomposed", "LoKr")])
def test_inspect_lora_names_the_type_and_checks_every_module(case, title, tmp_path):
    _, files = trained(case, tmp_path)
    lines = inspect(files["high_noise"])
    assert f"type: {title}" in lines[1]
    assert "expert: high_noise" in lines and lines[-1] == "keys: all valid Wan 2.2 module names"
    tensors = load_file(files["high_noise"])
    dropped = next(k for k in sorted(tensors) if not k.endswith((".alpha", ".dora_scale")))
    broken = tmp_path / "broken.safetensors"
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(broken))
    block, group, leaf = dropped.split(".")[2:5]
    with pytest.raises(UserError, match=rf"module {block}\.{group}\.{leaf} lacks .*; the file is incomplete"):
        inspect(broken)


def test_a_checkpoint_refuses_to_resume_under_another_adapter_layout():
    from wantrain.app.resume import resume_rule

    for key in ("lora.type", "lora.lokr_factor", "lora.lokr_decompose_both", "lora.include", "lora.exclude"):
        assert resume_rule(key) == "refuse", key


@pytest.mark.parametrize("case, base_dtype", [("dora", "fp32"), ("dora", "fp8_scaled"), ("loha", "fp8_scaled"),
                                              ("lokr", "fp8")])
def test_block_swap_exports_the_same_file_as_a_run_without_it(case, base_dtype, tmp_path, monkeypatch):
    """DoRA's export reads the base weights (an fp8 base's dequantised), which block swap keeps off the modules;
    LoKr and LoHa train on fp8 bases (allowed on the CPU here, as the fp8 tests do)."""
    from wantrain.models.wan22 import adapter as adapter_module

    monkeypatch.setattr(adapter_module, "FP8_DEVICE_TYPES", ("cuda", "cpu"))
    saved = {}
    for swap in (0, 1):
        _, files = trained(case, tmp_path / f"swap{swap}", base_dtype=base_dtype, blocks_to_swap=swap,
                           gradient_checkpointing=True)
        saved[swap] = {e: load_file(f) for e, f in files.items()}
    for expert, tensors in saved[0].items():
        assert tensors.keys() == saved[1][expert].keys()
        for key, value in tensors.items():
            assert torch.equal(value, saved[1][expert][key]), (expert, key)
