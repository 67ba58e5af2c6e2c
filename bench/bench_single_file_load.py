"""Peak host memory while loading a transformer expert: wantrain's streamed loader against the file and the
loaded expert's size.

Writes a bf16 single file of an A14B-width transformer (d = 5120, ComfyUI keys) with a few blocks (or, with
``--shards N``, the original repos' layout: a folder of N shards with an index, original Wan names), then loads it
in a fresh process and reports that process's peak RSS above its baseline (``VmHWM``, reset after the imports)
divided by the file size and by the loaded expert's bytes (in its storage dtype). The targets (issues 23.4, 24.4)
are <= 1.3: one copy of the model in its storage dtype plus a bounded window of the file's pages. ``--fp8`` loads
into ``model.base_dtype = "fp8"`` storage (the block Linears in float8, streamed straight into it). ``--diffusers``
loads the single file the old way (``from_single_file`` and a cast), for comparison.

    python bench/bench_single_file_load.py                 # 3 blocks (~2.3 GB file), wantrain's loader
    python bench/bench_single_file_load.py --shards 3      # the same as a folder of 3 shards with an index
    python bench/bench_single_file_load.py --shards 3 --fp8
    python bench/bench_single_file_load.py --diffusers     # the same file through diffusers' from_single_file
    python bench/bench_single_file_load.py --blocks 6 --keep /tmp/a14b_6.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, sys, tempfile
import torch


def status(field):  # bytes; /proc/self/status (ru_maxrss would start from the parent's peak at fork)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

from diffusers import WanTransformer3DModel
from pathlib import Path
from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, transformer_kwargs
from wantrain.models.wan22.loading import fp8_stored
from wantrain.models.wan22.sharded import ShardReader
from wantrain.models.wan22.single_file import load_transformer
from wantrain.models.wan22.variants import VARIANTS

file, blocks, how, fp8 = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "fp8"
kwargs = dict(transformer_kwargs(VARIANTS["t2v-a14b"]), num_layers=blocks)
build = lambda: WanTransformer3DModel(**kwargs)
store = fp8_stored(build) if fp8 else None  # on meta, before the baseline
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
if how == "wantrain":
    reader = ShardReader(Path(file), "low_noise_file") if Path(file).is_dir() else None
    model = load_transformer(file, "low_noise_file", "t2v-a14b", build, torch.bfloat16, reader=reader,
                             store=store)
else:
    with tempfile.TemporaryDirectory() as tmp:
        config = {"_class_name": "WanTransformer3DModel", **kwargs, "patch_size": list(kwargs["patch_size"])}
        open(f"{tmp}/config.json", "w").write(json.dumps(config))
        model = WanTransformer3DModel.from_single_file(file, config=tmp, local_files_only=True)
    model = cast_keeping_fp32_modules(model, torch.bfloat16)
loaded = status("VmHWM")
with torch.no_grad():  # read every byte, as the move to the GPU will (file-backed tensors count once touched)
    for t in model.state_dict().values():
        (t.view(torch.uint8) if t.element_size() == 1 else t).sum()
peak = status("VmHWM")
size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({"baseline_bytes": base, "loaded_bytes": loaded, "peak_bytes": peak, "model_bytes": size}))
"""


def write_file(path: Path, blocks: int, shards: int = 0) -> int:
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))
    from wan22_helpers import to_comfyui_keys

    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = dict(transformer_kwargs(VARIANTS["t2v-a14b"]), num_layers=blocks)
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in WanTransformer3DModel(**kwargs).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, (s, _) in shapes.items()}
    if not shards:
        save_file(to_comfyui_keys(state), str(path))
        return path.stat().st_size
    original = {k.removeprefix("model.diffusion_model."): v for k, v in to_comfyui_keys(state).items()}
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--shards", type=int, default=0, help="write a folder of this many shards with an index")
    parser.add_argument("--fp8", action="store_true", help="load into fp8 storage (model.base_dtype = 'fp8')")
    parser.add_argument("--diffusers", action="store_true", help="load with from_single_file instead")
    parser.add_argument("--keep", type=Path, help="write the file here and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        file = args.keep or Path(tmp) / ("a14b_width" if args.shards else "a14b_width.safetensors")
        if file.exists():
            size = sum(f.stat().st_size for f in ([file] if file.is_file() else file.glob("*.safetensors")))
        else:
            size = write_file(file, args.blocks, args.shards)
        how = "diffusers" if args.diffusers else "wantrain"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        done = subprocess.run([sys.executable, "-c", _CHILD, str(file), str(args.blocks), how,
                               "fp8" if args.fp8 else "bf16"], env=env, capture_output=True, text=True, check=True)
        child = json.loads(done.stdout.strip().splitlines()[-1])
    above = child["peak_bytes"] - child["baseline_bytes"]
    print(json.dumps({"loader": how, "blocks": args.blocks, "shards": args.shards,
                      "storage": "fp8" if args.fp8 else "bf16", "file_gib": round(size / 2**30, 3),
                      "model_gib": round(child["model_bytes"] / 2**30, 3),
                      "rss_after_load_above_baseline_gib": round((child["loaded_bytes"] - child["baseline_bytes"])
                                                                 / 2**30, 3), "peak_rss_above_baseline_gib":
                      round(above / 2**30, 3), "peak_over_file": round(above / size, 3),
                      "peak_over_expert": round(above / child["model_bytes"], 3)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
