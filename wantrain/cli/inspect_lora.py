"""``wantrain inspect-lora FILE``: what an adapter file holds, and whether every key is a Wan 2.2 module name.

Prints the adapter type (LoRA, LoKr, LoHa or DoRA, from the keys), the variant, expert, step and wantrain version
from the metadata, then rank and alpha per module group (self_attn, cross_attn, ffn). Every key must be
``diffusion_model.blocks.N.<module>.<part>`` with module one of ``self_attn.{q,k,v,o}``, ``cross_attn.{q,k,v,o}``,
``ffn.{0,2}`` and part ``lora_A.weight``, ``lora_B.weight`` (or ``lora_down``/``lora_up``), ``alpha``,
``dora_scale``, ``hada_w{1,2}_{a,b}``, ``lokr_w{1,2}`` or ``lokr_w{1,2}_{a,b}``; N must be below the variant's block
count when the metadata names the variant; every module must hold the whole set of its type's factors, and all
modules one type. The first problem stops the check with a ``UserError`` (exit code 2). A file in another format
``lora.init_from`` reads (musubi-tuner's ``lora_unet_blocks_N_...``, diffusers' ``transformer.blocks.N...``) is read
as the run reads it, and the format is named.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from wantrain.core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="LoRA file (.safetensors) written by wantrain or another Wan 2.2 trainer")


def _group(module: str) -> str:
    return module.split(".")[0]


def inspect(path: Path) -> list[str]:
    """The report lines for ``path``; raises ``UserError`` for a missing/unreadable file or a bad key."""
    from safetensors import SafetensorError, safe_open

    from wantrain.models.wan22.adapter_types import TYPE_TITLES, file_type
    from wantrain.models.wan22.export import WAN_KEY
    from wantrain.models.wan22.lora_files import FORMAT_TITLES
    from wantrain.models.wan22.variants import VARIANTS

    path = Path(path)
    _refuse_checkpoint(path)
    if not path.is_file():
        raise UserError(f"LoRA file '{path}' does not exist or is not a file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            keys = list(handle.keys())
            shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in keys}
            alphas = {k: float(handle.get_tensor(k).float().item()) for k in keys if k.endswith(".alpha")}
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"'{path}' is not a readable safetensors file ({exc})") from None
    if not keys:
        raise UserError(f"'{path}' holds no tensors; it is not a LoRA")
    variant = metadata.get("variant")
    spec = VARIANTS.get(variant) if variant else None
    counts = {"blocks": spec.num_layers, "vace_blocks": len(spec.vace_layers)} if spec is not None else None
    ranks: dict[str, set[int]] = defaultdict(set)
    group_alphas: dict[str, set[float]] = defaultdict(set)
    modules: set[str] = set()
    parts: dict[str, set[str]] = defaultdict(set)
    if not any(WAN_KEY.match(k) for k in keys):  # musubi-tuner's or diffusers' keys: read as lora.init_from reads
        return _other_format(path, metadata)
    for key in sorted(keys):
        match = WAN_KEY.match(key)
        if match is None:
            raise UserError(
                f"'{path}': key '{key}' is not a Wan 2.2 adapter key (expected diffusion_model.blocks.N."
                "{self_attn,cross_attn}.{q,k,v,o} or ffn.{0,2}, or in a VACE variant diffusion_model.vace_blocks.N. "
                "with those or before_proj/after_proj, with .lora_A.weight/.lora_B.weight/.alpha, "
                ".dora_scale, .hada_w1_a ... or .lokr_w1 ...)"
            )
        block, stack = int(match.group("block")), match.group("stack")
        if counts is not None and block >= counts[stack]:
            what = "block" if stack == "blocks" else "VACE block"
            has = f"{what}s 0..{counts[stack] - 1}" if counts[stack] else f"no {what}s"
            raise UserError(f"'{path}': key '{key}' names {what} {block}, but {variant} has {has}")
        module = f"{match.group('module')}"
        name = f"{block}.{module}" if stack == "blocks" else f"vace.{block}.{module}"
        modules.add(name)
        part = match.group("part")
        parts[name].add(part)
        if part in ("lora_A.weight", "lora_down.weight", "hada_w1_b", "lokr_w2_b"):
            ranks[_group(module)].add(shapes[key][0])
        elif part == "alpha":
            group_alphas[_group(module)].add(alphas[key])
    kinds = {m: file_type(p) for m, p in parts.items()}
    if len(set(kinds.values())) > 1:
        raise UserError(f"'{path}' mixes adapter types ({', '.join(sorted(map(str, set(kinds.values()))))}); "
                        "a file holds one")
    kind = next(iter(kinds.values()))
    for module, have in sorted(parts.items()):
        missing = _missing_parts(kind, have)
        if missing:
            raise UserError(f"'{path}': module {module} lacks {', '.join(missing)} of its "
                            f"{TYPE_TITLES.get(kind, 'adapter')} factors; the file is incomplete")
    lines = [
        f"file: {path}",
        f"type: {TYPE_TITLES.get(kind, 'none (alpha only)')}" + (
            " (factors full: alpha does not apply, the scale is in lokr_w1)" if kind == "lokr" and not ranks else ""),
        f"format: {FORMAT_TITLES['wan']}",
        f"variant: {metadata.get('variant', 'unknown')}",
        f"expert: {metadata.get('expert', 'unknown')}",
        f"step: {metadata.get('step', 'unknown')}",
        f"wantrain version: {metadata.get('wantrain_version', 'unknown')}",
        f"modules: {len(modules)} ({len(keys)} tensors)",
    ]

    def fmt(values: set) -> str:
        return ", ".join(f"{v:g}" for v in sorted(values)) if values else "none (loaders use alpha = rank)"

    for group in ("self_attn", "cross_attn", "ffn", "before_proj", "after_proj"):
        if group in ranks or group in group_alphas:
            lines.append(f"{group}: rank {fmt(ranks[group])}, alpha {fmt(group_alphas[group])}")
    vace = sum(name.startswith("vace.") for name in modules)
    if vace:
        lines.append(f"VACE blocks: {vace} of the modules")
    lines.append("keys: all valid Wan 2.2 module names")
    return lines


def _other_format(path: Path, metadata: dict[str, str]) -> list[str]:
    """A file in another key format ``lora.init_from`` reads (musubi-tuner, diffusers): read as the run reads it
    (``lora_files.read_lora_file``: its refusals, one line), checked against the variant its metadata names, else
    the A14B's block count."""
    from wantrain.models.wan22.lora_files import describe, read_lora_file
    from wantrain.models.wan22.variants import VARIANTS, variant_spec

    variant = metadata.get("variant") if metadata.get("variant") in VARIANTS else None
    lora = read_lora_file(path, key="inspect-lora", spec=variant_spec(variant or "t2v-a14b"), expert=None)
    found = describe(lora)
    groups: dict[str, set[float]] = defaultdict(set)
    for module, alpha in lora.alpha.items():
        groups["self_attn" if ".attn1." in module else "cross_attn" if ".attn2." in module else "ffn"].add(alpha)
    lines = [f"file: {path}", f"type: {found['type']}", f"format: {found['format']}",
             f"variant: {metadata.get('variant', 'unknown')}", f"expert: {metadata.get('expert', 'unknown')}",
             f"modules: {found['modules']}"]
    for group in ("self_attn", "cross_attn", "ffn"):
        if group in groups:
            lines.append(f"{group}: rank {lora.rank}, alpha {', '.join(f'{a:g}' for a in sorted(groups[group]))}")
    lines.append("keys: all valid (read as lora.init_from reads them; wantrain's own files use the original Wan "
                 "names)")
    return lines


def _refuse_checkpoint(path: Path) -> None:
    """A resumable checkpoint (``checkpoints/step_N/`` or its ``tensors.safetensors``) is no LoRA file: say so and
    name the run's LoRA files, which are what a loader (and this command) reads."""
    from wantrain.core.checkpoint import STATE_FILE, TENSOR_FILE

    folder = path if path.is_dir() else path.parent
    if not ((folder / STATE_FILE).is_file() and (folder / TENSOR_FILE).is_file()):
        return
    run_dir = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent
    loras = sorted(str(p) for p in run_dir.glob("*.safetensors"))
    where = (f"inspect one of the run's LoRA files: {', '.join(loras[:4])}{' ...' if len(loras) > 4 else ''}"
             if loras else f"the run's LoRA files (<name>_high_noise.safetensors, ...) go into '{run_dir}'")
    raise UserError(f"'{path}' is a resumable checkpoint (state.json and tensors.safetensors, for --resume), not a "
                    f"LoRA file; {where}")


def _missing_parts(kind: str | None, have: set[str]) -> list[str]:
    """The factors a module of type ``kind`` needs that ``have`` lacks (ComfyUI's loader needs them all)."""
    if kind == "lokr":
        return [f"lokr_{w} or lokr_{w}_a/_b" for w in ("w1", "w2")
                if f"lokr_{w}" not in have and not {f"lokr_{w}_a", f"lokr_{w}_b"} <= have]
    need = {"loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
            "dora": ("lora_A.weight|lora_down.weight", "lora_B.weight|lora_up.weight", "dora_scale"),
            "lora": ("lora_A.weight|lora_down.weight", "lora_B.weight|lora_up.weight")}.get(kind, ())
    return [n.split("|")[0] for n in need if not set(n.split("|")) & have]


def run(args: argparse.Namespace) -> int:
    for line in inspect(Path(args.file)):
        print(line)
    return 0
