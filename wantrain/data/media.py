"""Reading media: probe (cheap facts), decode (pixels), fingerprint (cache identity), resize-to-cover + centre-crop.

Videos are read with PyAV, images with Pillow. Pixels stay ``uint8`` until a batch is assembled. A video frame is
scaled to its cover size by FFmpeg's scaler while it is converted to RGB (``VideoFrame.reformat``), so a 16K source
never becomes a full-size RGB picture; images are resized with Pillow. High-bit-depth images (16-bit grayscale
PNG/TIFF, 32-bit integer or float ones) are scaled to 8 bits, not clipped.

Size limit: a source larger than :data:`MAX_SOURCE_PIXELS` (16K UHD, 15360 x 8640) is skipped by the probe with a
reason, images and videos alike; Pillow's own decompression-bomb check never prints its warning.

Probing a video never trusts the container's frame count alone: it demuxes the stream and counts the packets that
carry data, which catches truncated files whose header still announces every frame. It decodes only the first
frame, for the display rotation (phone videos), which decoding then applies to every frame, as images honour
EXIF orientation. Decoding
then verifies: a decode that ends early (a corrupt packet, a short file) returns what it got and says so, and the
caller re-buckets or skips the clip. Nothing here raises on bad media except :class:`MediaError`, whose message is
the reason shown in the report.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from pathlib import Path

import attrs
import numpy as np
from PIL import Image, ImageOps, features

VIDEO_EXTENSIONS = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v"})
# every still format Pillow reads here (animated GIF/WebP/AVIF: the first frame); AVIF needs Pillow's AVIF plug-in
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
                             | ({".avif"} if features.check("avif") else set()))
MAX_SOURCE_PIXELS = 15360 * 8640
"""Largest source (width x height, as stored) the pipeline decodes: 16K UHD, 132.7 megapixels. Larger ones are
skipped with a reason (docs/data.md): a bigger frame costs the decoder more memory than training one clip."""

_EXIF_ORIENTATION = 0x0112
_ROTATION_PACKETS = 32  # packets to feed the decoder for the first frame (its reorder delay) before giving up
RESIZE_VERSION = "cover-centre-crop/pil-bicubic-antialias+swscale-bicubic/v2"  # part of every latent cache key


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


@contextlib.contextmanager
def _pillow_quiet():
    """Pillow's decompression-bomb check as an error, not a printed warning: :data:`MAX_SOURCE_PIXELS` decides."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def _too_large(width: int, height: int) -> str | None:
    if width * height <= MAX_SOURCE_PIXELS:
        return None
    return (f"source is {width}x{height} ({width * height / 1e6:.1f} megapixels), above the "
            f"{MAX_SOURCE_PIXELS / 1e6:.1f} megapixel limit (16K UHD); downscale it first (docs/data.md)")


def _probe_image(path: Path) -> MediaInfo:
    try:
        with _pillow_quiet():
            with Image.open(path) as im:
                width, height = im.size
                too_large = _too_large(width, height)
                if too_large is None:
                    im.verify()  # checks structure (PNG CRCs, ...) without a full decode; must come right after open
            if too_large is not None:
                raise MediaError(too_large)
            with Image.open(path) as im:
                if im.getexif().get(_EXIF_ORIENTATION) in (5, 6, 7, 8):  # shown rotated by 90 degrees
                    width, height = height, width
    except MediaError:
        raise
    except Image.DecompressionBombError:  # beyond Pillow's own hard limit: the size is not even readable
        raise MediaError(f"image is larger than Pillow opens ({2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} megapixels), "
                         f"above the {MAX_SOURCE_PIXELS / 1e6:.1f} megapixel limit; downscale it first") from None
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
    too_large = _too_large(width, height)
    if too_large is not None:
        raise MediaError(too_large)
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


def to_8bit(image: Image.Image) -> Image.Image:
    """``image`` with 8 bits per channel: 16-bit grayscale (``I;16*``) and 32-bit integer (``I``, 16-bit PNGs in
    some Pillow versions) keep their top 8 bits of the 16-bit range; float (``F``) maps 0..1 to 0..255. Pillow's
    own ``convert("RGB")`` clips these modes at 255, which turns a 16-bit picture white."""
    if image.mode.startswith("I;16") or image.mode == "I":
        values = np.asarray(image).astype(np.int64)
        return Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8), "L")
    if image.mode == "F":
        values = np.asarray(image, dtype=np.float64)
        return Image.fromarray(np.round(np.clip(values, 0.0, 1.0) * 255).astype(np.uint8), "L")
    return image


def load_image(path: Path, dst_w: int, dst_h: int) -> np.ndarray:
    """One image as ``uint8 [1, H, W, 3]`` (transparency composited on white; high bit depths scaled to 8 bits,
    :func:`to_8bit`). Raises MediaError."""
    try:
        with _pillow_quiet(), Image.open(path) as im:
            im.load()
            im = to_8bit(ImageOps.exif_transpose(im))  # camera orientation, as viewers show it
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
                picture = fit_frame(frame, dst_w, dst_h, rotation)
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


def fit_frame(frame, dst_w: int, dst_h: int, rotation: int = 0) -> np.ndarray:
    """A decoded ``av.VideoFrame`` turned upright, resized to cover ``dst_w`` x ``dst_h`` and centre-cropped:
    ``uint8 [H, W, 3]``. FFmpeg's scaler resizes (bicubic, filter widened when it shrinks) while it converts to RGB,
    so nothing of the source's size is allocated in RGB."""
    turned = rotation in (90, 270)
    shown_w, shown_h = (frame.height, frame.width) if turned else (frame.width, frame.height)
    rw, rh, left, top = cover_geometry(shown_w, shown_h, dst_w, dst_h)
    pixels = frame.reformat(width=rh if turned else rw, height=rw if turned else rh, format="rgb24",
                            interpolation="BICUBIC").to_ndarray()
    if rotation in (90, 180, 270):
        pixels = np.rot90(pixels, k=rotation // 90)  # counter-clockwise, as :func:`upright` turns images
    return np.ascontiguousarray(pixels[top:top + dst_h, left:left + dst_w])


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
