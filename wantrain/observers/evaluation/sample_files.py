"""The files of a round of sample videos (``samples.py``): the mp4, the latents picture, the TensorBoard strip.

* ``samples/step_000200_00.mp4``: H.264 via PyAV (yuv420p, crf 18), written atomically;
* ``samples/step_000200_00_latents.png``: latent channels 0-2 as RGB, one tile per latent frame,
  [-:data:`LATENT_RANGE`, :data:`LATENT_RANGE`] -> [0, 255] (a fixed range, so that rounds compare);
* the TensorBoard strip: the first frame (I2V), a gap of :data:`GAP` pixels, then up to :data:`STRIP_FRAMES`
  evenly spaced frames.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wantrain.core.atomic import atomic_write

STRIP_FRAMES = 8
LATENT_RANGE = 3.0
"""Latent values shown: [-3, 3] maps to [0, 255] (normalized Wan latents are mostly within +-3)."""
GAP = 4  # pixels between the first frame and the strip


def sample_path(directory: Path, step: int, index: int) -> Path:
    return Path(directory) / f"step_{step:06d}_{index:02d}.mp4"


def latents_path(directory: Path, step: int, index: int) -> Path:
    return Path(directory) / f"step_{step:06d}_{index:02d}_latents.png"


def write_video(path: Path, frames: np.ndarray, fps: float) -> None:
    """``frames`` uint8 [F, H, W, 3] -> an H.264 mp4 (yuv420p; even sides) at ``fps``, written atomically."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def encode(tmp: Path) -> None:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18"}
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)

    atomic_write(path, encode, what="sample video")  # a full disk: one line (core.atomic.StorageError)


def frame_strip(frames: np.ndarray, count: int = STRIP_FRAMES) -> np.ndarray:
    """Up to ``count`` evenly spaced frames of ``frames`` [F, H, W, 3] side by side: [H, n*W, 3]."""
    picks = np.unique(np.linspace(0, len(frames) - 1, min(count, len(frames))).round().astype(int))
    return np.concatenate([frames[i] for i in picks], axis=1)


def with_first_frame(strip: np.ndarray, image: Any) -> np.ndarray:
    """``image`` (the conditioning first frame, resized to the strip's height like the pipeline resizes it), a
    black gap of ``GAP`` pixels, then ``strip``."""
    height = strip.shape[0]
    width = round(image.width * height / image.height)
    first = np.asarray(image.convert("RGB").resize((width, height)), dtype=np.uint8)
    return np.concatenate([first, np.zeros((height, GAP, 3), np.uint8), strip], axis=1)


def latents_image(latents: torch.Tensor, height: int) -> np.ndarray:
    """Latents [1, C, f, h, w] -> uint8 [height', f*w', 3]: channels 0-2 as RGB, [-LATENT_RANGE, LATENT_RANGE]
    -> [0, 255], each latent frame scaled up (nearest) by the whole factor that brings h closest to ``height``."""
    lat = latents[0, :3].float().cpu()
    if lat.shape[0] < 3:
        lat = torch.cat([lat, lat[:1].expand(3 - lat.shape[0], *lat.shape[1:])])
    scale = max(1, round(height / lat.shape[2]))
    tiles = ((lat.clamp(-LATENT_RANGE, LATENT_RANGE) + LATENT_RANGE) * (255 / (2 * LATENT_RANGE))).round()
    tiles = tiles.to(torch.uint8).permute(1, 2, 3, 0).numpy()  # [f, h, w, 3]
    tiles = tiles.repeat(scale, axis=1).repeat(scale, axis=2)
    return np.concatenate(list(tiles), axis=1)


def to_uint8(video: np.ndarray) -> np.ndarray:
    """The pipeline's float frames in [0, 1] -> uint8, rounded like diffusers' ``numpy_to_pil``."""
    return (np.clip(video, 0.0, 1.0) * 255).round().astype(np.uint8)


def read_png(path: Path) -> np.ndarray | None:
    """An RGB picture this observer wrote (step 0's latents), or ``None`` when it is not there."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError):
        return None


def write_png(path: Path, picture: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Image.fromarray(picture).save(tmp, format="PNG"), what="sample image")
