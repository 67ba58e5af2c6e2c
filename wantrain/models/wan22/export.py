"""Adapter files in the original Wan naming that ComfyUI reads (and diffusers, for LoRA).

One file per trained expert (``<name>_high_noise.safetensors`` / ``<name>_low_noise.safetensors``, or
``<name>.safetensors`` for the 5B). For every adapted Linear of block N the file holds, for ``lora.type = "lora"``::

    diffusion_model.blocks.N.self_attn.q.lora_A.weight   [rank, in]     (also k, v, o; cross_attn q, k, v, o;
    diffusion_model.blocks.N.self_attn.q.lora_B.weight   [out, rank]     ffn.0 and ffn.2)
    diffusion_model.blocks.N.self_attn.q.alpha           scalar float32

and for LoKr, LoHa and DoRA the LyCORIS keys under the same module names (``lokr_w1`` / ``lokr_w2`` or their
``_a`` / ``_b`` factors, ``hada_w1_a`` ... ``hada_w2_b``, DoRA's ``dora_scale``; ``adapter_types.py`` has the
formulas ComfyUI applies and how the file is made to match them).

``alpha`` is the alpha in force when the file is written, read from the live peft layer (``scaling * r``), so a
controller that changes alpha during training is exported as it stands; ComfyUI and diffusers scale by
alpha/rank. Metadata (ignored by the loaders, shown by ``wantrain inspect-lora``) records the adapter type,
variant, expert, rank, alpha, step and the wantrain version. No Wan 2.1-only keys (``k_img``/``v_img``) exist in
Wan 2.2.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from wantrain.core.atomic import atomic_write
from wantrain.core.checkpoint import SAVE_HINT, canonicalize_safetensors
from wantrain.core.version import __version__
from wantrain.models.wan22.adapter_types import (
    ADAPTER_NAME,
    DIFFUSERS_TO_WAN,
    AdapterType,
    adapted_layers,
    adapter_type,
    wan_name,
)
from wantrain.models.wan22.swap import run_order_names

__all__ = ["ADAPTER_NAME", "DIFFUSERS_TO_WAN", "LORA_TARGET_REGEX", "WAN_KEY", "Wan22Saver", "adapter_state_dict",
           "atomic_save", "live_alpha", "lora_layers", "set_live_alpha", "wan_module_name", "wan_state_dict"]
# peft target regex (full match against module names): the 10 Linears of every block, nothing else.
LORA_TARGET_REGEX = (
    r"blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|attn2\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))"
)
# the tensor names of one module in a file, every type: LoRA (both namings), DoRA's scale, LoHa's and LoKr's factors
FILE_PARTS = (r"lora_A\.weight|lora_B\.weight|lora_down\.weight|lora_up\.weight|alpha|dora_scale|"
              r"hada_w[12]_[ab]|lokr_w[12]|lokr_w[12]_[ab]")
# main blocks (``blocks.N``) and, in VACE variants, VACE blocks (``vace_blocks.N``, with before_proj / after_proj)
WAN_KEY = re.compile(
    r"^diffusion_model\.(?P<stack>blocks|vace_blocks)\.(?P<block>\d+)\."
    r"(?P<module>(self_attn|cross_attn)\.[qkvo]|ffn\.[02]|before_proj|after_proj)"
    r"\.(?P<part>" + FILE_PARTS + ")$"
)


def wan_module_name(diffusers_name: str) -> str:
    """``blocks.3.attn2.to_out.0`` -> ``diffusion_model.blocks.3.cross_attn.o`` (``vace_blocks.0.proj_in`` ->
    ``diffusion_model.vace_blocks.0.before_proj``: the names ComfyUI's VACE model has)."""
    name = wan_name(diffusers_name)
    if name is None:
        raise ValueError(f"not a Wan 2.2 LoRA target: {diffusers_name}")
    return f"diffusion_model.{name}"


def lora_layers(transformer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(diffusers module name, peft layer) of every adapted module, in module order, of any adapter type."""
    yield from adapted_layers(transformer)


def live_alpha(layer: nn.Module) -> float:
    """The alpha in force now: ``scaling * r`` (covers both ``lora_alpha`` edits and ``set_scale``)."""
    return float(layer.scaling[ADAPTER_NAME]) * float(layer.r[ADAPTER_NAME])


def set_live_alpha(layer: nn.Module, alpha: float) -> None:
    adapter_type("lora").set_alpha(layer, alpha)


def wan_state_dict(transformer: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The LoRA of ``transformer`` in original Wan naming, on the CPU, with per-module ``.alpha`` scalars."""
    return adapter_state_dict(transformer, adapter_type("lora"), dtype)


def adapter_state_dict(transformer: nn.Module, kind: AdapterType, dtype: torch.dtype,
                       before_block: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """The adapter of ``transformer`` (of type ``kind``) in original Wan naming, on the CPU: its factors in
    ``dtype`` (computed in float32 first), ``alpha`` and ``dora_scale`` in float32 (``AdapterType.export``).
    ``before_block(N)`` is called before the first layer of block N is read, N counted in the order the forward
    pass runs the blocks (``swap.run_order``: a VACE transformer's VACE blocks first; block swap: DoRA reads base
    weights)."""
    out: dict[str, torch.Tensor] = {}
    order = {name: k for k, name in enumerate(run_order_names(transformer))}
    block = None
    for name, layer in lora_layers(transformer):
        key = wan_module_name(name)
        index = order.get(".".join(name.split(".")[:2]))
        if before_block is not None and index is not None and index != block:
            block = index
            before_block(block)
        for part, tensor in kind.export(layer).items():
            keep = torch.float32 if part in ("alpha", "dora_scale") else dtype
            out[f"{key}.{part}"] = tensor.to(keep).contiguous()
    return out


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file whole or not at all (``core.atomic.atomic_write``: a temporary file in the same
    folder, fsync'ed, renamed into place, the folder fsync'ed); a full disk or no permission raises a one-line
    ``StorageError`` naming ``path``."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=metadata)
        canonicalize_safetensors(tmp)  # same training, same bytes

    atomic_write(path, write, what="LoRA file", hint=SAVE_HINT)


class Wan22Saver:
    """Writes one file per trained expert into ``run_dir``. Called by the core on the training thread.

    ``writes=False``: a rank other than 0 of a sharded run (model.parallel = "fsdp"): it takes part in gathering
    the whole LoRA (every rank must, in the same order) and writes nothing."""

    def __init__(self, adapter, run_dir: Path, name: str, *, writes: bool = True) -> None:
        self.adapter = adapter
        self.run_dir = Path(run_dir)
        self.name = name
        self.writes = writes

    def file_name(self, expert: str | None, step: int, final: bool) -> str:
        stem = self.name if final else f"{self.name}_step{step:06d}"
        return f"{stem}.safetensors" if expert is None else f"{stem}_{expert}.safetensors"

    def save(self, step: int, final: bool) -> list[str]:
        return [self.write(*f) for f in self.files(step, final)]

    def files(self, step: int, final: bool) -> list[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
        """Each trained expert's file as (name in ``run_dir``, tensors, metadata), written by :meth:`write` (with
        ``model.expert_groups`` a group leader's travel to rank 0 first: ``core.parallel.expert_groups.GroupSaver``). A
        rank that does not write (``writes=False``) still gathers every expert's tensors and returns no file."""
        dtype = torch.float32 if self.adapter.lora_config.save_dtype == "fp32" else torch.bfloat16
        out = []
        for expert in self.adapter.experts:
            tensors = self.adapter.adapter_tensors(expert, dtype)
            if not self.writes:
                continue
            alphas = sorted({self.adapter.kind.alpha(layer) for _, layer in lora_layers(self.adapter.transformer_for(
                expert))})
            metadata = {
                "format": "pt",
                "wantrain_version": __version__,
                "adapter_type": self.adapter.kind.name,
                "variant": self.adapter.spec.name,
                "expert": expert or "single",
                "rank": str(self.adapter.lora_config.rank),
                "alpha": f"{alphas[0]:g}" if len(alphas) == 1 else ",".join(f"{a:g}" for a in alphas),
                "step": str(step),
                "boundary_ratio": str(self.adapter.spec.boundary_ratio),
            }
            out.append((self.file_name(expert, step, final), tensors, metadata))
        return out

    def write(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
        """Write one file of :meth:`files` into ``run_dir`` (atomically) and return its path."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / name
        atomic_save(tensors, path, metadata)
        return str(path)
