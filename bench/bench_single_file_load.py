"""Peak host memory while loading a single-file transformer: wantrain's streamed loader against the file size.

Writes a bf16 single file of an A14B-width transformer (d = 5120, ComfyUI keys) with a few blocks, then loads it
in a fresh process and reports that process's peak RSS above its baseline (``ru_maxrss`` after the imports)
divided by the file size. The target (issue 23.4) is <= 1.3: one copy of the model in its training dtype plus a
bounded window of the file's pages. ``--diffusers`` loads it the old way (``from_single_file`` and a cast), for
comparison.

    python bench/bench_single_file_load.py                 # 3 blocks (~2.3 GB file), wantrain's loader
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
import json, resource, sys, tempfile
import torch
from diffusers import WanTransformer3DModel
from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, transformer_kwargs
from wantrain.models.wan22.single_file import load_transformer
from wantrain.models.wan22.variants import VARIANTS

file, blocks, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kwargs = dict(transformer_kwargs(VARIANTS["t2v-a14b"]), num_layers=blocks)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if how == "wantrain":
    model = load_transformer(file, "low_noise_file", "t2v-a14b", lambda: WanTransformer3DModel(**kwargs),
                             torch.bfloat16)
else:
    with tempfile.TemporaryDirectory() as tmp:
        config = {"_class_name": "WanTransformer3DModel", **kwargs, "patch_size": list(kwargs["patch_size"])}
        open(f"{tmp}/config.json", "w").write(json.dumps(config))
        model = WanTransformer3DModel.from_single_file(file, config=tmp, local_files_only=True)
    model = cast_keeping_fp32_modules(model, torch.bfloat16)
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with torch.no_grad():  # read every byte, as the move to the GPU will (file-backed tensors count once touched)
    for t in model.state_dict().values():
        t.sum()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({"baseline_bytes": base, "loaded_bytes": loaded, "peak_bytes": peak, "model_bytes": size}))
"""


def write_file(path: Path, blocks: int) -> int:
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
    save_file(to_comfyui_keys(state), str(path))
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--diffusers", action="store_true", help="load with from_single_file instead")
    parser.add_argument("--keep", type=Path, help="write the file here and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        file = args.keep or Path(tmp) / "a14b_width.safetensors"
        size = file.stat().st_size if file.is_file() else write_file(file, args.blocks)
        how = "diffusers" if args.diffusers else "wantrain"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        done = subprocess.run([sys.executable, "-c", _CHILD, str(file), str(args.blocks), how], env=env,
                              capture_output=True, text=True, check=True)
        child = json.loads(done.stdout.strip().splitlines()[-1])
    above = child["peak_bytes"] - child["baseline_bytes"]
    print(json.dumps({"loader": how, "blocks": args.blocks, "file_gib": round(size / 2**30, 3),
                      "model_gib": round(child["model_bytes"] / 2**30, 3),
                      "rss_after_load_above_baseline_gib": round((child["loaded_bytes"] - child["baseline_bytes"])
                                                                 / 2**30, 3), "peak_rss_above_baseline_gib":
                      round(above / 2**30, 3), "peak_over_file": round(above / size, 3)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
