"""Reading media: probe (cheap facts), decode (pixels), fingerprint (cache identity), resize-to-cover + centre-crop.

Videos are read with PyAV, images with Pillow. Pixels stay ``uint8`` until a batch is assembled.

Probing a video never trusts the container's frame count alone: it demuxes the stream and counts the packets that
carry data, which catches truncated files whose header still announces every frame. It decodes only the first
frame, for the display rotation (phone videos), which decoding then applies to every frame, as images honour
EXIF orientation. Decoding
then verifies: a decode that ends early (a corrupt packet, a short file) returns what it got and says so, and the
caller re-buckets or skips the clip. Nothing here raises on bad media except :class:`MediaError`, whose message is
the reason shown in the report.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import attrs
import numpy as np
from PIL import Image, ImageOps

VIDEO_EXTENSIONS = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v"})
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})

_EXIF_ORIENTATION = 0x0112
_ROTATION_PACKETS = 32  # packets to feed the decoder for the first frame (its reorder delay) before giving up
RESIZE_VERSION = "cover-centre-crop/pil-bicubic-antialias/v1"  # part of every latent cache key


class MediaError(Exception):
    """A medium that cannot be used; ``str(err)`` is the reason for the report."""


@attrs.frozen
class MediaInfo:
    """What a probe learnt. ``frames`` is the count found by demuxing (1 for images); ``container_frames`` is what
    the container header claims (0 when it does not say)."""

    kind: str  # "video" or "image"
    width: int  # as displayed (after the rotation)
    height: int
    frames: int
    fps: float | None
    container_frames: int
    rotation: int = 0  # videos: counter-clockwise quarter turns x 90 that show a frame upright (0, 90, 180, 270)


def kind_of(path: Path) -> str | None:
    ext = path.suffix.lower()
    if ext in VIDEO_EXTENSIONS:
        return "video"
    if ext in IMAGE_EXTENSIONS:
        return "image"
    return None


def fingerprint(path: Path, block: int = 65536) -> str:
    """Cheap content identity: size, mtime (ns) and SHA-256 of three sampled blocks (start, middle, end)."""
    st = path.stat()
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with path.open("rb") as fh:
        for offset in sorted({0, max(0, st.st_size // 2 - block // 2), max(0, st.st_size - block)}):
            fh.seek(offset)
            h.update(fh.read(block))
    return h.hexdigest()[:32]


def probe(path: Path) -> MediaInfo:
    """Facts about one medium without decoding it (images: header + integrity check). Raises MediaError."""
    kind = kind_of(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise MediaError(f"cannot read file: {exc.strerror or exc}") from None
    if size == 0:
        raise MediaError("empty file (0 bytes)")
    if kind == "image":
        return _probe_image(path)
    if kind == "video":
        return _probe_video(path)
    raise MediaError(f"not a supported media type ({path.suffix or 'no extension'})")


def _probe_image(path: Path) -> MediaInfo:
    try:
        with Image.open(path) as im:
            im.verify()  # checks structure (PNG CRCs, ...) without a full decode; must come right after open
        with Image.open(path) as im:
            width, height = im.size
            if im.getexif().get(_EXIF_ORIENTATION) in (5, 6, 7, 8):  # shown rotated by 90 degrees
                width, height = height, width
    except Exception as exc:  # Pillow raises many types for bad files
        raise MediaError(f"unreadable image: {_one_line(exc)}") from None
    return MediaInfo(kind="image", width=width, height=height, frames=1, fps=None, container_frames=1)


def _probe_video(path: Path) -> MediaInfo:
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError("no video stream found (truncated, or not a video)")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            fps = float(rate) if rate else None
            container_frames = int(stream.frames or 0)
            counted = 0
            rotation = None
            try:
                for packet in container.demux(stream):
                    if packet.size:
                        counted += 1
                    if rotation is None and counted <= _ROTATION_PACKETS:
                        rotation = _first_frame_rotation(packet)
            except av.error.FFmpegError:
                pass  # a truncated file ends the demux early; the packets so far are what there is
    except MediaError:
        raise
    except Exception as exc:  # av.error.*, IndexError from a broken index, ...
        raise MediaError(f"cannot open as video: {_one_line(exc)}") from None
    if counted == 0:
        raise MediaError("video stream holds no frames (truncated or corrupt)")
    if not width or not height:
        raise MediaError("video stream has no frame size")
    if fps is None or fps <= 0:
        raise MediaError("video stream has no frame rate")
    rotation = rotation or 0
    if rotation in (90, 270):
        width, height = height, width
    return MediaInfo(kind="video", width=width, height=height, frames=counted, fps=fps,
                     container_frames=container_frames, rotation=rotation)


def _first_frame_rotation(packet) -> int | None:
    """The display rotation of the first frame ``packet`` decodes to (None when it gives no frame yet). The display
    matrix is container side data that only decoded frames carry in PyAV; one frame is decoded per video."""
    import av

    try:
        for frame in packet.decode():
            return quarter_turns(frame.rotation)
    except av.error.FFmpegError:
        return 0  # undecodable: decoding verifies the clip later; shown as stored
    return None


def quarter_turns(degrees: float) -> int:
    """A display rotation (degrees counter-clockwise, as ``VideoFrame.rotation`` reads the display matrix) rounded
    to the nearest quarter turn: 0, 90, 180 or 270. Phones store portrait video as landscape frames with -90."""
    return round(degrees / 90) % 4 * 90


def upright(image: Image.Image, rotation: int) -> Image.Image:
    """``image`` rotated ``rotation`` degrees counter-clockwise (a multiple of 90), as players show it."""
    turns = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}
    return image.transpose(turns[rotation]) if rotation in turns else image


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


def cover_geometry(src_w: int, src_h: int, dst_w: int, dst_h: int) -> tuple[int, int, int, int]:
    """Resize-to-cover size and crop offset: ``(resized_w, resized_h, left, top)``. Both resized sides are >= the
    target, one of them equal (up to rounding)."""
    scale = max(dst_w / src_w, dst_h / src_h)
    rw = max(dst_w, round(src_w * scale))
    rh = max(dst_h, round(src_h * scale))
    return rw, rh, (rw - dst_w) // 2, (rh - dst_h) // 2


def cropped_fraction(src_w: int, src_h: int, dst_w: int, dst_h: int) -> float:
    """Share of the resized picture cut away by the centre crop."""
    rw, rh, _, _ = cover_geometry(src_w, src_h, dst_w, dst_h)
    return 1.0 - (dst_w * dst_h) / (rw * rh)


def fit(image: Image.Image, dst_w: int, dst_h: int) -> np.ndarray:
    """Resize ``image`` to cover ``dst_w`` x ``dst_h`` and centre-crop: ``uint8 [H, W, 3]``."""
    rw, rh, left, top = cover_geometry(image.width, image.height, dst_w, dst_h)
    if (rw, rh) != image.size:
        image = image.resize((rw, rh), Image.Resampling.BICUBIC, reducing_gap=None)
    return np.asarray(image.crop((left, top, left + dst_w, top + dst_h)), dtype=np.uint8)


def load_image(path: Path, dst_w: int, dst_h: int) -> np.ndarray:
    """One image as ``uint8 [1, H, W, 3]`` (transparency composited on white). Raises MediaError."""
    try:
        with Image.open(path) as im:
            im.load()
            im = ImageOps.exif_transpose(im)  # camera orientation, as viewers show it
            if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
                rgba = im.convert("RGBA")
                im = Image.new("RGB", rgba.size, (255, 255, 255))
                im.paste(rgba, mask=rgba.getchannel("A"))
            else:
                im = im.convert("RGB")
    except Exception as exc:
        raise MediaError(f"unreadable image: {_one_line(exc)}") from None
    return fit(im, dst_w, dst_h)[None]


@attrs.frozen
class Decoded:
    """Frames decoded for a clip. ``complete`` is False when the video ended (or broke) before the last needed
    frame; then ``available`` is the number of frames the file really yields and ``frames`` is None."""

    frames: np.ndarray | None  # uint8 [F, H, W, 3]
    complete: bool
    available: int
    error: str | None = None


def decode_video(path: Path, source_indices: list[int], dst_w: int, dst_h: int, rotation: int = 0) -> Decoded:
    """Decode the source frames ``source_indices`` (non-decreasing; repeats allowed) sequentially, stopping after
    the last one, each turned upright (``rotation``, from the probe), resized to cover and centre-cropped. Never
    raises for bad media."""
    import av

    want = source_indices
    last = want[-1]
    out: list[np.ndarray | None] = [None] * len(want)
    pos = 0  # next entry of ``want`` to fill
    index = -1
    error = None
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                index += 1
                if index < want[pos]:
                    continue
                picture = fit(upright(frame.to_image(), rotation), dst_w, dst_h)
                while pos < len(want) and want[pos] == index:
                    out[pos] = picture
                    pos += 1
                if index >= last:
                    break
    except Exception as exc:  # a corrupt packet: the frames before it are what the file holds
        error = _one_line(exc)
    if pos < len(want):
        return Decoded(frames=None, complete=False, available=index + 1, error=error)
    return Decoded(frames=np.stack(out), complete=True, available=index + 1, error=None)


def read_caption(path: Path) -> str:
    """Caption text, whitespace (line breaks included) collapsed. Raises MediaError when the file is not UTF-8."""
    return " ".join(read_caption_text(path).split())


def read_caption_text(path: Path) -> str:
    """A caption file's text as written (line breaks kept). Raises MediaError when the file is not UTF-8."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MediaError(f"caption {path.name} is not UTF-8 text (byte {exc.start})") from None


def file_stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns
