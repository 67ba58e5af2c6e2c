"""Synthetic media for the demo, the tests and the benchmark: coloured shapes moving across a plain background.

Every clip is captioned with what it shows ("a red circle moving left on a black background"). Output is a pure
function of the seed and the arguments. Videos are MPEG-4 Part 2 in .mp4 (a codec PyAV can always write).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {
    "red": (230, 40, 40), "green": (40, 200, 70), "blue": (50, 90, 240), "yellow": (240, 220, 40),
    "cyan": (40, 220, 230), "magenta": (220, 50, 220), "white": (240, 240, 240), "orange": (245, 140, 30),
}
BACKGROUNDS = {"black": (0, 0, 0), "grey": (90, 90, 90), "dark blue": (10, 20, 70)}
SHAPES = ("circle", "square")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def render(shape: str, colour: tuple[int, int, int], background: tuple[int, int, int], direction: str,
           width: int, height: int, frames: int) -> np.ndarray:
    """``uint8 [frames, height, width, 3]``: the shape crossing the frame in ``direction``."""
    size = max(4, min(width, height) // 4)
    dx, dy = DIRECTIONS[direction]
    yy, xx = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        p = t / max(1, frames - 1)  # 0 -> 1 over the clip
        cx = width / 2 + dx * (p - 0.5) * (width - size)
        cy = height / 2 + dy * (p - 0.5) * (height - size)
        if shape == "circle":
            mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= (size / 2) ** 2
        else:
            mask = (abs(xx - cx) <= size / 2) & (abs(yy - cy) <= size / 2)
        out[t] = background
        out[t][mask] = colour
    return out


def write_video(path: Path, frames: np.ndarray, fps: float, *, codec: str = "mpeg4", faststart: bool = False,
                rotation: int = 0) -> None:
    """Encode ``uint8 [F, H, W, 3]`` (even sides) at ``fps``. ``rotation`` (degrees counter-clockwise) goes into the
    container's display matrix, as phones record portrait video (-90: shown turned a quarter clockwise)."""
    import av

    rate = Fraction(fps).limit_denominator(1001)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if rotation:
            stream.set_display_rotation(rotation)
        stream.codec_context.thread_count = 1  # deterministic bytes
        stream.codec_context.options = {"qscale": "3"} if codec == "mpeg4" else {}
        for t, picture in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts = t
            frame.time_base = 1 / rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def caption_for(shape: str, colour: str, background: str, direction: str | None) -> str:
    if direction is None:
        return f"a {colour} {shape} on a {background} background"
    return f"a {colour} {shape} moving {direction} on a {background} background"


def make_demo_dataset(
    out_dir: Path | str, *, seed: int = 0, clips: int = 16, images: int = 4,
    sizes: tuple[tuple[int, int], ...] = ((64, 64), (64, 64), (96, 64), (64, 96), (80, 48)),
    frame_range: tuple[int, int] = (9, 25), fps_choices: tuple[float, ...] = (16.0,), codec: str = "mpeg4",
    prefix: str = "",
) -> list[Path]:
    """Write ``clips`` captioned videos and ``images`` captioned PNGs into ``out_dir``; returns the media paths.

    Each video draws its size from ``sizes`` (width, height), its length uniformly from ``frame_range``
    (inclusive) and its rate from ``fps_choices``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = []
    for k in range(clips + images):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        background = list(BACKGROUNDS)[int(rng.integers(len(BACKGROUNDS))) if k % 2 else 0]
        direction = list(DIRECTIONS)[int(rng.integers(len(DIRECTIONS)))]
        width, height = sizes[int(rng.integers(len(sizes)))]
        if k < clips:
            n = int(rng.integers(frame_range[0], frame_range[1] + 1))
            fps = float(fps_choices[int(rng.integers(len(fps_choices)))])
            pixels = render(shape, COLOURS[colour], BACKGROUNDS[background], direction, width, height, n)
            path = out / f"{prefix}clip_{k:03d}.mp4"
            write_video(path, pixels, fps, codec=codec)
            text = caption_for(shape, colour, background, direction)
        else:
            pixels = render(shape, COLOURS[colour], BACKGROUNDS[background], "right", width, height, 1)
            path = out / f"{prefix}image_{k - clips:03d}.png"
            Image.fromarray(pixels[0]).save(path)
            text = caption_for(shape, colour, background, None)
        path.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
        written.append(path)
    return written
