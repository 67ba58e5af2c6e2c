"""``wantrain caption``: a caption file for each clip of a folder, from a local vision-language model.

The model is any image-text-to-text model that transformers loads with ``AutoModelForImageTextToText`` and
``AutoProcessor`` from a folder the user downloaded (Qwen2.5-VL / Qwen3-VL instruct models, LLaVA-style models, ...),
always with ``local_files_only``: nothing is downloaded. A folder that is missing, holds no ``config.json``, or
holds a model transformers cannot load as image-text-to-text is refused in one line (``UserError``, exit 2).

Per clip, :data:`CaptionerSettings.frames` frames evenly spread over the clip (an image: itself) are shown to the
model, in order, as the images of one chat message followed by the prompt (:func:`prompt_text`: the template with
the trigger word and the style). Clips are captioned in batches (left padding, greedy decoding). The model runs in
bf16 on a GPU (float32 on the CPU), or in 4-bit or 8-bit through bitsandbytes on a CUDA GPU.

The caption written is the model's answer with whitespace collapsed; when a trigger word is given and the answer
does not contain it, ``"<trigger>, "`` is put in front, so every caption carries it. Each ``<clip>.txt`` is written
atomically as its batch finishes; a clip that has a non-empty caption file is skipped unless ``overwrite``, so an
interrupted run continues where it stopped (Ctrl-C keeps every caption written).
"""

from __future__ import annotations

import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from wantrain.core.atomic import atomic_write
from wantrain.core.errors import UserError
from wantrain.data.media import MediaError, kind_of, probe, upright

DEFAULT_TEMPLATE = ("These are {frames} frames of one video clip, in order. Describe the clip in one short paragraph "
                    "for training a video model: the subject, what it does, the camera's motion and the setting. "
                    "{trigger_hint}{style}")
"""The prompt unless ``--template`` gives another. Placeholders: ``{frames}`` (frames shown), ``{trigger}`` (the
trigger word), ``{trigger_hint}`` (``Call the main subject "<trigger>". `` or nothing), ``{style}``."""
PLACEHOLDERS = frozenset({"frames", "trigger", "trigger_hint", "style"})


@attrs.frozen
class CaptionerSettings:
    model: Path
    trigger: str = ""
    style: str = ""
    template: str = DEFAULT_TEMPLATE
    frames: int = 4  # frames shown per video clip
    batch_size: int = 4
    max_new_tokens: int = 160
    dtype: str = "auto"  # auto (bf16 on a GPU, float32 on the CPU), bf16, fp16, fp32
    quantize: str = "none"  # none, 4bit, 8bit (bitsandbytes, CUDA)
    device: str = "auto"  # auto (cuda when available), cpu, cuda, cuda:N
    max_side: int = 448  # frames are shrunk so their longer side is at most this (tokens per image)
    extension: str = ".txt"
    overwrite: bool = False


def problems(folder: Path, settings: CaptionerSettings, *, cuda: bool) -> list[str]:
    """Every reason captioning cannot start, found before the model is loaded; each one line."""
    found = []
    if not folder.is_dir():
        found.append(f"clip folder '{folder}' is not a folder (give the folder 'wantrain prepare' wrote)")
    model = settings.model
    if not model.is_dir():
        found.append(f"caption model folder '{model}' does not exist; give the folder of a downloaded image-text-to-"
                     "text model (config.json, weights and processor files, e.g. Qwen2.5-VL-7B-Instruct)")
    elif not (model / "config.json").is_file():
        found.append(f"caption model folder '{model}' has no config.json; give the folder that holds the model's "
                     "config.json, weights and processor files")
    names = {f[1] for f in string.Formatter().parse(settings.template) if f[1] is not None}
    if names - PLACEHOLDERS:
        found.append(f"caption template placeholder(s) {sorted(names - PLACEHOLDERS)}: use only "
                     f"{', '.join('{' + p + '}' for p in sorted(PLACEHOLDERS))}")
    if settings.frames < 1 or settings.batch_size < 1 or settings.max_new_tokens < 1:
        found.append("--frames, --batch-size and --max-new-tokens must each be at least 1")
    if settings.dtype not in ("auto", "bf16", "fp16", "fp32"):
        found.append(f"--dtype {settings.dtype!r}: use auto, bf16, fp16 or fp32")
    if settings.quantize not in ("none", "4bit", "8bit"):
        found.append(f"--quantize {settings.quantize!r}: use none, 4bit or 8bit")
    elif settings.quantize != "none" and not cuda:
        found.append(f"--quantize {settings.quantize} needs a CUDA GPU (bitsandbytes); use --quantize none here")
    return found


def prompt_text(settings: CaptionerSettings, frames: int) -> str:
    hint = f'Call the main subject "{settings.trigger}". ' if settings.trigger else ""
    text = settings.template.format(frames=frames, trigger=settings.trigger, trigger_hint=hint, style=settings.style)
    return " ".join(text.split())


def finish_caption(answer: str, trigger: str) -> str:
    """The caption written for a model's ``answer``: whitespace collapsed, the trigger word in front when missing."""
    text = " ".join(answer.split())
    if trigger and trigger.lower() not in text.lower():
        text = f"{trigger}, {text}" if text else trigger
    return text


def sample_frames(path: Path, count: int, max_side: int) -> list[Any]:
    """``count`` frames evenly spread over the clip (an image: itself), upright, as RGB PIL images whose longer side
    is at most ``max_side`` (a video frame is shrunk by FFmpeg's scaler while converted). Raises MediaError."""
    from PIL import Image, ImageOps

    info = probe(path)
    if info.kind == "image":
        with Image.open(path) as im:
            images = [ImageOps.exif_transpose(im).convert("RGB")]
        images[0].thumbnail((max_side, max_side))
        return images
    import av

    n = info.frames
    wanted = sorted({round(k * (n - 1) / max(1, count - 1)) for k in range(count)}) if count > 1 else [n // 2]
    images = []
    try:
        with av.open(str(path)) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted:
                    scale = min(1.0, max_side / max(frame.width, frame.height))
                    small = frame.reformat(width=max(1, round(frame.width * scale)),
                                           height=max(1, round(frame.height * scale)), format="rgb24")
                    images.append(upright(small.to_image(), info.rotation))
                if index >= wanted[-1]:
                    break
    except Exception as exc:  # noqa: BLE001 - decoders raise many types; the frames so far are what there is
        if not images:
            raise MediaError(f"cannot decode: {' '.join(str(exc).split())[:200]}") from None
    return images


def load_model(settings: CaptionerSettings, device: str):
    """The processor and model of the folder, offline. Raises UserError (one line) when they cannot be loaded."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = settings.model
    try:
        processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a folder it cannot read
        import importlib.util

        hint = ("; Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors need torchvision: pip install torchvision (the build "
                "that matches your torch)") if importlib.util.find_spec("torchvision") is None else ""
        raise UserError(f"caption model folder '{folder}': its processor cannot be loaded offline "
                        f"({_one_line(exc)}); give a complete image-text-to-text model folder{hint}") from None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        settings.dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype}
    if settings.quantize != "none":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
            if settings.quantize == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
        kwargs["device_map"] = {"": device}
    try:
        model = AutoModelForImageTextToText.from_pretrained(folder, **kwargs)
    except Exception as exc:  # noqa: BLE001 - an unknown model type, missing weights, a config of another kind
        raise UserError(f"caption model folder '{folder}' does not load as an image-text-to-text model "
                        f"({_one_line(exc)})") from None
    if settings.quantize == "none":
        model.to(device)
    model.eval()
    if getattr(processor, "tokenizer", None) is not None:
        processor.tokenizer.padding_side = "left"  # generation continues each row from its last prompt token
    return processor, model


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:240] or type(exc).__name__


@attrs.define
class CaptionSummary:
    written: list[str] = attrs.field(factory=list)
    skipped: list[str] = attrs.field(factory=list)  # had a caption already
    unreadable: list[dict[str, str]] = attrs.field(factory=list)
    empty: list[str] = attrs.field(factory=list)  # the model answered nothing and no trigger was given
    images_shown: int = 0
    seconds: float = 0.0

    def format(self) -> str:
        rate = f", {self.images_shown / self.seconds:.2f} images/s" if self.seconds and self.images_shown else ""
        lines = [f"caption: {len(self.written)} captions written, {len(self.skipped)} clips already captioned "
                 f"(kept; --overwrite redoes them){rate}"]
        lines += [f"unreadable: {u['path']}: {u['reason']}" for u in self.unreadable]
        lines += [f"empty answer, nothing written: {p}" for p in self.empty]
        return "\n".join(lines)


def clips_of(folder: Path) -> list[Path]:
    """The media under ``folder`` in path order; hidden files and folders (wantrain's own) left out."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and kind_of(p)
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def caption_folder(folder: Path, settings: CaptionerSettings, *, progress: bool = True,
                   log: Callable[[str], None] = print, loader=load_model) -> CaptionSummary:
    """Caption every clip of ``folder`` that has no caption yet (see the module docstring)."""
    import torch
    from tqdm import tqdm

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    found = problems(folder, settings, cuda=device.startswith("cuda") and torch.cuda.is_available())
    if found:
        raise UserError("; ".join(found))
    summary = CaptionSummary()
    todo = []
    for clip in clips_of(folder):
        if not settings.overwrite and _has_caption(clip.with_suffix(settings.extension)):
            summary.skipped.append(str(clip))
        else:
            todo.append(clip)
    if not todo:
        return summary
    processor, model = loader(settings, device)
    bar = tqdm(total=len(todo), unit="clip", disable=not progress, desc="caption", dynamic_ncols=True)
    start = time.perf_counter()
    try:
        for first in range(0, len(todo), settings.batch_size):
            batch = []
            for clip in todo[first:first + settings.batch_size]:
                try:
                    batch.append((clip, sample_frames(clip, settings.frames, settings.max_side)))
                except MediaError as exc:
                    summary.unreadable.append({"path": str(clip), "reason": str(exc)})
                    log(f"unreadable: {clip}: {exc}")
            if batch:
                answers = _generate(processor, model, [frames for _, frames in batch], settings, device)
                for (clip, frames), answer in zip(batch, answers, strict=True):
                    text = finish_caption(answer, settings.trigger)
                    summary.images_shown += len(frames)
                    if not text:
                        summary.empty.append(str(clip))
                        continue
                    atomic_write(clip.with_suffix(settings.extension), text + "\n", what="caption")
                    summary.written.append(str(clip))
            bar.update(min(settings.batch_size, len(todo) - first))
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"stopped (Ctrl-C): {len(summary.written)} captions written and kept; run the same "
                                "command again to caption the rest") from None
    finally:
        bar.close()
        summary.seconds = time.perf_counter() - start
    return summary


def _has_caption(path: Path) -> bool:
    return path.is_file() and bool(path.read_text(encoding="utf-8", errors="replace").strip())


def _generate(processor, model, frame_lists: list[list[Any]], settings: CaptionerSettings, device: str) -> list[str]:
    import torch

    texts = []
    for frames in frame_lists:
        content = [{"type": "image"} for _ in frames] + [{"type": "text", "text": prompt_text(settings, len(frames))}]
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True))
    inputs = processor(text=texts, images=frame_lists, padding=True, return_tensors="pt").to(device)
    for key, value in inputs.items():  # pixels in the model's dtype (bf16 on a GPU)
        if torch.is_tensor(value) and value.is_floating_point():
            inputs[key] = value.to(model.dtype)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=settings.max_new_tokens, do_sample=False)
    answers = processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return [a.strip() for a in answers]
