"""What the LoRA changed in a sample, shown against the run's first round (step 0, the base model's sample with the
same seed and prompt): the tiny twins' random VAE decodes every frame to noise, and a latents picture alone looks
alike at every step, since most of it is the sample's initial noise, so a person cannot tell what was learned.

* ``samples/step_000400_00_change.png``: three panels side by side -- step 0's latents picture, this step's, and
  their difference (grey = unchanged; ``CHANGE_GAIN`` x the difference, per channel), each labelled above it
  ("step 0", "step 400", "change x4"), at each round after step 0 whose step-0 picture is in ``samples/`` (a
  resumed run reads it from there too).
* ``latents_change`` in the ``samples_written`` line: RMS(this step's latents - step 0's) / RMS(step 0's), in
  latent units, read from the two pictures (their [-3, 3] range, 6/255 a level): 0 is no change, about 1.4 an
  unrelated sample of the same scale. Host arithmetic on two small PNGs; no device work.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHANGE_GAIN = 4
"""The difference panel shows 4 x (this step - step 0) around grey 128: a change of 1/4 of a latent's range is
full scale."""
GAP = 4  # white pixels between the panels


def change_path(directory: Path, step: int, index: int) -> Path:
    return Path(directory) / f"step_{step:06d}_{index:02d}_change.png"


LABEL_HEIGHT = 12  # the white strip above the panels that names them


def change_picture(first: np.ndarray, now: np.ndarray, step: int | None = None) -> np.ndarray:
    """uint8 [h, w, 3] pictures of step 0 and of now -> [step 0 | now | grey + CHANGE_GAIN x (now - step 0)], with
    a strip above naming each panel (``step`` is now's step; without it the panels are not labelled)."""
    difference = np.clip(128 + CHANGE_GAIN * (now.astype(int) - first.astype(int)), 0, 255).astype(np.uint8)
    gap = np.full((now.shape[0], GAP, 3), 255, np.uint8)
    panels = np.concatenate([first, gap, now, gap, difference], axis=1)
    if step is None:
        return panels
    from PIL import Image, ImageDraw

    strip = Image.new("RGB", (panels.shape[1], LABEL_HEIGHT), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    for i, label in enumerate(("step 0", f"step {step}", f"change x{CHANGE_GAIN}")):
        draw.text((i * (now.shape[1] + GAP) + 2, 0), label, fill=(0, 0, 0))  # PIL's built-in bitmap font
    return np.concatenate([np.asarray(strip), panels], axis=0)


def latents_change(first: np.ndarray, now: np.ndarray, value_range: float) -> float:
    """RMS(now - first) / RMS(first) in latent units, the pictures mapping [-value_range, value_range] to
    [0, 255]."""
    to_latent = 2 * value_range / 255
    before = first.astype(np.float64) * to_latent - value_range
    after = now.astype(np.float64) * to_latent - value_range
    scale = float(np.sqrt(np.mean(before ** 2)))
    return float(np.sqrt(np.mean((after - before) ** 2))) / scale if scale > 0 else 0.0
