"""The resume check of a state tree against the run (core.state_check): the schema of the core's sections, the
model's tensors, the optimizer's groups and per-parameter state. Trees from a real Trainer on the linear stand-in."""

from __future__ import annotations

import torch

from wantrain.core.checkpoint import copy_tree
from wantrain.core.state_check import check_state_tree

from .test_guards_and_state import build


def trained_tree():
    trainer, adapter, _ = build(None, max_steps=4, save_every=None)
    trainer.run()
    groups = [list(g["params"]) for g in adapter.param_groups()]
    model = {f"{e}/{i}": p for e in adapter.experts for i, p in enumerate(adapter.trainable_parameters(e))}
    return copy_tree(trainer.state_dict()), model, groups


def test_a_trainers_own_tree_fits_its_run():
    tree, model, groups = trained_tree()
    assert check_state_tree(tree, model=model, param_groups=groups) is None


def test_a_missing_or_mistyped_section_is_named():
    tree, _, _ = trained_tree()
    del tree["optimizer"]
    assert check_state_tree(tree) == "section 'optimizer' is missing from the state tree"
    tree, _, _ = trained_tree()
    tree["train_state"]["step"] = "7"
    assert "'train_state/step' is '7'" in check_state_tree(tree)
    tree, _, _ = trained_tree()
    tree["rng"]["torch"] = tree["rng"]["torch"].to(torch.int32)
    assert "'rng/torch' is a int32 tensor" in check_state_tree(tree)


def test_a_model_tensor_of_another_dtype_or_shape_or_name_is_named():
    tree, model, groups = trained_tree()
    name = next(k for k, v in model.items() if v.dim() == 2)
    tree["model"][name] = tree["model"][name].T.contiguous()
    assert check_state_tree(tree, model=model) == (f"tensor 'model/{name}' has shape [4, 1], this run's has [1, 4]")
    tree, model, _ = trained_tree()
    tree["model"][name] = tree["model"][name].to(torch.int32)
    assert check_state_tree(tree, model=model) == f"tensor 'model/{name}' is int32, this run's is float32"
    tree, model, _ = trained_tree()
    tree["model"].pop(name)
    assert check_state_tree(tree, model=model).startswith(f"'model/{name}' is missing")


def test_an_optimizer_moment_that_does_not_fit_its_parameter_is_named():
    tree, model, groups = trained_tree()
    index, entry = next((i, e) for i, e in tree["optimizer"]["state"].items() if e["exp_avg"].dim() == 2)
    entry["exp_avg"] = entry["exp_avg"].T.contiguous()
    assert check_state_tree(tree, param_groups=groups) == (
        f"tensor 'optimizer/state/{index}/exp_avg' has shape [4, 1], its parameter has [1, 4]")
    tree, _, _ = trained_tree()
    moments = tree["optimizer"]["state"][index]
    moments["exp_avg_sq"] = moments["exp_avg_sq"].to(torch.int32)
    assert "is int32, expected floating point" in check_state_tree(tree, param_groups=groups)
    tree, _, _ = trained_tree()
    assert check_state_tree(tree, param_groups=groups[:1]) == (
        "'optimizer' has 2 parameter groups, this run's optimizer has 1")
