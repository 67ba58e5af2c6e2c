"""What the quickstart's sample latents pictures show: each round's change from step 0 and its distance from the
training clip whose caption is the prompt (its cached latents), in latent units, read from the pictures.

Not a test. Run a quickstart first, then point this at its run directory (the clip's cache is looked up under the
run's ``data.path``):

    wantrain run examples/quickstart.toml --max-steps 120 --set sample.every=60
    python bench/measure_sample_latents.py runs/<run>

Prints one JSON line per round: ``latents_change`` (as the run log's), ``rms_to_target`` and the mean change in
uint8 levels.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors import safe_open

from wantrain.observers.evaluation.latents_change import latents_change
from wantrain.observers.evaluation.samples import LATENT_RANGE, latents_image


def target_latents(data: Path, prompt: str):
    """The cached latents of the clip whose caption is ``prompt``."""
    caption = next(p for p in data.glob("*.txt") if p.read_text(encoding="utf-8").strip() == prompt)
    for cached in (data / ".wantrain_cache" / "latents").glob("*.safetensors"):
        with safe_open(str(cached), "pt") as f:
            if Path(f.metadata()["path"]).stem == caption.stem:
                return f.get_tensor("latents")
    raise SystemExit(f"no cached latents of {caption.stem} under {data}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    config = tomllib.loads((args.run_dir / "config.toml").read_text(encoding="utf-8"))
    prompt = config["sample"]["prompts"][0]
    prompt = prompt if isinstance(prompt, str) else prompt["prompt"]
    pictures = {int(p.name[5:11]): np.asarray(Image.open(p).convert("RGB"))
                for p in sorted((args.run_dir / "samples").glob("step_*_00_latents.png"))}
    first = pictures[0]
    target = latents_image(target_latents(Path(config["data"]["path"]), prompt)[None], first.shape[0])
    unit = 2 * LATENT_RANGE / 255
    for step, picture in pictures.items():
        print(json.dumps({
            "step": step, "latents_change": round(latents_change(first, picture, LATENT_RANGE), 3),
            "rms_to_target": round(float(np.sqrt(np.mean(((picture.astype(float) - target) * unit) ** 2))), 3),
            "mean_level_change": round(float(np.abs(picture.astype(int) - first).mean()), 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
