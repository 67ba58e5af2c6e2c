"""The unit of training data: a :class:`Clip` (one clip of a video, or an image, at one bucket size), and the
:class:`MediaEncoders` protocol the model side implements."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from wantrain.data.media import RESIZE_VERSION
from wantrain.data.plan import source_index

Bucket = tuple[int, int, int]  # (width, height, frames)


@runtime_checkable
class MediaEncoders(Protocol):
    """The VAE and text encoder as the data side sees them (the model adapter implements this, lazily loading).

    ``encoder_identity`` names the exact weights and settings (it is part of every cache key). An implementation
    whose text embeddings depend on more than that (the adapter's: dtype, text length, prompt cleaning) also has a
    ``text_identity`` string, which then keys the text entries instead. Both methods return a dict of tensors whose
    dim 0 is the batch.
    """

    encoder_identity: str

    def encode_media(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """``pixels``: float32 ``[B, 3, F, H, W]`` in [-1, 1], one bucket. Returns e.g. ``{"latents": ...}``.
        Clips with control files (``data.controls``) are encoded with a second argument, ``conditions``
        (``control``, ``mask``, ``reference`` tensors stacked like ``pixels``), which an implementation that trains
        on them accepts."""
        ...

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Returns e.g. ``{"text_embeds": [B, L, D]}``."""
        ...


@attrs.define
class Clip:
    """One training sample: a clip of a video (or an image) at one bucket size."""

    path: Path
    kind: str  # "video" or "image"
    caption: str
    width: int
    height: int
    frames: int
    start: int  # first frame after retiming
    source_fps: float | None
    target_fps: float | None  # None: not retimed
    source_frames: int
    source_width: int
    source_height: int
    fingerprint: str
    cache_dir: Path
    repeats: int
    frame_buckets: tuple[int, ...] = (1,)  # of its dataset, for re-bucketing
    active: bool = True
    rotation: int = 0  # display rotation of a video, degrees counter-clockwise (``MediaInfo.rotation``)
    # every text this clip may train with (``captions.caption_texts``; ``caption`` is the first) and the share of its
    # samples trained with the empty prompt instead
    texts: tuple[str, ...] = ()
    caption_dropout: float = 0.0
    caption_file: str = ""  # the caption's own file (a sidecar), named when it changes; "" for a metadata line or none
    # control files beside the clip (``data.controls``: "control", "mask", "ref") and their content fingerprints
    controls: dict[str, Path] = attrs.field(factory=dict)
    control_fingerprints: dict[str, str] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if not self.texts:
            self.texts = (self.caption,)

    @property
    def bucket(self) -> Bucket:
        return (self.width, self.height, self.frames)

    def source_indices(self) -> list[int]:
        fps = self.source_fps or 0.0
        return [source_index(self.start + i, fps, self.target_fps) for i in range(self.frames)]

    def latent_params(self) -> dict[str, Any]:
        """Everything that shapes this clip's pixels (part of its cache key)."""
        params = {"content": self.fingerprint, "kind": self.kind, "start": self.start, "frames": self.frames,
                  "source_fps": self.source_fps, "target_fps": self.target_fps, "width": self.width,
                  "height": self.height, "resize": RESIZE_VERSION}
        if self.rotation:  # only then: the keys of every unrotated clip stay what they were
            params["rotation"] = self.rotation
        if self.control_fingerprints:  # likewise: a clip without control files keeps its key
            params["controls"] = dict(sorted(self.control_fingerprints.items()))
        return params

    @property
    def content(self) -> str:
        """The fingerprint of everything this clip's samples are made of: the medium's, with its control files'."""
        if not self.control_fingerprints:
            return self.fingerprint
        return self.fingerprint + "+" + "+".join(f"{k}:{v}" for k, v in sorted(self.control_fingerprints.items()))
