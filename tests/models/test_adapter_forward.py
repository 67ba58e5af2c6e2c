"""The lean forwards of LoKr, LoHa and DoRA (``adapter_forward.py``) against peft's own: the same outputs and
gradients (float32 to 1e-5 relative on a real-width Linear, bfloat16 to its rounding, and a training step of the
tiny twin), and none of the full-size tensors peft's forwards build or keep for backward."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import inject_adapter_in_model
from torch import nn

from wantrain.models.wan22 import LoraConfig, adapter_forward, architecture
from wantrain.models.wan22.adapter_types import ADAPTER_NAME, adapter_type, candidate_modules
from wantrain.models.wan22.variants import VARIANTS

CASES = {"lokr": {"type": "lokr"}, "lokr-decomposed-both": {"type": "lokr", "lokr_decompose_both": True},
         "loha": {"type": "loha"}, "dora": {"type": "dora"}}
REAL_WIDTH = 3072  # TI2V-5B's attention Linears: 3072 x 3072 (A14B's 5120 and 13824 are in docs/benchmarks.md)


def linear_with(case: str, width_in: int, width_out: int, dtype: torch.dtype) -> nn.Module:
    """One Linear (base in ``dtype``) with ``case``'s adapter as wantrain builds it, every factor non-zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width_in, width_out)).requires_grad_(False).to(dtype)
    config = adapter_type(CASES[case]["type"]).peft_config(LoraConfig(rank=4, alpha=3.0, **CASES[case]), ["0"])
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if ADAPTER_NAME in name:
            start = 1.0 if "magnitude" in name else 0.0
            param.data = torch.randn(param.shape, generator=generator) * 0.05 + start
            param.requires_grad_(True)
    return model.train()


def peft_and_lean(case: str, width_in: int, width_out: int, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    peft = linear_with(case, width_in, width_out, dtype)
    lean = copy.deepcopy(peft)
    assert adapter_forward.install(lean) == 1
    return peft, lean


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and the gradients (input and adapter) of a loss that weighs every output column differently."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out.float() * torch.linspace(-1.0, 1.0, out.shape[-1])).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), {"input": x.grad.float(), **grads}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("case", list(CASES))
def test_the_lean_forward_gives_pefts_output_and_gradients_on_a_real_width_linear(case):
    peft, lean = peft_and_lean(case, REAL_WIDTH, REAL_WIDTH, torch.float32)
    x = torch.randn(2, 4, REAL_WIDTH, generator=torch.Generator().manual_seed(2))
    (want, want_grads), (got, got_grads) = step(peft, x), step(lean, x)
    with torch.no_grad():
        base = peft[0].base_layer(x)
    assert relative(got - base, want - base) < 1e-5  # the adapter's part of the output
    assert set(got_grads) == set(want_grads) and len(want_grads) >= 3  # the input and every factor
    for name, grad in want_grads.items():
        assert relative(got_grads[name], grad) < 1e-5, name


@pytest.mark.parametrize("case", list(CASES))
def test_the_lean_forward_in_bfloat16_matches_peft_to_its_rounding(case):
    peft, lean = peft_and_lean(case, 96, 160, torch.bfloat16)  # LoKr: 96 = 8 x 12, 160 = 10 x 16
    x = torch.randn(3, 7, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    (want, want_grads), (got, got_grads) = step(peft, x), step(lean, x)
    assert got.dtype == want.dtype and relative(got, want) < 2**-8
    for name, grad in want_grads.items():
        assert grad.dtype == got_grads[name].dtype and relative(got_grads[name], grad) < 2**-8, name


def largest_tensors(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(elements of the largest tensor saved for backward other than the weights, of the largest tensor any op
    creates) in one step."""
    saved, made = [0], [0]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # and their views

    class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in weights:
                    made[0] = max(made[0], t.numel())
            return out

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[0] = max(saved[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Sizes():
        step(model, x)
    return saved[0], made[0]


@pytest.mark.parametrize("case", list(CASES))
def test_no_full_size_matrix_is_kept_for_backward_and_lokr_and_dora_never_build_one(case, monkeypatch):
    width_in, width_out, tokens = 192, 128, 8  # more weight elements than input or output ones
    monkeypatch.setattr(adapter_forward, "NORM_ROWS", 32)  # DoRA's norms: 32 of the 128 rows at a time
    peft, lean = peft_and_lean(case, width_in, width_out, torch.float32)
    x = torch.randn(tokens, width_in)
    weight = width_in * width_out
    peft_saved, peft_made = largest_tensors(peft, x)
    saved, made = largest_tensors(lean, x)
    assert peft_saved >= weight or peft_made >= width_in**2  # what peft does: the [out, in] delta, DoRA's eye(in)
    assert saved <= tokens * max(width_in, width_out)  # inputs, outputs and factors only
    if case != "loha":  # LoHa builds its delta for the moment it is used (forward, backward), never keeps it
        assert made < weight


def twin_with(case: str) -> nn.Module:
    """The tiny T2V twin's transformer with ``case``'s adapter on every block Linear (non-zero factors), gradient
    checkpointing on as in a run."""
    transformer = architecture.tiny_transformer(VARIANTS["tiny-t2v"], 0, "high_noise").requires_grad_(False)
    transformer.enable_gradient_checkpointing()
    config = adapter_type(CASES[case]["type"]).peft_config(LoraConfig(rank=4, alpha=3.0, **CASES[case]),
                                                           candidate_modules(len(transformer.blocks)))
    transformer.add_adapter(config, adapter_name=ADAPTER_NAME)
    generator = torch.Generator().manual_seed(1)
    for name, param in transformer.named_parameters():
        if ADAPTER_NAME in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.1 + (1.0 if "magnitude" in name else 0.0)
            param.requires_grad_(True)
    return transformer.train()


@pytest.mark.parametrize("case", ["lokr", "loha", "dora"])
def test_a_training_step_of_the_tiny_twin_has_pefts_loss_and_gradients(case):
    peft = twin_with(case)
    lean = copy.deepcopy(peft)
    assert adapter_forward.install(lean) == 10 * len(lean.blocks)
    g = torch.Generator().manual_seed(3)
    inputs = dict(hidden_states=torch.randn(2, 16, 3, 8, 8, generator=g), timestep=torch.tensor([950.0, 100.0]),
                  encoder_hidden_states=torch.randn(2, 16, 32, generator=g), return_dict=False)

    def loss_and_gradients(transformer):
        loss = transformer(**inputs)[0].square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in transformer.named_parameters() if p.grad is not None}

    (want, want_grads), (got, got_grads) = loss_and_gradients(peft), loss_and_gradients(lean)
    assert relative(got, want) < 1e-6 and set(got_grads) == set(want_grads) and len(want_grads) >= 20
    for name, grad in want_grads.items():
        assert relative(got_grads[name], grad) < 1e-5, name


@pytest.mark.parametrize("case", ["lokr", "loha", "dora"])
def test_each_lean_forward_compiles_into_one_graph_and_trains_as_eager(case):
    """``fullgraph=True``: any graph break fails; the scale a tensor input and LyCORIS' module-dropout draw gone, as
    compiled blocks have them (``compile.py``)."""
    from wantrain.models.wan22.compile import _without_module_dropout, tensor_scaling

    eager, lean = peft_and_lean(case, 96, 160, torch.float32)
    tensor_scaling(lean)
    if case != "dora":
        lean[0].forward = _without_module_dropout(lean[0])
    compiled = torch.compile(lean, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(2))
    (want, want_grads), (got, got_grads) = step(eager, x), step(compiled, x)
    assert relative(got, want) < 1e-6
    for name, grad in want_grads.items():
        assert relative(got_grads[name.replace("_orig_mod.", "")] if name in got_grads else
                        got_grads[f"_orig_mod.{name}"], grad) < 1e-5, name
