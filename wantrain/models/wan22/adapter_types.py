"""The adapter types a run trains (``lora.type``): LoRA, LoKr, LoHa and DoRA, all built by peft, and the one place
in the trainer that knows them apart (docs/models.md, "Adapter types").

Each type is an :class:`AdapterType`: the peft config it builds, its factors in a fixed order with peft's default
start (drawn here in float32 from the run's seed, so the start depends on the seed alone), the factor an alpha
change rescales to keep the output (``output_factor``), and its tensors in the LyCORIS / ComfyUI layout of one
module (``export`` / ``load``). Every type scales its update by ``alpha / rank`` in peft.

ComfyUI's loader (``comfy/weight_adapter``, facts only) applies, per module ``x`` at strength 1:

* LoRA ``x.lora_A.weight`` [r, in], ``x.lora_B.weight`` [out, r]: ``W + alpha/r * B A``;
* LoHa ``x.hada_w1_a`` [out, r], ``hada_w1_b`` [r, in], ``hada_w2_a``, ``hada_w2_b``:
  ``W + alpha/r * (w1_a w1_b) * (w2_a w2_b)`` (elementwise product; r from ``hada_w1_b``);
* LoKr ``x.lokr_w1`` (or ``lokr_w1_a`` @ ``lokr_w1_b``), ``x.lokr_w2`` (or ``lokr_w2_a`` @ ``lokr_w2_b``):
  ``W + s * kron(w1, w2)`` with ``s = alpha / r`` when a factor is decomposed, else ``s = 1`` (alpha ignored); so
  a module with two full factors is written with ``s`` folded into ``lokr_w1`` and no ``alpha``;
* DoRA: LoRA's keys plus ``x.dora_scale`` [out, 1]; with a scale on the output axis ComfyUI computes
  ``(W + alpha/r * B A) * dora_scale / (||W||_row + eps)`` (the norm of the *base* weight, eps of float32, the
  dtype it patches in), where peft trains ``(W + alpha/r * B A) * m / ||W + alpha/r * B A||_row``; the file holds
  ``dora_scale = m * (||W||_row + eps) / ||W + alpha/r * B A||_row`` so that both give the same weight.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from wantrain.core.errors import UserError
from wantrain.core.parallel.sharding import is_sharded, whole, whole_to_writer

ADAPTER_NAME = "wantrain"
ADAPTER_TYPES = ("lora", "lokr", "loha", "dora")
TYPE_TITLES = {"lora": "LoRA", "lokr": "LoKr", "loha": "LoHa", "dora": "DoRA"}
# diffusers module path inside a block -> original Wan name: the 10 Linears of every block, the modules a run adapts
DIFFUSERS_TO_WAN = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
# A VACE block (``vace_blocks.N``, WanVACETransformer3DModel) has a main block's 10 Linears plus ``proj_in`` (block
# 0 only) and ``proj_out``, which the original Wan / ComfyUI names call ``before_proj`` / ``after_proj``.
VACE_TO_WAN = {**DIFFUSERS_TO_WAN, "proj_in": "before_proj", "proj_out": "after_proj"}
_BLOCK_LINEAR = re.compile(r"^(blocks|vace_blocks)\.(\d+)\.(.+)$")
F32_EPS = float(torch.finfo(torch.float32).eps)


def _kaiming(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    fresh = torch.empty(shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
    return fresh


class AdapterType:
    """One adapter type. ``factors``: (peft attribute, start) in the order the start is drawn; ``"kaiming"`` is
    peft's Kaiming-uniform with ``a = sqrt(5)``, ``"zero"`` zeros (one zero factor per module: a fresh adapter
    changes nothing)."""

    name = "lora"
    factors: tuple[tuple[str, str], ...] = (("lora_A", "kaiming"), ("lora_B", "zero"))
    output_part = "lora_B"  # rescaled by old/new alpha to keep the output; LoRA+'s B group
    has_b = True  # LoRA+ (lora.plus_lr_ratio) applies
    reads_base = False  # the export reads the frozen base weights (DoRA)

    def peft_config(self, lora, targets: list[str]):
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(r=lora.rank, lora_alpha=lora.effective_alpha, lora_dropout=lora.dropout,
                              target_modules=targets, init_lora_weights=True)

    def is_layer(self, module: nn.Module) -> bool:
        return ADAPTER_NAME in getattr(module, "r", {}) and any(
            ADAPTER_NAME in getattr(module, part, {}) for part, _ in self.factors)

    @staticmethod
    def factor(layer: nn.Module, part: str) -> nn.Parameter | None:
        """The tensor of ``part`` (a peft attribute) in ``layer``, or None when the layer does not have it."""
        holder = getattr(layer, part, None)
        if holder is None or ADAPTER_NAME not in holder:
            return None
        value = holder[ADAPTER_NAME]
        return value.weight if isinstance(value, nn.Module) else value

    def present(self, layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(p, t) for p, _ in self.factors if (t := self.factor(layer, p)) is not None]

    def output_factor(self, layer: nn.Module) -> nn.Parameter:
        return self.factor(layer, self.output_part)

    # alpha: LoRA/DoRA keep it as ``lora_alpha``, the LyCORIS layers as ``alpha``; both scale by alpha / r
    def alpha(self, layer: nn.Module) -> float:
        return float(layer.scaling[ADAPTER_NAME]) * float(layer.r[ADAPTER_NAME])

    def set_alpha(self, layer: nn.Module, alpha: float) -> None:
        getattr(layer, "lora_alpha", getattr(layer, "alpha", None))[ADAPTER_NAME] = alpha
        scale = alpha / layer.r[ADAPTER_NAME]
        if torch.is_tensor(layer.scaling[ADAPTER_NAME]):  # compiled blocks read it as an input (compile.py)
            layer.scaling[ADAPTER_NAME].fill_(scale)
        else:
            layer.scaling[ADAPTER_NAME] = scale

    @torch.no_grad()
    def init_fp32(self, layer: nn.Module, generator: torch.Generator) -> None:
        """peft's default start of this type, drawn in float32 from ``generator``."""
        starts = dict(self.factors)
        for part, tensor in self.present(layer):
            if starts[part] == "kaiming":
                tensor.copy_(_kaiming(tensor.shape, generator))
            else:
                tensor.zero_()

    # -- the file layout of one module (LyCORIS / ComfyUI names, without the module prefix) ------------------------
    def file_part(self, part: str) -> str:
        return f"{part}.weight" if part in ("lora_A", "lora_B") else part

    @torch.no_grad()
    def export(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        """The module's tensors as ComfyUI reads them, float32 on the CPU (see the module docstring). For a save:
        under ``model.parallel = "fsdp"`` each factor is gathered to the writing rank only (every rank calls it; the
        others get ``meta`` tensors of the shapes: ``core.parallel.sharding.whole_to_writer``)."""
        out = {self.file_part(p): whole_to_writer(t, torch.float32) for p, t in self.present(layer)}
        out["alpha"] = torch.tensor(self.alpha(layer), dtype=torch.float32)
        return out

    @torch.no_grad()
    def load(self, layer: nn.Module, parts: dict[str, torch.Tensor], where: str) -> None:
        """Copy a module's file tensors (``export``'s layout) into ``layer``; refuses (one line) a file whose
        factors are laid out otherwise (another rank or factor)."""
        mine = {self.file_part(p): t for p, t in self.present(layer)}
        wanted = {k: tuple(t.shape) for k, t in mine.items()}
        given = {k: tuple(v.shape) for k, v in parts.items() if k in mine}
        if given != wanted or set(parts) - set(mine) - {"alpha", "dora_scale"}:
            raise UserError(f"{where}: the file's {TYPE_TITLES[self.name]} factors {given or sorted(parts)} do not "
                            f"fit this run's {wanted}; start from a file of the same lora.type, rank and factor")
        for key, tensor in mine.items():
            tensor.copy_(parts[key].to(torch.float32))
        self.set_alpha(layer, float(parts["alpha"]) if "alpha" in parts else float(layer.r[ADAPTER_NAME]))

    def rank_of(self, parts: dict[str, torch.Tensor]) -> int | None:
        """The rank a module's file tensors were trained at (None: the layout does not tell it)."""
        return int(parts["lora_A.weight"].shape[0])


class LoHa(AdapterType):
    name = "loha"
    factors = (("hada_w1_a", "kaiming"), ("hada_w1_b", "kaiming"), ("hada_w2_a", "kaiming"), ("hada_w2_b", "zero"))
    output_part = "hada_w2_b"
    has_b = False

    def peft_config(self, lora, targets: list[str]):
        from peft import LoHaConfig

        return LoHaConfig(r=lora.rank, alpha=lora.effective_alpha, module_dropout=lora.dropout,
                          target_modules=targets, init_weights=True)

    def rank_of(self, parts: dict[str, torch.Tensor]) -> int | None:
        return int(parts["hada_w1_b"].shape[0])


class LoKr(AdapterType):
    name = "lokr"
    factors = (("lokr_w1", "zero"), ("lokr_w1_a", "zero"), ("lokr_w1_b", "kaiming"), ("lokr_w2", "kaiming"),
               ("lokr_w2_a", "kaiming"), ("lokr_w2_b", "kaiming"))
    has_b = False

    def peft_config(self, lora, targets: list[str]):
        from peft import LoKrConfig

        return LoKrConfig(r=lora.rank, alpha=lora.effective_alpha, module_dropout=lora.dropout,
                          decompose_both=lora.lokr_decompose_both, decompose_factor=lora.lokr_factor,
                          target_modules=targets, init_weights=True)

    def output_factor(self, layer: nn.Module) -> nn.Parameter:
        return self.factor(layer, "lokr_w1") if self.factor(layer, "lokr_w1") is not None else \
            self.factor(layer, "lokr_w1_a")

    @staticmethod
    def decomposed(parts: Iterable[str]) -> bool:
        return any(p in ("lokr_w1_a", "lokr_w2_a") for p in parts)

    @torch.no_grad()
    def export(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        out = super().export(layer)
        if not self.decomposed(out):  # ComfyUI and LyCORIS ignore alpha here (scale 1): fold peft's scale in
            alpha = out.pop("alpha")
            out["lokr_w1"] = out["lokr_w1"] * (alpha / float(layer.r[ADAPTER_NAME]))
        return out

    def rank_of(self, parts: dict[str, torch.Tensor]) -> int | None:
        for key in ("lokr_w2_b", "lokr_w1_b"):
            if key in parts:
                return int(parts[key].shape[0])
        return None


def base_rows(base: nn.Module, rows: slice = slice(None), dtype: torch.dtype | None = None) -> torch.Tensor:
    """Output rows ``rows`` of the frozen ``base`` Linear's weight as its forward computes with it, in ``dtype``
    (default: that compute dtype), on the weight's device: an fp8_scaled or low-bit Linear's dequantised rows (its
    ``dequantised_rows``: only those rows are dequantised, so DoRA's row norms never hold a bf16 copy of a whole
    weight beside the codes), a layerwise-cast fp8 weight (float8 between forwards) upcast to bf16, as the cast in
    its forward does exactly, any other weight as it is."""
    dequantised_rows = getattr(base, "dequantised_rows", None)
    if dequantised_rows is not None:
        if dtype is None:
            dtype = base.bias.dtype if getattr(base, "bias", None) is not None else torch.bfloat16
        return dequantised_rows(rows, dtype)
    weight = base.weight[rows]
    if dtype is None:
        dtype = torch.bfloat16 if weight.dtype.itemsize == 1 else weight.dtype
    return weight.to(dtype)


class DoRA(AdapterType):
    name = "dora"
    reads_base = True
    factors = (("lora_A", "kaiming"), ("lora_B", "zero"), ("lora_magnitude_vector", "norm"))

    def peft_config(self, lora, targets: list[str]):
        config = super().peft_config(lora, targets)
        config.use_dora = True
        return config

    @staticmethod
    def base_weight(layer: nn.Module, *, to_writer: bool = False) -> torch.Tensor:
        """The frozen base weight in float32 on the CPU, as the forward computes with it (:func:`base_rows`: an fp8
        or low-bit Linear's dequantised weight, one Linear at a time, wherever block swap holds it). Under
        ``model.parallel = "fsdp"``: on a rank that built the model on ``meta`` (its values come from rank 0's host
        copy) an empty ``meta`` tensor; sharded, the whole weight (an all-gather: every rank calls it, in the same
        order, as the export's LoRA factors); ``to_writer`` (a save): gathered to the writing rank only, ``meta``
        elsewhere (``core.parallel.sharding.whole_to_writer``)."""
        base = layer.get_base_layer()
        if base.weight.is_meta:
            return torch.empty(base.weight.shape, dtype=torch.float32, device="meta")
        if is_sharded(base.weight):  # fsdp keeps the base bf16 (rule fsdp-memory-settings)
            return (whole_to_writer(base.weight, torch.float32) if to_writer
                    else whole(base.weight.detach()).to("cpu", torch.float32))
        return base_rows(base).detach().to("cpu", torch.float32)

    def _adapted_norm(self, layer: nn.Module, a: torch.Tensor, b: torch.Tensor, alpha: float,
                      base: torch.Tensor | None = None) -> torch.Tensor:
        """||W + alpha/r * B A|| per output row, float32 [out, 1] (``base``: W, read once by the caller)."""
        base = self.base_weight(layer) if base is None else base
        weight = base + (alpha / float(layer.r[ADAPTER_NAME])) * (b.float() @ a.float())
        return torch.linalg.norm(weight, dim=1, keepdim=True)

    @torch.no_grad()
    def init_fp32(self, layer: nn.Module, generator: torch.Generator) -> None:
        super().init_fp32(layer, generator)  # magnitude: peft's ||W||_row, computed in float32 below
        self.factor(layer, "lora_magnitude_vector").copy_(torch.linalg.norm(self.base_weight(layer), dim=1))

    @torch.no_grad()
    def export(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        out = super().export(layer)
        magnitude = out.pop("lora_magnitude_vector").view(-1, 1)
        base = self.base_weight(layer, to_writer=True)  # fsdp: gathered once, to the writing rank only
        norm = self._adapted_norm(layer, out["lora_A.weight"], out["lora_B.weight"], float(out["alpha"]), base)
        base_norm = torch.linalg.norm(base, dim=1, keepdim=True)
        out["dora_scale"] = magnitude * (base_norm + F32_EPS) / norm
        return out

    @torch.no_grad()
    def load(self, layer: nn.Module, parts: dict[str, torch.Tensor], where: str) -> None:
        if "dora_scale" not in parts:
            raise UserError(f"{where}: the file has no dora_scale; it is not a DoRA file")
        scale = parts["dora_scale"].to(torch.float32).reshape(-1, 1)
        alpha = float(parts["alpha"]) if "alpha" in parts else float(layer.r[ADAPTER_NAME])
        a, b = parts.get("lora_A.weight"), parts.get("lora_B.weight")
        if a is not None and b is not None and a.shape[0] == b.shape[1] and b.shape[0] == scale.shape[0]:
            base_norm = torch.linalg.norm(self.base_weight(layer), dim=1, keepdim=True)
            magnitude = scale * self._adapted_norm(layer, a, b, alpha) / (base_norm + F32_EPS)
            parts = {**parts, "lora_magnitude_vector": magnitude.view(-1)}
        super().load(layer, parts, where)


TYPES: dict[str, AdapterType] = {t.name: t for t in (AdapterType(), LoKr(), LoHa(), DoRA())}


def adapter_type(name: str) -> AdapterType:
    return TYPES[name]


def file_type(parts: Iterable[str]) -> str | None:
    """The adapter type of a module's file tensor names (``lora_A.weight``, ``hada_w1_a``, ...), None if unknown."""
    parts = set(parts)
    if any(p.startswith("hada_") for p in parts):
        return "loha"
    if any(p.startswith("lokr_") for p in parts):
        return "lokr"
    if "dora_scale" in parts:
        return "dora"
    if parts & {"lora_A.weight", "lora_B.weight", "lora_down.weight", "lora_up.weight"}:
        return "lora"
    return None


def adapted_layers(transformer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(diffusers module name, peft layer) of every adapted module, in module order, whatever the type."""
    for name, module in transformer.named_modules():
        if any(t.is_layer(module) for t in TYPES.values()):
            yield name, module


# -- module selection (lora.include / lora.exclude) ----------------------------------------------------------------
def wan_name(diffusers_name: str) -> str | None:
    """``blocks.3.attn2.to_out.0`` -> ``blocks.3.cross_attn.o``, ``vace_blocks.0.proj_in`` ->
    ``vace_blocks.0.before_proj``; None for a module no adapter targets."""
    match = _BLOCK_LINEAR.match(diffusers_name)
    names = VACE_TO_WAN if match is not None and match.group(1) == "vace_blocks" else DIFFUSERS_TO_WAN
    if match is None or match.group(3) not in names:
        return None
    return f"{match.group(1)}.{match.group(2)}.{names[match.group(3)]}"


def candidate_modules(num_layers: int, vace_blocks: int = 0) -> list[str]:
    """The diffusers names of the modules an adapter may target in a model of ``num_layers`` blocks and
    ``vace_blocks`` VACE blocks (``proj_in`` in VACE block 0 only, as diffusers builds them)."""
    main = [f"blocks.{i}.{m}" for i in range(num_layers) for m in DIFFUSERS_TO_WAN]
    vace = [f"vace_blocks.{i}.{m}" for i in range(vace_blocks) for m in VACE_TO_WAN if m != "proj_in" or i == 0]
    return main + vace


def select_modules(names: Iterable[str], include: Iterable[str], exclude: Iterable[str]) -> list[str]:
    """The adaptable modules among ``names`` (diffusers names) that some ``include`` pattern selects (all when
    none is given) and no ``exclude`` pattern drops. A pattern is a regular expression searched in a module's
    diffusers name (``blocks.3.attn1.to_q``) and its original Wan name (``blocks.3.self_attn.q``). Raises
    ``UserError`` (one line, with the nearest names) for a pattern that matches no module, or when nothing is left."""
    modules = [(n, w) for n in names if (w := wan_name(n)) is not None]
    include, exclude = list(include), list(exclude)
    chosen = []
    for key, patterns in (("lora.include", include), ("lora.exclude", exclude)):
        for pattern in patterns:
            regex = re.compile(pattern)
            if not any(regex.search(n) or regex.search(w) for n, w in modules):
                raise UserError(f"{key} pattern {pattern!r} matches no module of the model; nearest names: "
                                f"{', '.join(_nearest(pattern, modules)) or 'none'} (patterns are regular "
                                "expressions searched in names like blocks.0.attn1.to_q or blocks.0.self_attn.q)")
    for n, w in modules:
        hits = [bool(re.search(p, n) or re.search(p, w)) for p in (*include, *exclude)]
        if (not include or any(hits[:len(include)])) and not any(hits[len(include):]):
            chosen.append(n)
    if not chosen:
        raise UserError("lora.include / lora.exclude leave no module to adapt; loosen lora.exclude or widen "
                        "lora.include (docs/models.md, Module selection)")
    return chosen


def _nearest(pattern: str, modules: list[tuple[str, str]]) -> list[str]:
    """Module names like ``pattern`` (its regex escapes dropped): short ones (``attn1.to_q``) and whole ones."""
    short = {n.split(".", 2)[2] for n, _ in modules} | {w.split(".", 2)[2] for _, w in modules}
    whole = {n for n, _ in modules} | {w for _, w in modules}
    return difflib.get_close_matches(pattern.replace("\\", ""), sorted(short | whole), n=3, cutoff=0.3)


def check_pattern(key: str, pattern: str) -> str | None:
    """Why ``pattern`` is no regular expression (None when it is one)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"config key '{key}' = {pattern!r} is not a regular expression ({exc})"
    return None
