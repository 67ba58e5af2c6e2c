"""Captions served from the cache: dropout to the empty prompt, a prefix, several captions per clip, shuffled tags;
each distinct text encoded once; the choice per sample drawn from the run seed and the data position."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import CountingEncoders, data_config, datasets_config, make_image, make_video

from wantrain.core.errors import ConfigError
from wantrain.data import build_dataset, ensure_cache
from wantrain.data.captions import CaptionSettings, caption_texts


def _corpus(root, n=6):
    for i in range(n):
        make_image(root, f"i{i}", caption=f"a blue square {i}")


def _texts_of(data, batches):
    return [t for b in batches for t in b["captions"]]


def test_dropout_share_stays_within_a_binomial_bound_over_a_run(tmp_path, tiny_spec):
    _corpus(tmp_path)
    p = 0.3
    data = build_dataset(data_config(tmp_path, caption_dropout=p), spec=tiny_spec, seed=5, batch_size=2)
    texts = _texts_of(data, itertools.islice(data.batches(None), 300))  # pixel batches: no encoder needed
    n = len(texts)
    dropped = sum(t == "" for t in texts)
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(dropped - n * p) < 4 * sigma, (dropped, n)
    assert set(texts) - {""} == {f"a blue square {i}" for i in range(6)}


def test_no_dropout_never_trains_the_empty_prompt(tmp_path, tiny_spec):
    _corpus(tmp_path)
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=5, batch_size=2)
    assert "" not in _texts_of(data, itertools.islice(data.batches(None), 50))


def test_a_dropped_sample_uses_the_cached_empty_embedding_without_an_encoder_call(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path, caption_dropout=0.5)
    filler = CountingEncoders()
    stats = ensure_cache(build_dataset(cfg, spec=tiny_spec, seed=1, batch_size=2), filler)
    assert stats.texts_encoded == 7  # six captions and the empty prompt, each once
    empty = filler.encode_text([""])["text_embeds"][0]
    trainer = CountingEncoders()
    data = build_dataset(cfg, spec=tiny_spec, seed=1, batch_size=2)
    batches = list(itertools.islice(data.batches(trainer), 20))
    assert trainer.calls == 0
    seen = 0
    for b in batches:
        for k, text in enumerate(b["captions"]):
            if text == "":
                seen += 1
                assert torch.equal(b["text_embeds"][k], empty)
    assert seen > 0


def test_turning_dropout_on_and_off_re_encodes_no_caption(tmp_path, tiny_spec):
    _corpus(tmp_path)
    first = ensure_cache(build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=2),
                         CountingEncoders())
    assert first.texts_encoded == 6
    on = ensure_cache(build_dataset(data_config(tmp_path, caption_dropout=0.2), spec=tiny_spec, seed=0,
                                    batch_size=2), CountingEncoders())
    assert (on.texts_encoded, on.latents_encoded) == (1, 0)  # only the empty prompt, once
    share = ensure_cache(build_dataset(data_config(tmp_path, caption_dropout=0.6), spec=tiny_spec, seed=0,
                                       batch_size=2), CountingEncoders())
    off = ensure_cache(build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=2),
                       CountingEncoders(), remove_orphans=False)
    assert share.encoded == 0 and off.encoded == 0


def test_each_line_is_a_caption_variant_drawn_per_sample_and_encoded_once(tmp_path, tiny_spec):
    make_image(tmp_path, "i0", caption="a blue square\n\n  a square, blue  \nblue on black\n")
    make_image(tmp_path, "i1", caption="a red dot")
    cfg = data_config(tmp_path, caption_variants="lines", caption_prefix="ohwx, ")
    data = build_dataset(cfg, spec=tiny_spec, seed=3, batch_size=1)
    by_path = {c.path.name: c.texts for c in data.clips}
    assert by_path["i0.png"] == ("ohwx, a blue square", "ohwx, a square, blue", "ohwx, blue on black")
    assert by_path["i1.png"] == ("ohwx, a red dot",)
    enc = CountingEncoders()
    stats = ensure_cache(data, enc)
    assert stats.texts_encoded == 4 and enc.text_items == 4
    drawn = {t for b in itertools.islice(data.batches(CountingEncoders()), 60) for t in b["captions"]}
    assert drawn == set(by_path["i0.png"]) | set(by_path["i1.png"])
    report = data.report
    assert report.captions["variants_max"] == 3 and report.captions["distinct_texts"] == 4
    assert "captions: 2 on average (1-3) per medium, 4 distinct texts to encode; 0.0% of samples" in report.format()


def test_whole_caption_files_keep_line_breaks_as_one_caption(tmp_path, tiny_spec):
    make_image(tmp_path, "i0", caption="a blue\nsquare")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)
    assert data.clips[0].texts == ("a blue square",)


def test_tag_shuffles_keep_the_leading_tags_and_are_the_same_for_the_same_seed(tmp_path):
    settings = CaptionSettings(tag_shuffles=4, keep_tags=1, prefix="ohwx, ")
    variants = ["woman, red dress, studio, smiling, full body"]
    texts = caption_texts(variants, settings, seed=7, path="/a.png")
    assert 1 < len(texts) <= 4
    for text in texts:
        tags = text.removeprefix("ohwx, ").split(", ")
        assert tags[0] == "woman" and sorted(tags[1:]) == sorted(["red dress", "studio", "smiling", "full body"])
    assert caption_texts(variants, settings, seed=7, path="/a.png") == texts
    assert caption_texts(variants, settings, seed=8, path="/a.png") != texts


def test_the_choice_per_sample_is_a_function_of_seed_and_position(tmp_path, tiny_spec):
    _corpus(tmp_path)
    cfg = data_config(tmp_path, caption_dropout=0.4)
    full = list(itertools.islice(build_dataset(cfg, spec=tiny_spec, seed=9, batch_size=2).batches(None), 12))
    data = build_dataset(cfg, spec=tiny_spec, seed=9, batch_size=2)
    resumed = list(itertools.islice(data.batches(None, start_batch=5), 7))
    assert [b["captions"] for b in resumed] == [b["captions"] for b in full[5:]]
    other = list(itertools.islice(build_dataset(cfg, spec=tiny_spec, seed=10, batch_size=2).batches(None), 12))
    assert [b["captions"] for b in other] != [b["captions"] for b in full]


def test_changing_the_dropout_share_keeps_each_undropped_samples_variant(tmp_path, tiny_spec):
    make_image(tmp_path, "i0", caption="one\ntwo\nthree\nfour")
    low = data_config(tmp_path, caption_variants="lines", caption_dropout=0.1)
    high = data_config(tmp_path, caption_variants="lines", caption_dropout=0.5)
    a = _texts_of(None, itertools.islice(build_dataset(low, spec=tiny_spec, seed=2, batch_size=1).batches(None), 40))
    b = _texts_of(None, itertools.islice(build_dataset(high, spec=tiny_spec, seed=2, batch_size=1).batches(None), 40))
    assert all(y in ("", x) for x, y in zip(a, b, strict=True) if x != "")


def test_dropout_and_prefix_per_dataset(tmp_path, tiny_spec):
    _corpus(tmp_path / "a", 2)
    _corpus(tmp_path / "b", 2)
    cfg = datasets_config({"path": tmp_path / "a", "caption_dropout": 0.5, "caption_prefix": "sks "},
                          {"path": tmp_path / "b"}, resolutions=[32], frames=[9])
    data = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=1)
    rates = {c.path.parent.name: c.caption_dropout for c in data.clips}
    assert rates == {"a": 0.5, "b": 0.0}
    assert all(c.caption.startswith("sks ") == (c.path.parent.name == "a") for c in data.clips)
    assert data.report.captions["dropped_pct"] == pytest.approx(25.0)


def test_a_blank_tag_separator_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="data.tag_separator"):
        data_config(tmp_path, tag_separator=" ")


def test_video_clips_of_one_file_share_their_texts(tmp_path, tiny_spec):
    make_video(tmp_path, "v0", frames=17, caption="a red circle\na circle, red")
    cfg = data_config(tmp_path, caption_variants="lines", clip_mode="slide", clip_stride=8)
    data = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=1)
    assert len(data.clips) == 2 and data.clips[0].texts == data.clips[1].texts == ("a red circle", "a circle, red")
