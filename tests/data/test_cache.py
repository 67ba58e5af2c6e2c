"""Latent and text-embedding caches: reuse, exact invalidation, atomic writes, orphan removal."""

import os
import tempfile
import time

import torch
from conftest import CountingEncoders, data_config, make_image, make_video

from wantrain.data import build_dataset, ensure_cache
from wantrain.data.cache import STALE_TMP_SECONDS


def _corpus(root):
    make_video(root, "v0", frames=9, caption="a red circle")
    make_video(root, "v1", frames=17, caption="a red circle")
    make_video(root, "v2", frames=9, width=48, caption="a green square")
    make_image(root, "i0", caption="a blue square")


def test_second_run_over_a_cached_dataset_makes_no_encoder_calls(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path)
    first = CountingEncoders()
    stats = ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), first)
    assert (stats.latents_encoded, stats.texts_encoded, stats.hits) == (4, 3, 0)
    second = CountingEncoders()
    data = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2)
    it = data.batches(second)
    batches = [next(it) for _ in range(2 * data.steps_per_epoch)]
    assert second.calls == 0
    assert all({"latents", "text_embeds", "text_mask", "bucket", "paths"} <= set(b) for b in batches)


def test_batches_encode_missing_entries_on_first_use_then_read_them(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path)
    enc = CountingEncoders()
    data = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2)
    it = data.batches(enc)
    fresh = [next(it) for _ in range(data.steps_per_epoch)]
    assert enc.media_items == 4 and enc.text_items >= 3
    again = CountingEncoders()
    it2 = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2).batches(again)
    cached = [next(it2) for _ in range(data.steps_per_epoch)]
    assert again.calls == 0
    for a, b in zip(fresh, cached, strict=True):
        assert a["paths"] == b["paths"] and torch.equal(a["latents"], b["latents"])
        assert torch.equal(a["text_embeds"], b["text_embeds"])


def test_changing_a_processing_parameter_invalidates_exactly_the_affected_entries(tmp_path, tiny_spec):
    _corpus(tmp_path)
    ensure_cache(build_dataset(data_config(tmp_path, frames=[9]), spec=tiny_spec, seed=0, batch_size=2),
                 CountingEncoders())
    enc = CountingEncoders()
    # a 17-frame bucket changes only v1 (17 frames); v0, v2 and the image keep their clips
    data = build_dataset(data_config(tmp_path, frames=[9, 17]), spec=tiny_spec, seed=0, batch_size=2)
    stats = ensure_cache(data, enc)
    assert (stats.latents_hit, stats.latents_encoded, stats.texts_encoded, stats.orphans_removed) == (3, 1, 0, 1)
    assert enc.media_items == 1 and enc.text_calls == 0


def test_changing_a_caption_re_encodes_only_that_text(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path)
    ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    (tmp_path / "v2.txt").write_text("a green square moving up")
    enc = CountingEncoders()
    stats = ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), enc)
    assert (stats.latents_encoded, stats.texts_encoded, stats.orphans_removed) == (0, 1, 1)
    assert enc.text_items == 1


def test_a_new_encoder_identity_misses_every_entry(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path)
    ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders("vae-a"))
    stats = ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders("vae-b"))
    assert (stats.hits, stats.latents_encoded, stats.texts_encoded, stats.orphans_removed) == (0, 4, 3, 7)


def test_edited_media_file_is_re_encoded(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path)
    ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    make_video(tmp_path, "v0", frames=9, width=32, caption="a red circle", faststart=True)  # new content
    stats = ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    assert (stats.latents_encoded, stats.latents_hit) == (1, 3)


def test_cache_writes_leave_no_temporary_files_and_stale_ones_are_removed(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cache = tmp_path / ".wantrain_cache"
    (cache / "latents").mkdir(parents=True)
    stale = cache / "latents" / "abc.safetensors.123.tmp"
    stale.write_bytes(b"half")
    day_ago = time.time() - STALE_TMP_SECONDS - 60
    os.utime(stale, (day_ago, day_ago))
    stats = ensure_cache(build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    assert stats.orphans_removed == 1
    assert not list(cache.rglob("*.tmp"))
    assert len(list((cache / "latents").iterdir())) == 4 and len(list((cache / "text").iterdir())) == 3


def test_orphan_removal_leaves_another_processs_write_in_flight(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path)
    ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    # another run is writing an entry the way save_entry does: a temporary file, then a rename
    final = tmp_path / ".wantrain_cache" / "text" / "0123abcd.safetensors"
    fd, tmp = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent)
    os.close(fd)
    stats = ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    assert stats.orphans_removed == 0
    os.replace(tmp, final)  # the writer's rename still succeeds
    assert final.is_file()


def test_a_corrupt_cache_entry_is_re_encoded(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path)
    ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    victim = sorted((tmp_path / ".wantrain_cache" / "latents").iterdir())[0]
    victim.write_bytes(b"not safetensors")
    stats = ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    assert stats.latents_encoded == 1


def test_cache_dir_setting_puts_every_dataset_in_one_folder(tmp_path, tiny_spec):
    _corpus(tmp_path / "media")
    cfg = data_config(tmp_path / "media", cache_dir=tmp_path / "cache")
    ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=2), CountingEncoders())
    assert len(list((tmp_path / "cache" / "latents").iterdir())) == 4
    assert not (tmp_path / "media" / ".wantrain_cache").exists()


def test_cache_false_encodes_every_batch_and_writes_nothing(tmp_path, tiny_spec):
    _corpus(tmp_path)
    enc = CountingEncoders()
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=2)
    it = data.batches(enc, cache=False)
    for _ in range(2 * data.steps_per_epoch):
        next(it)
    assert enc.media_calls == 2 * data.steps_per_epoch
    assert not (tmp_path / ".wantrain_cache").exists()
