"""Peak host memory while loading a transformer expert: wantrain's streamed loader against the loaded expert's size,
for every source dtype of the file and every storage dtype (``model.base_dtype``).

Writes a single file (ComfyUI keys) of a Wan transformer with a few blocks (or, with ``--shards N``, the original
repos' layout: a folder of N shards with an index, original Wan names), then loads it in a fresh process and reports
that process's peak RSS above its baseline (``VmHWM``, reset after the imports and the meta build) divided by the
loaded expert's bytes (in its storage dtype) and by the file size. The target (issues 23.4, 24.4, 33.4) is <= 1.3 for
every source and storage dtype: one copy of the model in its storage dtype plus a bounded window of the file's pages
and one tensor in flight.

Sources (``--source``): ``bf16``, ``fp16``, ``fp32`` (every tensor in that dtype), ``fp8`` (the blocks' Linear
weights cast to float8_e4m3fn, no scales, the rest bf16: ComfyUI's ``fp8_e4m3fn`` files) and ``fp8_scaled``
(ComfyUI's ``fp8_scaled``: those weights in float8 with a per-tensor ``scale_weight``, a ``scale_input`` and the
``scaled_fp8`` marker). Storage (``--storage``): ``bf16``, ``fp32``, ``fp8``, ``fp8_scaled``, ``int8``, ``nf4``
(bitsandbytes codes, quantised on the CPU as each weight is read; ``--quantise-after``: the whole expert loaded in
bf16 first and quantised after, as before issue 56); an fp8_scaled file with ``fp8`` storage is refused by the
loader (it would be quantised twice) and reported as such.

``--matrix`` runs every source x storage pair, one fresh process per row, on a narrower model (d = 1536, FFN 8960:
the 8-block file is 0.74 GB in bf16, 1.5 GB in fp32; a few minutes on 2 cores, < 2 GB RAM) with the file window
(``single_file._REOPEN_BYTES``) scaled by the same factor as the model: 256 MiB is to a bf16 A14B expert (26.6 GiB)
what ``--window-mib`` (default: that fraction of this model) is to the bench's. ``--markdown`` prints the rows as
a table.

    python bench/bench_single_file_load.py --matrix --markdown   # every source x storage, 8 narrow blocks
    python bench/bench_single_file_load.py                 # 3 blocks at A14B width (~2.3 GB file), bf16
    python bench/bench_single_file_load.py --storage fp8_scaled   # the same into scaled fp8
    python bench/bench_single_file_load.py --shards 3      # the same as a folder of 3 shards with an index
    python bench/bench_single_file_load.py --shards 3 --fp8
    python bench/bench_single_file_load.py --diffusers     # the same file through diffusers' from_single_file
    python bench/bench_single_file_load.py --blocks 6 --keep /tmp/a14b_6.safetensors
    python bench/bench_single_file_load.py --narrow --blocks 8 --storage int8   # quantised as it streams
    python bench/bench_single_file_load.py --narrow --blocks 8 --storage int8 --quantise-after   # before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCES = ("bf16", "fp16", "fp32", "fp8", "fp8_scaled")
STORAGES = ("bf16", "fp32", "fp8", "fp8_scaled", "int8", "nf4")
_NARROW = {"num_attention_heads": 12, "ffn_dim": 8960}  # d = 12 x 128 = 1536 (Wan 1.3B's width)
_REAL_WINDOW = 256 << 20  # single_file._REOPEN_BYTES

_CHILD = r"""
import json, sys, tempfile
import torch


def status(field):  # bytes; /proc/self/status (ru_maxrss would start from the parent's peak at fork)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

from diffusers import WanTransformer3DModel
from pathlib import Path
from wantrain.core.errors import UserError
from wantrain.models.wan22 import single_file
from wantrain.models.wan22.architecture import cast_keeping_fp32_modules
from wantrain.models.wan22.loading import fp8_stored
from wantrain.models.wan22.sharded import ShardReader
from wantrain.models.wan22.single_file import load_transformer

file, kwargs, how, storage, window = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
kwargs["patch_size"] = tuple(kwargs["patch_size"])
if window:
    single_file._REOPEN_BYTES = window
build = lambda: WanTransformer3DModel(**kwargs)
store = fp8_stored(build) if storage == "fp8" else None  # on meta, before the baseline
dtype = torch.float32 if storage == "fp32" else torch.bfloat16  # what loading.py streams each storage through
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
try:
    low_bit = storage if storage in ("int8", "nf4") else None
    if how in ("wantrain", "quantise-after"):
        reader = ShardReader(Path(file), "low_noise_file") if Path(file).is_dir() else None
        model = load_transformer(file, "low_noise_file", "t2v-a14b", build, dtype, reader=reader,
                                 store=store, fp8_scaled=storage == "fp8_scaled",
                                 low_bit=low_bit if how == "wantrain" else None)
        if low_bit and how == "quantise-after":  # before issue 56: the expert loaded in bf16, then quantised
            from wantrain.models.wan22.lowbit import to_low_bit
            model = to_low_bit(model, low_bit)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            config = {"_class_name": "WanTransformer3DModel", **kwargs, "patch_size": list(kwargs["patch_size"])}
            open(f"{tmp}/config.json", "w").write(json.dumps(config))
            model = WanTransformer3DModel.from_single_file(file, config=tmp, local_files_only=True)
        model = cast_keeping_fp32_modules(model, dtype)
except UserError as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit(0)
loaded = status("VmHWM")
with torch.no_grad():  # read every byte, as the move to the GPU will (file-backed tensors count once touched);
    for t in model.state_dict().values():  # amax of the bytes: no temporary (a uint8 sum would upcast to int64)
        t.reshape(-1).view(torch.uint8).amax()
peak = status("VmHWM")
size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({"baseline_bytes": base, "loaded_bytes": loaded, "peak_bytes": peak, "model_bytes": size}))
"""


def model_kwargs(blocks: int, narrow: bool) -> dict:
    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    return {**transformer_kwargs(VARIANTS["t2v-a14b"]), "num_layers": blocks, **(_NARROW if narrow else {})}


def _bf16_bytes(kwargs: dict) -> int:
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        return sum(t.numel() * 2 for t in WanTransformer3DModel(**kwargs).state_dict().values())


def scaled_window(kwargs: dict) -> int:
    """256 MiB times this model's size over a whole A14B expert's (both in bf16): the same share of the model."""
    return max(1 << 20, round(_REAL_WINDOW * _bf16_bytes(kwargs) / _bf16_bytes(model_kwargs(40, narrow=False))))


def _source_state(kwargs: dict, source: str) -> dict:
    """ComfyUI-keyed tensors of a random model in ``source`` (module docstring)."""
    import torch
    from diffusers import WanTransformer3DModel

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))
    from wan22_helpers import to_comfyui_keys

    with torch.device("meta"):
        meta = WanTransformer3DModel(**kwargs).state_dict()
    g = torch.Generator().manual_seed(0)
    plain = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(source, torch.bfloat16)
    out = {}
    for key, value in to_comfyui_keys(meta).items():
        tensor = (torch.randn(value.shape, generator=g) * 0.02).to(plain)
        if source in ("fp8", "fp8_scaled") and ".blocks." in key and key.endswith(".weight") and value.dim() == 2:
            if source == "fp8":
                tensor = tensor.to(torch.float8_e4m3fn)
            else:  # one scale per tensor, as ComfyUI writes them
                scale = tensor.float().abs().max() / 448.0
                tensor = (tensor.float() / scale).to(torch.float8_e4m3fn)
                stem = key[: -len(".weight")]
                out[stem + ".scale_weight"] = scale.reshape(())
                out[stem + ".scale_input"] = torch.ones(())
        out[key] = tensor
    if source == "fp8_scaled":
        out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return out


def write_file(path: Path, kwargs: dict, source: str = "bf16", shards: int = 0) -> int:
    from safetensors.torch import save_file

    state = _source_state(kwargs, source)
    if not shards:
        save_file(state, str(path))
        return path.stat().st_size
    original = {k.removeprefix("model.diffusion_model."): v for k, v in state.items()}
    del state
    path.mkdir(parents=True)
    names, weight_map = list(original), {}
    per = -(-len(names) // shards)
    for i in range(shards):  # consecutive tensors per shard, as the released folders hold them
        shard = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[i * per:(i + 1) * per]
        save_file({k: original.pop(k) for k in chunk}, str(path / shard))
        weight_map.update(dict.fromkeys(chunk, shard))
    (path / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def measure(file: Path, size: int, kwargs: dict, how: str, storage: str, window: int) -> dict:
    """One load in a fresh process: the row's figures (or ``refused`` with the loader's line)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(file), json.dumps(kwargs), how, storage, str(window)],
                          env=env, capture_output=True, text=True, check=True)
    child = json.loads(done.stdout.strip().splitlines()[-1])
    if "refused" in child:
        return {"refused": child["refused"]}
    above = child["peak_bytes"] - child["baseline_bytes"]
    return {"file_gib": round(size / 2**30, 3), "model_gib": round(child["model_bytes"] / 2**30, 3),
            "rss_after_load_above_baseline_gib": round((child["loaded_bytes"] - child["baseline_bytes"]) / 2**30, 3),
            "peak_rss_above_baseline_gib": round(above / 2**30, 3), "peak_over_file": round(above / size, 3),
            "peak_over_expert": round(above / child["model_bytes"], 3)}


def _markdown(rows: list[dict]) -> str:
    lines = ["| source | storage | file | expert | peak RSS | peak / expert |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['source']} | {r['storage']} | | | refused (quantised twice) | |")
        else:
            lines.append(f"| {r['source']} | {r['storage']} | {r['file_gib']:.2f} GiB | {r['model_gib']:.2f} GiB | "
                         f"{r['peak_rss_above_baseline_gib']:.2f} GiB | **{r['peak_over_expert']:.2f}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, help="transformer blocks (default 3; 8 with --matrix)")
    parser.add_argument("--source", choices=SOURCES, default="bf16", help="the file's dtype (module docstring)")
    parser.add_argument("--storage", choices=STORAGES, default="bf16", help="model.base_dtype to load into")
    parser.add_argument("--fp8", action="store_true", help="the same as --storage fp8")
    parser.add_argument("--matrix", action="store_true", help="every source x storage, narrow blocks, one row each")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=SOURCES, help="the sources --matrix runs")
    parser.add_argument("--narrow", action="store_true", help="d = 1536 instead of A14B's 5120 (on with --matrix)")
    parser.add_argument("--window-mib", type=float, help="the file window (default: 256 MiB; with --narrow scaled "
                        "to the model, module docstring)")
    parser.add_argument("--shards", type=int, default=0, help="write a folder of this many shards with an index")
    parser.add_argument("--diffusers", action="store_true", help="load with from_single_file instead")
    parser.add_argument("--quantise-after", action="store_true", help="int8 / nf4: load in bf16, quantise after")
    parser.add_argument("--keep", type=Path, help="write the file here and keep it (default: a temporary one)")
    parser.add_argument("--markdown", action="store_true", help="print the rows as a markdown table")
    args = parser.parse_args(argv)
    narrow = args.narrow or args.matrix
    blocks = args.blocks or (8 if args.matrix else 3)
    kwargs = {**model_kwargs(blocks, narrow), "patch_size": list(model_kwargs(blocks, narrow)["patch_size"])}
    window = (round(args.window_mib * 2**20) if args.window_mib is not None
              else scaled_window(model_kwargs(blocks, narrow)) if narrow else 0)
    how = "diffusers" if args.diffusers else "quantise-after" if args.quantise_after else "wantrain"
    pairs = ([(s, t) for s in args.sources for t in STORAGES] if args.matrix
             else [(args.source, "fp8" if args.fp8 else args.storage)])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in dict.fromkeys(s for s, _ in pairs):
            file = args.keep or Path(tmp) / (f"{source}_{'folder' if args.shards else 'file.safetensors'}")
            if file.exists():
                size = sum(f.stat().st_size for f in ([file] if file.is_file() else file.glob("*.safetensors")))
            else:
                size = write_file(file, kwargs | {"patch_size": tuple(kwargs["patch_size"])}, source, args.shards)
            for _, storage in (p for p in pairs if p[0] == source):
                row = {"loader": how, "blocks": blocks, "width": 1536 if narrow else 5120, "shards": args.shards,
                       "source": source, "storage": storage, "window_mib": round((window or _REAL_WINDOW) / 2**20, 2),
                       **measure(file, size, kwargs, how, storage, window)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if not args.keep:
                for f in [file] if file.is_file() else [*file.glob("*"), file]:
                    f.unlink() if f.is_file() else f.rmdir()
    if args.markdown:
        print(_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
