"""LoRA files stacked under the trained LoRA while sampling (``[sample] loras``, a prompt's ``loras``).

A file is read by diffusers' own Wan LoRA reader (``WanLoraLoaderMixin.lora_state_dict``: the ComfyUI / original
Wan, kijai, lightx2v, musubi-tuner and diffusers key formats, alpha folded into the matrices, lightx2v's ``diff_b``
biases as ``lora_B.bias``), once, onto the CPU. While a sample is made, each of its modules adds to the output of
the transformer's module of that name (the peft layer of a trained module, which already holds the trained LoRA,
or a plain Linear) through a forward hook::

    y = module(x) + strength * (B (A x) + bias)

which is what ComfyUI computes with the LoRA merged at that strength (``W + strength * B A``), without touching the
base weights (no bf16 round trip) or the trained adapter. The hooks are removed when the sample is made: the
tensors are no parameter of any module, so they are never trained, checkpointed or exported. A module the file
names that the transformer does not have (or of other shapes) is *unmatched*: :func:`attach` returns those names
and the sample observer logs them in one line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from wantrain.core.errors import UserError

_PART = re.compile(r"^(transformer\.)?(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias)$")


@attrs.frozen
class StackedModule:
    """One module's stacked LoRA: ``down`` [rank, in] and ``up`` [out, rank] (alpha folded in), ``bias`` [out];
    either pair may be None (a bias-only module)."""

    down: torch.Tensor | None
    up: torch.Tensor | None
    bias: torch.Tensor | None


def read_stacked(path: Path, key: str) -> tuple[dict[str, StackedModule], list[str]]:
    """The modules of the LoRA file ``path`` by diffusers module name, and the keys of no module (config key
    ``key`` names the file in errors). Raises ``UserError`` (one line) for a file diffusers cannot read."""
    from diffusers.loaders import WanLoraLoaderMixin

    try:
        state = WanLoraLoaderMixin.lora_state_dict(str(path))
    except (ValueError, KeyError, RuntimeError, OSError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"config key '{key}' = '{path}' is not a Wan LoRA diffusers can read ({first[:200]}); "
                        "give a LoRA .safetensors in the ComfyUI, kijai, lightx2v, musubi-tuner or diffusers "
                        "format") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    strays = []
    for name, tensor in state.items():
        match = _PART.match(name)
        if match is None:
            strays.append(name)
            continue
        parts.setdefault(match.group("module"), {})[match.group("part")] = tensor.detach().cpu()
    modules = {m: StackedModule(p.get("lora_A.weight"), p.get("lora_B.weight"), p.get("lora_B.bias"))
               for m, p in parts.items()}
    return modules, sorted(strays)


def _fits(layer: nn.Module, part: StackedModule) -> bool:
    base = getattr(layer, "base_layer", layer)  # a trained module is a peft layer around its Linear
    if not isinstance(getattr(base, "in_features", None), int):
        return False
    out_ok = all(t is None or t.shape[0] == base.out_features for t in (part.up, part.bias))
    in_ok = part.down is None or part.down.shape[1] == base.in_features
    pair_ok = (part.down is None) == (part.up is None) and (part.down is None or part.up.shape[1] == part.down.shape[0])
    return out_ok and in_ok and pair_ok


def _hook(part: StackedModule, strength: float) -> Callable[..., torch.Tensor]:
    on: dict[tuple[torch.device, torch.dtype], tuple] = {}  # the tensors on the input's device, in its dtype

    def add(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        x = inputs[0]
        where = (x.device, x.dtype)
        if where not in on:
            on[where] = tuple(None if t is None else t.to(x.device, x.dtype) for t in (part.down, part.up, part.bias))
        down, up, bias = on[where]
        if down is not None:
            delta = nn.functional.linear(nn.functional.linear(x, down), up, bias)
        else:
            delta = bias.expand(*output.shape[:-1], -1)
        return output + (strength * delta).to(output.dtype)

    return add


def attach(transformer: nn.Module, modules: dict[str, StackedModule], strength: float) -> tuple[list[Any], list[str]]:
    """Hook every module of ``modules`` that ``transformer`` has (with fitting shapes) at ``strength``; returns the
    hook handles (remove them to detach) and the names of the modules left unmatched."""
    named = dict(transformer.named_modules())
    handles, unmatched = [], []
    for name, part in modules.items():
        layer = named.get(name)
        if layer is None or not _fits(layer, part):
            unmatched.append(name)
            continue
        handles.append(layer.register_forward_hook(_hook(part, strength)))
    return handles, sorted(unmatched)


@torch.no_grad()
def merge_into(transformer: nn.Module, modules: dict[str, StackedModule], strength: float) -> None:
    """Add ``strength * B A`` (and the bias) to the base weights of ``transformer`` in place: the merged model a
    stacked sample equals (tests; ComfyUI's way of applying a LoRA)."""
    named = dict(transformer.named_modules())
    for name, part in modules.items():
        layer = named.get(name)
        if layer is None or not _fits(layer, part):
            continue
        base = getattr(layer, "base_layer", layer)
        if part.down is not None:
            base.weight += strength * (part.up.float() @ part.down.float()).to(base.weight.dtype)
        if part.bias is not None and base.bias is not None:
            base.bias += strength * part.bias.to(base.bias.dtype)
