"""An endless, seeded stream of bucketed batches, decoded, encoded and cached on first use.

Captions: each sample trains with one of its clip's texts, or with the empty prompt (``caption_dropout``), drawn from
the run seed and the plan position (``wantrain.data.captions``); every text is in the text cache before training.

Decode-time verification: when a video yields fewer frames than planned, the clip is re-bucketed to the longest
frame bucket that still fits (from the next epoch on) or skipped; either way it is logged and appended to
``report.verification``, the real count is remembered in the cache folder's ``verified.json``, and training goes
on. A batch whose clips all fail is simply not yielded.

Performance: decoding and encoding happen in the caller's thread when a batch is first needed (uncached); run
``wantrain cache`` first to keep them out of the training loop.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from wantrain.core.errors import UserError
from wantrain.data import cache as cachelib
from wantrain.data.captions import CAPTION_STREAM, EMPTY, batch_draws, draw
from wantrain.data.clips import Bucket, Clip, MediaEncoders
from wantrain.data.controls import load_conditions
from wantrain.data.media import MediaError, decode_video, load_image
from wantrain.data.plan import pick_frame_bucket, retimed_count
from wantrain.data.regroup import regroup, remaining_samples, tail_from_state, tail_state
from wantrain.data.report import BucketRow, PreflightReport

log = structlog.get_logger("wantrain.data")


class TrainingData:
    """Bucketed clips and the batches they make. Built by :func:`build_dataset`.

    ``steps_per_epoch`` counts the micro-batches of the first epoch; with ``remainder = "carry"`` a later epoch may
    hold one more batch per bucket (the carried samples), so epochs average ``samples / batch_size`` per bucket.

    Under torchrun (:meth:`shard`) the plan is made of global batches of ``batch_size x ranks`` samples from one
    bucket, the same plan on every rank, and each rank trains its own ``batch_size`` of each (:meth:`rank_share`);
    its batches carry ``"global_draws"``: (their positions in the global batch, its size) (:meth:`global_draws`).
    """

    def __init__(self, clips: list[Clip], report: PreflightReport, *, batch_size: int, remainder: str,
                 shuffle: bool, seed: int, spec: Any, draw_captions: bool = True) -> None:
        self.clips = clips
        self.report = report
        self.batch_size = batch_size
        self.remainder = remainder
        self.shuffle = shuffle
        self.seed = seed
        self.spec = spec
        self.draw_captions = draw_captions  # False (validation): every sample uses its clip's first text
        self.steps_per_epoch = 0
        self.rank, self.ranks = 0, 1
        self._dirs: list[Path] | None = None
        self._caption_dirs: dict[str, Path] | None = None
        self._refresh_report()

    # ---- planning -------------------------------------------------------------------------------------------
    @property
    def plan_batch_size(self) -> int:
        """Samples per plan entry: the global batch, ``batch_size`` on each of the ``ranks``."""
        return self.batch_size * self.ranks

    def shard(self, rank: int, ranks: int) -> None:
        """Train as rank ``rank`` of ``ranks`` data-parallel processes (call before streaming)."""
        self.rank, self.ranks = rank, ranks
        self._refresh_report()

    def rank_share(self, idx: list[Any]) -> list[Any]:
        """This rank's part of the global batch ``idx``: the ``rank``-th contiguous slice of ``batch_size``. A short
        global batch (the end of a bucket) is split evenly, samples repeated from its start so that every rank has
        one: the ranks always step together."""
        if self.ranks == 1:
            return idx
        per = -(-len(idx) // self.ranks)
        padded = [idx[i % len(idx)] for i in range(per * self.ranks)]
        return padded[self.rank * per:(self.rank + 1) * per]

    def global_draws(self, size: int, share: list[Any], kept: list[str]) -> tuple[tuple[int, ...], int]:
        """Where this rank's samples sit in the global batch of ``size`` samples, for the model's random draws
        (``global_draws`` of a batch: the model draws the timesteps and noise of the whole global batch and keeps
        these rows, so N ranks draw what one process with the global batch draws). ``share`` is
        :meth:`rank_share`'s part, ``kept`` the paths of the samples that made it into the batch (a clip that failed
        to decode or was re-bucketed drops out; its position is skipped, matching by path in order). A sample
        repeated to pad a short global batch takes its original's position, so it draws what the original draws:
        the ranks' mean gradient is then the one-process gradient of the short batch."""
        per = -(-size // self.ranks)
        positions: list[int] = []
        for offset, (i, _) in enumerate(share):
            if len(positions) < len(kept) and str(self.clips[i].path) == kept[len(positions)]:
                positions.append((self.rank * per + offset) % size)
        return tuple(positions), size

    def rows(self, size: int) -> list[tuple[int, int, bool]]:
        """(rank, position in the global batch, padded) of every row of a global batch of ``size`` samples, rank by
        rank: :meth:`rank_share`'s split, whose repeated samples (``padded``) only keep the ranks in step."""
        per = -(-size // self.ranks)
        return [(r, (r * per + o) % size, r * per + o >= size) for r in range(self.ranks) for o in range(per)]

    def trained_samples(self, samples: list[tuple[int, str]]) -> tuple[tuple[int, str, int, int], ...]:
        """What a global batch of ``samples`` trains, rank by rank: (rank, clip path, first frame, frames) of each
        row that is not padding (the event log's ``BatchDrawn``)."""
        out = []
        for rank, position, padded in self.rows(len(samples)):
            if not padded:
                clip = self.clips[samples[position][0]]
                out.append((rank, str(clip.path), int(clip.start), int(clip.frames)))
        return tuple(out)

    def row_weights(self, size: int, share: list[Any], kept: list[str]) -> tuple[float, ...] | None:
        """Each kept row's weight in this rank's loss when the global batch of ``size`` is padded (None when it is
        not): a repeated row 0, a real one ``ranks / size``, so the mean over the ranks of their weighted sums is
        the mean over the ``size`` samples -- each sample once, as one process trains the short batch."""
        per = -(-size // self.ranks)
        if self.ranks == 1 or per * self.ranks == size:
            return None
        weights: list[float] = []
        for offset, (i, _) in enumerate(share):
            if len(weights) < len(kept) and str(self.clips[i].path) == kept[len(weights)]:
                weights.append(0.0 if self.rank * per + offset >= size else self.ranks / size)
        return tuple(weights)

    def _members(self) -> dict[Bucket, list[int]]:
        """Clip indices per bucket, each repeated ``repeats`` times; active clips only; buckets sorted."""
        members: dict[Bucket, list[int]] = {}
        for i, c in enumerate(self.clips):
            if c.active:
                members.setdefault(c.bucket, []).extend([i] * c.repeats)
        return dict(sorted(members.items()))

    def _carries(self, n: int) -> bool:
        return self.remainder == "carry" and n >= self.plan_batch_size

    def _refresh_report(self) -> None:
        rows = []
        steps = 0
        bs = self.plan_batch_size
        for key, entries in self._members().items():
            n = len(entries)
            batches = n // bs if self._carries(n) else math.ceil(n / bs)
            rows.append(BucketRow(width=key[0], height=key[1], frames=key[2], clips=len(set(entries)), samples=n,
                                  batches=batches, remainder=n % bs))
            steps += batches
        self.report.buckets = rows
        self.report.steps_per_epoch = self.steps_per_epoch = steps

    def _epoch(self, epoch: int, carry: dict[Bucket, list[int]],
               plan_batch: int | None = None) -> tuple[list[tuple[Bucket, list[int]]], dict]:
        rng = np.random.default_rng(_epoch_seed(self.seed, epoch))
        bs = plan_batch or self.plan_batch_size
        out: list[tuple[Bucket, list[int]]] = []
        new_carry: dict[Bucket, list[int]] = {}
        for key, entries in self._members().items():
            fresh = [entries[j] for j in rng.permutation(len(entries))] if self.shuffle else list(entries)
            if not (self.remainder == "carry" and len(entries) >= bs):
                fresh = _separate_repeats(fresh, bs)
                out.extend((key, fresh[i:i + bs]) for i in range(0, len(fresh), bs))
                continue
            prev = [i for i in carry.get(key, []) if self.clips[i].active and self.clips[i].bucket == key]
            queue = _separate_repeats(prev + fresh, bs, fixed=len(prev))
            full = len(queue) // bs
            out.extend((key, queue[k * bs:(k + 1) * bs]) for k in range(full))
            new_carry[key] = queue[full * bs:]
        if self.shuffle:
            out = [out[j] for j in rng.permutation(len(out))]
        return out, new_carry

    def _usable_epoch(self, epoch: int, carry: dict[Bucket, list[int]]) -> tuple[list[tuple[Bucket, list[int]]], dict]:
        batches, next_carry = self._epoch(epoch, carry)
        if not batches:
            raise UserError("no usable sample left: every clip failed to decode (see the report's verification list)")
        return batches, next_carry

    def micro_batches_per_epoch(self, epochs: int) -> list[int]:
        """Plan entries (micro-batches; global batches under torchrun) of each of the first ``epochs`` epochs, read
        off the plan itself: with ``remainder = "carry"`` a later epoch may hold one more batch per bucket than the
        first. Decodes nothing."""
        out: list[int] = []
        carry: dict[Bucket, list[int]] = {}
        for epoch in range(epochs):
            batches, carry = self._usable_epoch(epoch, carry)
            out.append(len(batches))
        return out

    def plan(self) -> Iterator[tuple[int, Bucket, list[int]]]:
        """Endless ``(epoch, bucket, clip indices)``; reflects re-bucketing from the next epoch on."""
        carry: dict[Bucket, list[int]] = {}
        epoch = 0
        while True:
            batches, carry = self._usable_epoch(epoch, carry)
            for key, idx in batches:
                yield epoch, key, idx
            epoch += 1

    # ---- batches ----------------------------------------------------------------------------------------------
    def batches(self, encoders: MediaEncoders | None = None, *, cache: bool = True,
                start_batch: int = 0) -> Iterator[dict[str, Any]]:
        """Endless batches, deterministic from the seed; ``start_batch`` skips that many without decoding (resume).

        ``encoders`` None: ``{"pixels": float32 [B, 3, F, H, W] in [-1, 1], "captions": [...]}``. Otherwise the
        encoders' outputs stacked on dim 0 (from the cache when ``cache``; missing entries are encoded and written
        on first use). Every batch also has ``"bucket": (w, h, frames)``, ``"paths"`` and ``"captions"``.
        """
        stream = self.stream(encoders, cache=cache)
        stream.seek(start_batch)
        yield from stream

    def stream(self, encoders: MediaEncoders | None = None, *, cache: bool = True,
               pin_memory: bool = False) -> BatchStream:
        """Endless batches with a resumable position (what ``wantrain run`` trains on). ``pin_memory``: every
        tensor of a batch in page-locked host memory, so that its copy to a CUDA device does not block the host
        (the loop asks for it when it trains on CUDA)."""
        return BatchStream(self, encoders, cache=cache, pin_memory=pin_memory)

    def sample_texts(self, epoch: int, index: int, idx: list[int]) -> list[str]:
        """The text each sample of plan entry (epoch, index) trains with (``idx``: the global batch's clips):
        the empty prompt with its clip's ``caption_dropout``, else one of the clip's texts; a pure function of the
        run seed and the position (``captions.batch_draws``)."""
        if not self.draw_captions:
            return [self.clips[i].caption for i in idx]
        coins, picks = batch_draws(self.seed, epoch, index, len(idx))
        return [draw(self.clips[i].texts, self.clips[i].caption_dropout, float(coin), float(pick))
                for i, coin, pick in zip(idx, coins, picks, strict=True)]

    def _batch_for(self, key: Bucket, samples: list[tuple[int, str]], encoders: MediaEncoders | None,
                   cache: bool) -> dict[str, Any] | None:
        """The batch of ``samples`` (clip index, text) that are still in bucket ``key``."""
        members = [(i, t) for i, t in samples if self.clips[i].active and self.clips[i].bucket == key]
        if not members:
            return None
        if encoders is None:
            return self._pixel_batch(members, key, cache)
        return self._encoded_batch(members, key, encoders, cache, None)

    def fingerprint(self) -> str:
        """A hash of the clip list (paths and start frames, in order): the data position of a checkpoint refers to
        clips by index, so it is only valid for the same list."""
        h = hashlib.sha256()
        for c in self.clips:
            h.update(f"{c.path}\0{c.start}\0{c.repeats}\n".encode())
        return h.hexdigest()[:16]

    def _pixel_batch(self, members: list[tuple[int, str]], key: Bucket, cache: bool) -> dict[str, Any] | None:
        """Raw pixels; with control files ``"conditions"`` too, of the roles the first clip has (a clip with other
        roles waits for another batch: the conditions stack)."""
        loaded = [(i, t, self._load_pixels(i, remember=False)) for i, t in members]
        loaded = [(i, t, px, self._load_conditions(i)) for i, t, px in loaded if px is not None]
        loaded = [(i, t, px, c) for i, t, px, c in loaded if c is not None]
        loaded = [entry for entry in loaded if sorted(entry[3]) == sorted(loaded[0][3])]
        if not loaded:
            return None
        batch = {"pixels": torch.stack([px for _, _, px, _ in loaded]), "captions": [t for _, t, _, _ in loaded],
                 "bucket": key, "paths": [str(self.clips[i].path) for i, _, _, _ in loaded]}
        if loaded[0][3]:
            batch["conditions"] = {r: torch.stack([c[r] for *_, c in loaded]) for r in loaded[0][3]}
        return batch

    def _encoded_batch(self, members: list[tuple[int, str]], key: Bucket, encoders: MediaEncoders, cache: bool,
                       stats: Counter | None) -> dict[str, Any] | None:
        media = self._media_entries([i for i, _ in members], encoders, cache, stats)
        kept = [(i, t, m) for (i, t), m in zip(members, media, strict=True) if m is not None]
        if not kept:
            return None
        captions = [t for _, t, _ in kept]
        texts = self._text_entries(captions, encoders, cache, stats)
        batch: dict[str, Any] = {}
        for part in ([m for _, _, m in kept], texts):
            for k in part[0]:
                if k in batch:
                    raise TypeError(f"encode_media and encode_text both returned {k!r}; keys must differ")
                batch[k] = torch.stack([p[k] for p in part])
        batch.update({"captions": captions, "bucket": key, "paths": [str(self.clips[i].path) for i, _, _ in kept]})
        return batch

    def _media_entries(self, members: list[int], encoders: MediaEncoders, cache: bool,
                       stats: Counter | None) -> list[dict[str, torch.Tensor] | None]:
        ident = encoders.encoder_identity
        out: list[dict[str, torch.Tensor] | None] = [None] * len(members)
        paths = [cachelib.entry_path(self.clips[i].cache_dir, "latents",
                                     cachelib.latent_key(self.clips[i].latent_params(), ident)) for i in members]
        if cache:
            out = [cachelib.load_entry(p) for p in paths]
        missing = [j for j, e in enumerate(out) if e is None]
        if stats is not None:
            stats["latents_hit"] += len(members) - len(missing)
        if not missing:
            return out
        key = self.clips[members[missing[0]]].bucket
        groups: dict[tuple[str, ...], list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]]] = {}
        for j in missing:
            px = self._load_pixels(members[j], remember=cache)
            conditions = self._load_conditions(members[j]) if px is not None else None
            if conditions is None:
                px = None
            if px is not None and self.clips[members[j]].bucket == key:  # re-bucketed clips wait for their bucket
                groups.setdefault(tuple(sorted(conditions)), []).append((j, px, conditions))
            elif stats is not None and px is None:
                stats["clips_failed"] += 1
        # clips with the same control files encode together (a reference image adds a latent frame)
        for roles, group in groups.items():
            self._encode_group(group, roles, members, paths, out, encoders, cache, stats)
        return out

    def _encode_group(self, group: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]], roles: tuple[str, ...],
                      members: list[int], paths: list[Path], out: list, encoders: MediaEncoders, cache: bool,
                      stats: Counter | None) -> None:
        ident = encoders.encoder_identity
        decoded = [j for j, _, _ in group]
        pixels = torch.stack([px for _, px, _ in group])
        if roles:
            conditions = {r: torch.stack([c[r] for _, _, c in group]) for r in roles}
            media = encoders.encode_media(pixels, conditions)  # type: ignore[call-arg]
        else:
            media = encoders.encode_media(pixels)
        encoded = cachelib.split_batch(media, len(decoded), "encode_media")
        for j, entry in zip(decoded, encoded, strict=True):
            entry = {k: v.detach().to("cpu").clone() for k, v in entry.items()}
            c = self.clips[members[j]]
            if cache:
                cachelib.save_entry(paths[j], entry, {"path": str(c.path), "bucket": "x".join(map(str, c.bucket)),
                                                      "start": str(c.start), "encoder": ident})
            out[j] = entry
        if stats is not None:
            stats["latents_encoded"] += len(decoded)

    def _text_entries(self, captions: list[str], encoders: MediaEncoders, cache: bool,
                      stats: Counter | None) -> list[dict[str, torch.Tensor]]:
        ident = cachelib.text_identity(encoders)
        unique = list(dict.fromkeys(captions))
        found: dict[str, dict[str, torch.Tensor]] = {}
        if cache:
            for cap in unique:
                entry = cachelib.load_entry(
                    cachelib.entry_path(self._caption_dir(cap), "text", cachelib.text_key(cap, ident)))
                if entry is not None:
                    found[cap] = entry
        missing = [cap for cap in unique if cap not in found]
        if stats is not None:
            stats["texts_hit"] += len(unique) - len(missing)
            stats["texts_encoded"] += len(missing)
        if missing:
            encoded = cachelib.split_batch(encoders.encode_text(missing), len(missing), "encode_text")
            for cap, entry in zip(missing, encoded, strict=True):
                entry = {k: v.detach().to("cpu").clone() for k, v in entry.items()}
                if cache:
                    cache_dir = self._caption_dir(cap)
                    cachelib.save_entry(cachelib.entry_path(cache_dir, "text", cachelib.text_key(cap, ident)), entry,
                                        {"caption": cap[:500], "encoder": ident})
                found[cap] = entry
        return [found[cap] for cap in captions]

    def _cache_dirs(self) -> list[Path]:
        if self._dirs is None:
            self._dirs = list(dict.fromkeys(c.cache_dir for c in self.clips))
        return self._dirs

    def _caption_dir(self, caption: str) -> Path:
        """Text entries live in the cache folder of the first clip with that text (the empty prompt of dropped
        captions: the first clip with ``caption_dropout``)."""
        if self._caption_dirs is None:
            self._caption_dirs = {}
            for c in self.clips:
                for text in c.texts:
                    self._caption_dirs.setdefault(text, c.cache_dir)
                if c.caption_dropout:
                    self._caption_dirs.setdefault(EMPTY, c.cache_dir)
        return self._caption_dirs.get(caption, self.clips[0].cache_dir)

    def texts(self) -> list[str]:
        """Every distinct text training may use, in clip order: the texts of the active clips, and the empty prompt
        when one of them has ``caption_dropout``. Each is encoded once into the text cache."""
        out: dict[str, None] = {}
        for c in self.clips:
            if c.active:
                out.update(dict.fromkeys(c.texts))
                if c.caption_dropout:
                    out[EMPTY] = None
        return list(out)

    # ---- decoding and verification -------------------------------------------------------------------------
    def first_frame(self, i: int, width: int, height: int) -> np.ndarray:
        """The first frame clip ``i`` trains on, upright, resized to cover ``width`` x ``height`` and
        centre-cropped like its training pixels: ``uint8 [H, W, 3]``. Raises ``MediaError`` when it cannot be
        read (an I2V sample's first frame when the prompt has no image)."""
        c = self.clips[i]
        if c.kind == "image":
            return load_image(c.path, width, height)[0]
        decoded = decode_video(c.path, c.source_indices()[:1], width, height, c.rotation)
        if decoded.frames is None:
            raise MediaError(f"cannot decode the first frame of '{c.path}' ({decoded.error or 'no frames'})")
        return decoded.frames[0]

    def sample_inputs(self, i: int, width: int, height: int, frames: int) -> dict[str, np.ndarray]:
        """What a sample conditioned on clip ``i`` takes from it, at ``width`` x ``height`` (covered and cropped like
        its training pixels), uint8: ``frames`` [F, H, W, 3] (the clip's first ``frames`` frames, fewer when it is
        shorter), and each control file it has: ``control`` / ``mask`` [F, H, W, 3], ``ref`` [1, H, W, 3]. Raises
        ``MediaError`` when a file cannot be read."""
        c = self.clips[i]
        indices = c.source_indices()[:frames] if c.kind == "video" else [0]
        out: dict[str, np.ndarray] = {}
        for role, path in [("frames", c.path), *sorted(c.controls.items())]:
            if role == "ref" or (role == "frames" and c.kind == "image"):
                out[role] = load_image(path, width, height)
                continue
            decoded = decode_video(path, indices, width, height, c.rotation)
            if decoded.frames is None:
                raise MediaError(f"cannot decode '{path}' for a sample ({decoded.error or 'no frames'})")
            out[role] = decoded.frames
        return out

    def _load_pixels(self, i: int, *, remember: bool) -> torch.Tensor | None:
        """Clip ``i`` as float32 ``[3, F, H, W]`` in [-1, 1]; None (after re-bucketing or skipping it) on failure."""
        c = self.clips[i]
        if c.kind == "image":
            try:
                arr = load_image(c.path, c.width, c.height)
            except MediaError as exc:
                self._disable(i, "skipped", str(exc))
                return None
        else:
            try:
                decoded = decode_video(c.path, c.source_indices(), c.width, c.height, c.rotation)
            except OSError as exc:  # the file vanished since the probe
                self._disable(i, "skipped", f"cannot read file: {exc}")
                return None
            if not decoded.complete:
                self._verification_failed(i, decoded.available, decoded.error, remember)
                return None
            arr = decoded.frames
        px = torch.from_numpy(np.require(arr, requirements=["C", "W"])).permute(3, 0, 1, 2).float()
        return px.div_(127.5).sub_(1.0)

    def _load_conditions(self, i: int) -> dict[str, torch.Tensor] | None:
        """Clip ``i``'s control files as the encoders take them (``controls.load_conditions``): ``{}`` without
        any; None (the clip skipped, as a clip that cannot be decoded) when one cannot be read."""
        c = self.clips[i]
        if not c.controls:
            return {}
        indices = c.source_indices() if c.kind == "video" else [0]
        try:
            return load_conditions(c.controls, indices, c.width, c.height, c.rotation)
        except (MediaError, OSError) as exc:
            self._disable(i, "skipped", str(exc))
            return None

    def _disable(self, i: int, action: str, reason: str) -> None:
        c = self.clips[i]
        c.active = False
        self.report.verification.append({"path": str(c.path), "bucket": list(c.bucket), "start": c.start,
                                         "action": action, "reason": reason})
        log.warning("data.clip_skipped", path=str(c.path), reason=reason)
        self._refresh_report()

    def _verification_failed(self, i: int, available_source: int, error: str | None, remember: bool) -> None:
        c = self.clips[i]
        why = f"decoding stopped after {available_source} of {c.source_frames} frames"
        if error:
            why += f": {error}"
        if remember:
            cachelib.write_verified(c.cache_dir, c.fingerprint, available_source)
        available = retimed_count(available_source, c.source_fps or 0.0, c.target_fps) - c.start
        length = pick_frame_bucket(available, [b for b in c.frame_buckets if b < c.frames])
        if length is None:
            self._disable(i, "skipped", why + "; too short for any frame bucket")
            return
        old = c.bucket
        c.frames = length
        self.report.verification.append({"path": str(c.path), "bucket": list(old), "start": c.start,
                                         "action": f"re-bucketed to {c.width}x{c.height}x{length}", "reason": why})
        log.warning("data.clip_rebucketed", path=str(c.path), frames_from=old[2], frames_to=length, reason=why)
        self._refresh_report()

    def verify_all(self) -> int:
        """Decode every clip once (``wantrain check --verify``); returns how many failed verification."""
        before = len(self.report.verification)
        for i in range(len(self.clips)):
            while self.clips[i].active and self._load_pixels(i, remember=False) is None:
                pass  # re-bucketed: verify the shorter clip too
        return len(self.report.verification) - before

    # ---- cache filling (wantrain cache) ------------------------------------------------------------------------
    def fill_cache(self, encoders: MediaEncoders, *, remove_orphans: bool = True) -> cachelib.CacheStats:
        stats: Counter = Counter()
        done: set[int] = set()
        while True:
            pending: dict[Bucket, list[int]] = {}
            for i, c in enumerate(self.clips):
                if c.active and (i, c.bucket) not in done:
                    pending.setdefault(c.bucket, []).append(i)
            if not pending:
                break
            for key, idx in sorted(pending.items()):
                for s in range(0, len(idx), self.batch_size):
                    chunk = idx[s:s + self.batch_size]
                    done.update((i, key) for i in chunk)
                    self._media_entries(chunk, encoders, True, stats)
        # every text once (a caption shared by many clips is one entry), the empty prompt included when dropped
        texts = self.texts()
        for s in range(0, len(texts), self.batch_size):
            self._text_entries(texts[s:s + self.batch_size], encoders, True, stats)
        ident = encoders.encoder_identity
        expected: dict[Path, set[Path]] = {d: set() for d in self._cache_dirs()}
        for c in self.clips:
            if c.active:
                expected[c.cache_dir].add(cachelib.entry_path(
                    c.cache_dir, "latents", cachelib.latent_key(c.latent_params(), ident)))
        for cap in texts:
            d = self._caption_dir(cap)
            expected[d].add(cachelib.entry_path(d, "text", cachelib.text_key(cap, cachelib.text_identity(encoders))))
        orphans = tuple(cachelib.find_orphans(expected))
        removed = cachelib.remove_entries(orphans) if remove_orphans else 0
        texts_total = len(texts)
        return cachelib.CacheStats(
            latents_hit=stats["latents_hit"], latents_encoded=stats["latents_encoded"],
            texts_hit=texts_total - stats["texts_encoded"], texts_encoded=stats["texts_encoded"],
            orphans_removed=removed, clips_failed=stats["clips_failed"], orphans=orphans,
        )


def ensure_cache(data: TrainingData, encoders: Any, *, remove_orphans: bool = True) -> cachelib.CacheStats:
    """Encode and cache every clip and caption that is not cached yet, then remove the entries no clip or caption
    of ``data`` uses (``remove_orphans``; they are listed in the stats' ``orphans`` either way). ``wantrain run`` and
    ``wantrain cache`` call it with ``remove_orphans=False``: other configs on the same data share the cache
    folder, and only ``wantrain cache --prune`` deletes.

    Decodes only the clips whose latents are missing; calls the encoders only when something is missing. Clips that
    fail to decode are re-bucketed or skipped (recorded in ``data.report.verification``).
    """
    return data.fill_cache(encoders, remove_orphans=remove_orphans)


def _epoch_seed(seed: int, epoch: int) -> np.random.SeedSequence:
    """The data-order stream of ``epoch``, from every bit of ``seed`` (a negative seed is read as its 64-bit two's
    complement, so every seed from -2**63 to 2**64-1 has its own order)."""
    return np.random.SeedSequence(seed % 2**64, spawn_key=(epoch,))


def _separate_repeats(queue: list[int], batch_size: int, fixed: int = 0) -> list[int]:
    """``queue`` (cut into batches of ``batch_size`` in order) with no clip twice in one batch, as far as the clips
    allow: each entry that repeats one earlier in its batch is swapped with the first entry of another batch (later
    batches first) such that neither batch then repeats a clip. The first ``fixed`` entries (carried from the
    previous epoch) stay where they are. Keeps the multiset; deterministic. A clip with more entries than there are
    batches must repeat somewhere, and does."""
    q = list(queue)
    n = len(q)
    counts = [Counter(q[s:s + batch_size]) for s in range(0, n, batch_size)]
    for pos in range(fixed, n):
        here, x = pos // batch_size, q[pos]
        if counts[here][x] < 2:
            continue
        after = min(n, (here + 1) * batch_size)
        for j in (*range(after, n), *range(fixed, here * batch_size)):
            there, y = j // batch_size, q[j]
            if counts[here][y] == 0 and counts[there][x] == 0:
                q[pos], q[j] = y, x
                counts[here][x] -= 1
                counts[here][y] += 1
                counts[there][y] -= 1
                counts[there][x] += 1
                break
    return q


class BatchStream:
    """Endless, seeded batches of a :class:`TrainingData` whose position can be saved and restored exactly.

    The position is that of the next plan entry: ``epoch``, ``index`` within the epoch's plan, and the samples
    ``carry`` into that epoch (``remainder = "carry"``); the epoch's plan is a pure function of the seed, the epoch
    and the carry, so resuming regenerates it and skips ``index`` entries without decoding anything. Iterate once.
    """

    def __init__(self, data: TrainingData, encoders: MediaEncoders | None, *, cache: bool = True,
                 pin_memory: bool = False) -> None:
        self.data = data
        self.encoders = encoders
        self.cache = cache
        self.pin_memory = pin_memory
        self.epoch = 0
        self.index = 0
        self.carry: dict[Bucket, list[int]] = {}
        self.tail: list[tuple[Bucket, list[int]]] | None = None  # the current epoch's plan, when regrouped
        self.consumed = 0  # batches yielded (informative)

    def _plan(self, epoch: int, carry: dict[Bucket, list[int]]) -> tuple[list[tuple[Bucket, list[int]]], dict]:
        """The plan of ``epoch``: its tail when the stream holds one (data.regroup), else the seeded plan."""
        if epoch == self.epoch and self.tail is not None:
            return self.tail, {}
        return self.data._usable_epoch(epoch, carry)

    def state_dict(self) -> dict[str, Any]:
        # the caption draws are keyed by (seed, epoch, index): restoring the position restores the caption stream
        return {"epoch": self.epoch, "index": self.index, "consumed": self.consumed,
                "carry": [[list(key), list(idx)] for key, idx in sorted(self.carry.items())],
                "plan_batch": self.data.plan_batch_size, "tail": tail_state(self.tail),
                "seed": self.data.seed, "fingerprint": self.data.fingerprint(),
                "caption_stream": f"philox:{CAPTION_STREAM:x}:seed,epoch,index"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.data.fingerprint():
            raise UserError("the checkpoint's data position refers to another clip list (files were added, removed "
                            "or renamed in the dataset folders since it was saved); restore the data or start a "
                            "new run")
        self.epoch, self.index, self.consumed = int(state["epoch"]), int(state["index"]), int(state["consumed"])
        self.carry = {tuple(key): list(idx) for key, idx in state["carry"]}  # type: ignore[misc]
        self.tail = tail_from_state(state.get("tail"))
        saved_batch = int(state.get("plan_batch", self.data.plan_batch_size))
        if saved_batch != self.data.plan_batch_size:  # another world size: the epoch's untrained samples, anew
            if self.tail is not None:
                batches, carry_out = self.tail, {}
            else:
                batches, carry_out = self.data._epoch(self.epoch, self.carry, saved_batch)
            rest = remaining_samples(batches, self.index, carry_out)
            self.tail = regroup(rest, self.data.plan_batch_size, self.data.seed, self.epoch, self.data.shuffle)
            self.index, self.carry = 0, {}
            if not self.tail:  # the epoch was trained through: the next one, as planned
                self.epoch, self.tail = self.epoch + 1, None

    def seek(self, entries: int) -> None:
        """Advance the position by ``entries`` plan entries without decoding anything."""
        while entries > 0:
            batches, next_carry = self._plan(self.epoch, self.carry)
            step = min(entries, len(batches) - self.index)
            self.index += step
            entries -= step
            if self.index >= len(batches):
                self.epoch, self.index, self.carry, self.tail = self.epoch + 1, 0, next_carry, None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.plan_entries():
            if batch is not None:
                if self.pin_memory:
                    batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
                             for k, v in batch.items()}
                yield batch

    def plan_entries(self) -> Iterator[dict[str, Any] | None]:
        """One item per plan entry from the current position: its batch, or None when none of its clips is usable
        (the position advances either way)."""
        data = self.data
        epoch, skip, carry = self.epoch, self.index, self.carry
        empty_in_a_row = 0
        while True:
            batches, next_carry = self._plan(epoch, carry)
            for index in range(skip, len(batches)):
                key, idx = batches[index]
                self.epoch, self.index, self.carry = epoch, index + 1, carry
                samples = list(zip(idx, data.sample_texts(epoch, index, idx), strict=True))
                share = data.rank_share(samples)
                batch = data._batch_for(key, share, self.encoders, self.cache)
                if batch is not None and data.ranks > 1:  # one process: the batch is the global batch
                    batch["global_draws"] = data.global_draws(len(samples), share, batch["paths"])
                    weights = data.row_weights(len(samples), share, batch["paths"])
                    if weights is not None:  # a short global batch: its padded rows weigh nothing
                        batch["row_weights"] = weights
                if batch is not None:
                    batch["trained"] = data.trained_samples(samples)  # every rank's rows, for the event log
                if batch is None:
                    empty_in_a_row += 1
                    if empty_in_a_row > max(1, 2 * data.steps_per_epoch) + 1:
                        raise UserError("no usable sample left: every clip failed to decode (see the report)")
                    yield None
                    continue
                empty_in_a_row = 0
                self.consumed += 1
                yield batch
            epoch, skip, carry = epoch + 1, 0, next_carry
            self.epoch, self.index, self.carry, self.tail = epoch, 0, carry, None
