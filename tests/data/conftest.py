"""Helpers for the data tests: tiny generated media, crafted bad files, counting fake encoders."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from wantrain.data.config import DataConfig, DatasetConfig
from wantrain.data.demo import render, write_video
from wantrain.models.wan22.variants import variant_spec


def make_video(folder: Path, name: str, *, frames: int = 9, width: int = 32, height: int = 32, fps: float = 16.0,
               caption: str | None = "a red circle moving left on a black background", faststart: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.mp4"
    write_video(path, render("circle", (230, 40, 40), (0, 0, 0), "left", width, height, frames), fps,
                faststart=faststart)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def make_image(folder: Path, name: str, *, width: int = 32, height: int = 32,
               caption: str | None = "a blue square") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    Image.fromarray(render("square", (50, 90, 240), (0, 0, 0), "right", width, height, 1)[0]).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def packet_spans(path: Path) -> list[tuple[int, int]]:
    """(byte offset, size) of each video packet, in stream order."""
    with av.open(str(path)) as c:
        return [(p.pos, p.size) for p in c.demux(c.streams.video[0]) if p.size]


def make_lying_video(folder: Path, name: str, *, frames: int = 25, keep: int = 13) -> Path:
    """A video whose header (moov first, faststart) announces ``frames`` frames but whose data holds only ``keep``:
    the file is cut right after packet ``keep``, as an interrupted download leaves it."""
    path = make_video(folder, name, frames=frames, faststart=True)
    pos, size = packet_spans(path)[keep - 1]
    data = path.read_bytes()
    path.write_bytes(data[: pos + size])
    return path


def make_corrupt_tail_video(folder: Path, name: str, *, frames: int = 25, good: int = 13) -> Path:
    """A video whose packets all demux but whose packet ``good`` (0-based) is garbage: decoding stops there."""
    path = make_video(folder, name, frames=frames)
    pos, size = packet_spans(path)[good]
    data = bytearray(path.read_bytes())
    data[pos:pos + size] = bytes(size)
    path.write_bytes(bytes(data))
    return path


class CountingEncoders:
    """Fake VAE + text encoder: deterministic functions of their input, counting calls and items."""

    def __init__(self, identity: str = "fake-encoders-v1") -> None:
        self.encoder_identity = identity
        self.media_calls = 0
        self.text_calls = 0
        self.media_items = 0
        self.text_items = 0

    def encode_media(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.media_calls += 1
        self.media_items += pixels.shape[0]
        b, c, f, h, w = pixels.shape
        lat = torch.nn.functional.avg_pool3d(pixels, kernel_size=(1, 8, 8))[:, :, ::4]  # [B, 3, (F-1)/4+1, H/8, W/8]
        return {"latents": lat.contiguous()}

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        self.text_calls += 1
        self.text_items += len(captions)
        out = torch.zeros(len(captions), 4, 8)
        for i, cap in enumerate(captions):
            out[i, 0, 0] = float(len(cap))
            out[i, 1, : min(8, len(cap))] = torch.tensor([float(ord(ch)) for ch in cap[:8]])
        return {"text_embeds": out, "text_mask": torch.ones(len(captions), 4, dtype=torch.bool)}

    @property
    def calls(self) -> int:
        return self.media_calls + self.text_calls


@pytest.fixture
def tiny_spec():
    return variant_spec("tiny-t2v")


@pytest.fixture
def encoders():
    return CountingEncoders()


def data_config(path: Path, **kw) -> DataConfig:
    kw.setdefault("resolutions", [32])
    kw.setdefault("frames", [9])
    return DataConfig(path=path, **kw)


def datasets_config(*tables: dict, **kw) -> DataConfig:
    return DataConfig(datasets=[DatasetConfig(**t) for t in tables], **kw)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
