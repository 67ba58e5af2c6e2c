"""Reading LoRA files that other trainers (or earlier runs) wrote, to start a LoRA from them (``lora.init_from``).

Accepted key formats, one per file (facts: shared/reference/wan22.md §3):

* **wantrain / ComfyUI / ai-toolkit** (original Wan names): ``diffusion_model.blocks.N.self_attn.q.lora_A.weight``
  / ``lora_B.weight`` (or ``lora_down`` / ``lora_up``), optional per-module ``...self_attn.q.alpha``;
* **diffusers / peft**: ``transformer.blocks.N.attn1.to_q.lora_A.weight`` (``attn2`` cross-attention, ``to_out.0``,
  ``ffn.net.0.proj``, ``ffn.net.2``); alpha from the ``lora_adapter_metadata`` JSON when present;
* **musubi-tuner** (kohya): ``lora_unet_blocks_N_self_attn_q.lora_down.weight`` / ``lora_up.weight`` / ``alpha``.

A module without an alpha has alpha = rank (scale 1), as diffusers and ComfyUI read such files. The rank is read from
the A matrices and must be the same for every module. Refused, in one line: keys of another format or of a module
wantrain does not train (time projection, head, biases), a Wan 2.1 image branch (``k_img``, ``v_img``, ``img_emb``,
``add_k_proj``), shapes of another model (a Wan 2.1 1.3B file, a 5B file on A14B), a block past the variant's count,
and a file whose metadata or name says it is the other expert's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import torch

from wantrain.core.errors import UserError
from wantrain.models.wan22.adapter_types import TYPE_TITLES, adapter_type, file_type

# original Wan module name inside a block -> diffusers name (the inverse of export.DIFFUSERS_TO_WAN)
WAN_TO_DIFFUSERS = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}
_MUSUBI_TO_WAN = {m.replace(".", "_"): m for m in WAN_TO_DIFFUSERS}
_DOWN = {"lora_A.weight": "A", "lora_down.weight": "A", "lora_B.weight": "B", "lora_up.weight": "B", "alpha": "alpha"}
# LoRA's parts in every naming, and the LyCORIS parts of the other types (DoRA's scale, LoHa's and LoKr's factors)
_PART = (r"(?P<part>lora_A\.weight|lora_B\.weight|lora_down\.weight|lora_up\.weight|alpha|dora_scale|"
         r"hada_w[12]_[ab]|lokr_w[12]|lokr_w[12]_[ab])")
# wantrain's and ComfyUI's names; in a VACE variant also its VACE blocks (with before_proj / after_proj)
_WAN = re.compile(r"^diffusion_model\.(?P<stack>blocks|vace_blocks)\.(?P<block>\d+)\."
                  r"(?P<module>(self_attn|cross_attn)\.[qkvo]|ffn\.[02]|before_proj|after_proj)\." + _PART + "$")
_VACE_WAN_TO_DIFFUSERS = {"before_proj": "proj_in", "after_proj": "proj_out"}
_DIFFUSERS = re.compile(r"^(transformer\.)?blocks\.(?P<block>\d+)\.(?P<module>attn[12]\.(to_q|to_k|to_v|to_out\.0)|"
                        r"ffn\.net\.(0\.proj|2))\." + _PART + "$")
_MUSUBI = re.compile(r"^lora_unet_blocks_(?P<block>\d+)_(?P<module>(self_attn|cross_attn)_[qkvo]|ffn_[02])\."
                     + _PART + "$")
_WAN21_IMAGE = re.compile(r"k_img|v_img|img_emb|add_k_proj|add_v_proj|image_embedder")
_EXPERT_IN_NAME = re.compile(r"(high|low)[_\- ]?noise", re.IGNORECASE)


@attrs.frozen
class LoraFile:
    """An adapter read from a file, by diffusers module name (``blocks.3.attn1.to_q``). A LoRA's matrices are in
    ``down`` / ``up``; every other type (``adapter_type``) keeps each module's tensors by their LyCORIS names in
    ``parts`` (DoRA: also ``down`` / ``up``). ``rank`` is None for a LoKr file whose factors are all full."""

    path: Path
    key_format: str  # "wan", "diffusers", "musubi"
    rank: int | None
    down: dict[str, torch.Tensor]  # A [rank, in]
    up: dict[str, torch.Tensor]  # B [out, rank]
    alpha: dict[str, float]  # per module
    key: str = ""  # the config key that named the file
    variant: str = ""
    adapter_type: str = "lora"
    parts: dict[str, dict[str, torch.Tensor]] = attrs.field(factory=dict)  # module -> LyCORIS part -> tensor

    @property
    def modules(self) -> list[str]:
        return sorted(set(self.down) | set(self.parts))

    @property
    def alphas(self) -> list[float]:
        return sorted(set(self.alpha.values()))


FORMAT_TITLES = {"wan": "wantrain / ComfyUI / ai-toolkit (original Wan names)", "diffusers": "diffusers / peft",
                 "musubi": "musubi-tuner (kohya: lora_unet_blocks_N_...)"}
"""The key formats :func:`read_lora_file` reads, as ``inspect-lora`` and the run log name them."""


def describe(lora: LoraFile) -> dict[str, Any]:
    """What was read from a file, for ``inspect-lora`` and the run log: format, type, modules, rank, alphas."""
    return {"path": str(lora.path), "format": FORMAT_TITLES.get(lora.key_format, lora.key_format),
            "type": TYPE_TITLES.get(lora.adapter_type, lora.adapter_type), "modules": len(lora.modules),
            "rank": lora.rank, "alpha": lora.alphas}


def _module_of(key: str) -> tuple[str, str, str] | None:
    """(format, diffusers module, part) of a key, or None when no format knows it."""
    for name, pattern in (("wan", _WAN), ("diffusers", _DIFFUSERS), ("musubi", _MUSUBI)):
        match = pattern.match(key)
        if match is None:
            continue
        module = match.group("module")
        if name == "wan":
            stack = match.group("stack")
            if module in _VACE_WAN_TO_DIFFUSERS and stack != "vace_blocks":
                return None
            module = _VACE_WAN_TO_DIFFUSERS.get(module) or WAN_TO_DIFFUSERS[module]
            return name, f"{stack}.{match.group('block')}.{module}", match.group("part")
        elif name == "musubi":
            module = WAN_TO_DIFFUSERS[_MUSUBI_TO_WAN[module]]
        return name, f"blocks.{match.group('block')}.{module}", match.group("part")
    return None


def _metadata_alpha(metadata: dict[str, str]) -> float | None:
    """diffusers' ``save_lora_weights`` puts the peft config into ``lora_adapter_metadata`` (JSON)."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    for table in (data, *(v for v in data.values() if isinstance(v, dict))):
        if isinstance(table, dict) and isinstance(table.get("lora_alpha"), int | float):
            return float(table["lora_alpha"])
    return None


def read_lora_file(path: Path, *, key: str, spec: Any, expert: str | None) -> LoraFile:
    """Read and check ``path`` (config key ``key``) for ``expert`` of ``spec`` (its layers' features are checked
    later, by :func:`check_fits`). Raises ``UserError`` with one line."""
    from safetensors import SafetensorError, safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{key} '{path}' does not exist (give a LoRA .safetensors file)")
    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{key} '{path}' is not a readable safetensors file ({exc})") from None
    if not tensors:
        raise UserError(f"{key} '{path}' holds no tensors; it is not a LoRA")
    image = next((k for k in sorted(tensors) if _WAN21_IMAGE.search(k)), None)
    if image is not None:
        raise UserError(f"{key} '{path}' is a Wan 2.1 image-to-video LoRA (key {image}: the CLIP image branch Wan 2.2 "
                        f"does not have); give a LoRA trained on Wan 2.2 {spec.name}")
    _check_expert(path, key, metadata, expert)
    formats: set[str] = set()
    down: dict[str, torch.Tensor] = {}
    up: dict[str, torch.Tensor] = {}
    alpha: dict[str, float] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(tensors):
        found = _module_of(name)
        if found is None:
            raise UserError(f"{key} '{path}': key '{name}' is not a LoRA weight of a module wantrain trains (the 10 "
                            "Linears of each block: self_attn/cross_attn q, k, v, o, ffn.0, ffn.2) in the wantrain, "
                            "ComfyUI, diffusers or musubi-tuner key format")
        fmt, module, part = found
        formats.add(fmt)
        stack, block = module.split(".")[0], int(module.split(".")[1])
        count = spec.num_layers if stack == "blocks" else len(spec.vace_layers)
        if block >= count:
            what = "block" if stack == "blocks" else "VACE block"
            raise UserError(f"{key} '{path}': key '{name}' names {what} {block}, but {spec.name} has "
                            + (f"{what}s 0..{count - 1}" if count else f"no {what}s")
                            + "; is this a LoRA for another model?")
        value = tensors[name]
        parts.setdefault(module, {})[part] = value
        if part == "alpha":
            alpha[module] = float(value.float().reshape(-1)[0])
        elif part in _DOWN:
            (down if _DOWN[part] == "A" else up)[module] = value
    if len(formats) > 1:
        raise UserError(f"{key} '{path}' mixes key formats ({', '.join(sorted(formats))}); give a file of one format")
    kinds = {m: file_type(p) for m, p in parts.items()}
    if len(set(kinds.values())) > 1:
        raise UserError(f"{key} '{path}' mixes adapter types ({', '.join(sorted(map(str, set(kinds.values()))))}); "
                        "give a file of one type")
    kind = next(iter(kinds.values()))
    if kind is None:
        raise UserError(f"{key} '{path}' holds alpha values but no adapter weights")
    if kind != "lora":
        return _lycoris_file(path, key, spec, kind, formats.pop(), parts, down, up, alpha)
    lone = sorted(set(down) ^ set(up))
    if lone:
        raise UserError(f"{key} '{path}': module {lone[0]} has only one of its two LoRA matrices")
    ranks = {}
    for module, a in down.items():
        b = up[module]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise UserError(f"{key} '{path}': module {module} has LoRA shapes A {tuple(a.shape)}, B "
                            f"{tuple(b.shape)}, which do not make a LoRA (A [rank, in], B [out, rank])")
        ranks[module] = a.shape[0]
    if len(set(ranks.values())) > 1:
        raise UserError(f"{key} '{path}' has LoRA ranks {sorted(set(ranks.values()))} on different modules; "
                        "wantrain starts only from a LoRA of one rank")
    rank = next(iter(ranks.values()))
    default = _metadata_alpha(metadata)
    alpha = {m: alpha.get(m, default if default is not None else float(rank)) for m in down}
    return LoraFile(path=path, key_format=formats.pop(), rank=rank, down=down, up=up, alpha=alpha, key=key,
                    variant=spec.name)


def _lycoris_file(path: Path, key: str, spec: Any, kind: str, key_format: str, parts: dict, down: dict, up: dict,
                  alpha: dict) -> LoraFile:
    """A LoKr, LoHa or DoRA file: one rank for every module that tells it (full LoKr factors do not)."""
    handler = adapter_type(kind)
    ranks = {r for p in parts.values() if (r := handler.rank_of(p)) is not None}
    if len(ranks) > 1:
        raise UserError(f"{key} '{path}' has {TYPE_TITLES[kind]} ranks {sorted(ranks)} on different modules; "
                        "wantrain starts only from an adapter of one rank")
    rank = ranks.pop() if ranks else None
    alpha = {m: alpha.get(m, float(rank) if rank is not None else 1.0) for m in parts}
    return LoraFile(path=path, key_format=key_format, rank=rank, down=down, up=up, alpha=alpha, key=key,
                    variant=spec.name, adapter_type=kind, parts=parts)


def _full_lokr_rank(lora: LoraFile, rank: int | None) -> LoraFile:
    """A LoKr file with full factors only has no rank: peft keeps a factor full when the rank is at least half its
    larger side, so the run takes ``lora.rank`` if given, else the largest side of any ``lokr_w2``; its scale is
    folded into the weights (alpha = rank, scale 1)."""
    if rank is None:
        rank = max(max(p["lokr_w2"].shape) for p in lora.parts.values() if "lokr_w2" in p)
    return attrs.evolve(lora, rank=rank, alpha=dict.fromkeys(lora.alpha, float(rank)))


def check_fits(lora: LoraFile, shapes: dict[str, tuple[int, int]]) -> None:
    """Refuse ``lora`` when a module's matrices do not fit the layer (``shapes``: diffusers module name -> (out,
    in) features of the LoRA targets)."""
    for module, a in lora.down.items():
        out_f, in_f = shapes[module]
        b = lora.up[module]
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise UserError(
                f"{lora.key} '{lora.path}': module {module} has LoRA shapes A {tuple(a.shape)}, B {tuple(b.shape)}, "
                f"but {lora.variant}'s layer maps {in_f} -> {out_f} features; is this a LoRA for another model (Wan "
                "2.1 1.3B, the 5B, an A14B)?"
            )


def _check_expert(path: Path, key: str, metadata: dict[str, str], expert: str | None) -> None:
    """Refuse a file that says it belongs to the other expert: wantrain's ``expert`` metadata, else the file name
    (``*_high_noise*`` / ``*_low_noise*``, the convention of ai-toolkit and wantrain)."""
    said = metadata.get("expert")
    if said in ("high_noise", "low_noise", "single"):
        source = "its metadata says"
    else:
        named = {m.group(1).lower() + "_noise" for m in _EXPERT_IN_NAME.finditer(path.name)}
        said = named.pop() if len(named) == 1 else None
        source = "its file name says"
    if said is None:
        return
    want = expert or "single"
    if said == "single" or want == "single":
        if said != want:
            what = "a single-transformer model's (TI2V-5B)" if said == "single" else f"the {said} expert's"
            raise UserError(f"{key} '{path}' is {what} LoRA ({source} so); this run trains "
                            f"{'the TI2V-5B transformer' if want == 'single' else 'the ' + want + ' expert'}")
        return
    if said != want:
        raise UserError(f"{key} '{path}' is the {said} expert's LoRA ({source} {said}); this key starts the {want} "
                        f"expert: use lora.init_from_{said} for it")


INIT_KEYS = {None: "lora.init_from", "high_noise": "lora.init_from_high_noise", "low_noise": "lora.init_from_low_noise"}


def init_sources(lora: Any, model: Any) -> dict[str | None, tuple[str, Path]]:
    """The file each trained expert starts from: ``{expert: (config key, path)}`` (``lora.init_from`` for a
    single-transformer variant or a run that trains one expert; ``lora.init_from_<expert>`` per expert)."""
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[model.variant]
    experts = model.trained_experts
    out: dict[str | None, tuple[str, Path]] = {}
    per_expert = {e: getattr(lora, f"init_from_{e}") for e in ("high_noise", "low_noise")}
    if spec.boundary_ratio is None:
        for e, value in per_expert.items():
            if value is not None:
                raise UserError(f"lora.init_from_{e} applies to the two-expert A14B variants; {spec.name} has one "
                                "transformer: use lora.init_from")
        if lora.init_from is not None:
            out[None] = ("lora.init_from", Path(lora.init_from))
        return out
    if lora.init_from is not None:
        if len(experts) > 1:
            raise UserError(f"lora.init_from names one file, but this run trains both experts of {spec.name}; give "
                            "lora.init_from_high_noise and/or lora.init_from_low_noise")
        out[experts[0]] = ("lora.init_from", Path(lora.init_from))
    for e, value in per_expert.items():
        if value is None:
            continue
        if e not in experts:
            raise UserError(f"lora.init_from_{e} is set, but model.experts = {model.experts!r} does not train the "
                            f"{e} expert; remove the key or train that expert")
        if e in out:
            raise UserError(f"lora.init_from and lora.init_from_{e} both name the {e} expert's file; give one")
        out[e] = (INIT_KEYS[e], Path(value))
    return out


def resolve_init(lora: Any, model: Any) -> tuple[Any, dict[str | None, LoraFile]]:
    """Read the files the LoRA starts from and take rank and alpha from them: ``(lora with rank and alpha set,
    {expert: LoraFile})``; ``lora`` unchanged when no file is named. Refuses (one line) a ``lora.rank`` or
    ``lora.alpha`` that disagrees with the files, and two files of different ranks."""
    from wantrain.models.wan22.variants import VARIANTS

    sources = init_sources(lora, model)
    if not sources:
        return lora, {}
    spec = VARIANTS[model.variant]
    files = {e: read_lora_file(path, key=key, spec=spec, expert=e) for e, (key, path) in sources.items()}
    for f in files.values():
        if f.adapter_type != lora.type:
            raise UserError(f"{f.key} '{f.path}' is a {TYPE_TITLES[f.adapter_type]} file, but lora.type = "
                            f"'{lora.type}'; set lora.type = '{f.adapter_type}' or give a {TYPE_TITLES[lora.type]} "
                            "file")
    files = {e: _full_lokr_rank(f, lora.rank) if f.rank is None else f for e, f in files.items()}
    named = [(f"{f.key} '{f.path}'", f) for f in files.values()]
    ranks = sorted({f.rank for f in files.values()})
    if len(ranks) > 1:
        raise UserError("the LoRA files differ in rank: " + ", ".join(f"{n} has rank {f.rank}" for n, f in named)
                        + "; one run trains one rank")
    rank = ranks[0]
    if lora.rank is not None and lora.rank != rank:
        name, _ = named[0]
        raise UserError(f"lora.rank = {lora.rank} disagrees with {name}, a LoRA of rank {rank}; remove lora.rank "
                        f"(the file's rank is used) or set it to {rank}")
    alphas = sorted({a for f in files.values() for a in f.alphas})
    if lora.alpha is not None and alphas != [float(lora.alpha)]:
        name, _ = named[0]
        shown = ", ".join(f"{a:g}" for a in alphas)
        raise UserError(f"lora.alpha = {lora.alpha:g} disagrees with the LoRA file(s) (alpha {shown} in {name}); "
                        "remove lora.alpha (the file's alpha is used) or set it to the file's")
    alpha = alphas[0] if len(alphas) == 1 else lora.alpha
    return attrs.evolve(lora, rank=rank, alpha=alpha), files
