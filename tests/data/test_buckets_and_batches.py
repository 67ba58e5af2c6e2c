"""Size buckets, cover + centre crop, batches within one bucket, remainders never dropped."""

from collections import Counter

import numpy as np
import pytest
from conftest import data_config, datasets_config, make_image, make_video
from PIL import Image

from wantrain.data import build_dataset
from wantrain.data.media import fit
from wantrain.data.plan import size_buckets
from wantrain.models.wan22.variants import variant_spec


def test_bucket_sides_are_multiples_of_the_variants_spatial_multiple():
    for name, m in (("t2v-a14b", 16), ("ti2v-5b", 32)):
        spec = variant_spec(name)
        for b in size_buckets(512, [0.5, 0.75, 1.0, 16 / 9], spec.spatial_multiple):
            assert b.width % m == 0 and b.height % m == 0 and b.width * b.height <= 512 * 512


def test_media_go_to_the_bucket_nearest_their_aspect_ratio(tmp_path, tiny_spec):
    make_image(tmp_path, "wide", width=128, height=64)
    make_image(tmp_path, "tall", width=64, height=128)
    make_image(tmp_path, "square", width=50, height=50)
    data = build_dataset(data_config(tmp_path, resolutions=[64]), spec=tiny_spec, seed=0, batch_size=1)
    got = {c.path.stem: (c.width, c.height) for c in data.clips}
    assert got == {"wide": (80, 48), "tall": (48, 80), "square": (64, 64)}  # 96x48 is over the 64*64 budget


def test_resize_covers_then_centre_crops():
    pic = np.zeros((40, 100, 3), np.uint8)
    pic[:, 40:60] = 255  # a white band in the middle
    out = fit(Image.fromarray(pic), 32, 32)
    assert out.shape == (32, 32, 3)
    assert out[:, 16].min() > 200 and out[:, 0].max() < 30  # band kept at the centre, edges cropped


def test_every_resolution_budget_makes_its_own_sample(tmp_path, tiny_spec):
    make_video(tmp_path, "v", frames=9, width=64, height=64)
    data = build_dataset(data_config(tmp_path, resolutions=[32, 64]), spec=tiny_spec, seed=0, batch_size=1)
    assert sorted(c.bucket for c in data.clips) == [(32, 32, 9), (64, 64, 9)]


def test_batches_hold_one_bucket_and_images_are_one_frame_clips(tmp_path, tiny_spec):
    for k in range(3):
        make_video(tmp_path, f"v{k}", frames=9)
        make_image(tmp_path, f"i{k}")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=2)
    it = data.batches(None)
    for _ in range(6):
        b = next(it)
        w, h, f = b["bucket"]
        assert b["pixels"].shape[1:] == (3, f, h, w)
        assert b["pixels"].min() >= -1 and b["pixels"].max() <= 1
        assert all(p.endswith(".mp4" if f == 9 else ".png") for p in b["paths"])


def _epochs(data, n_batches):
    it = data.batches(None)
    return [next(it)["paths"] for _ in range(n_batches)]


def test_carry_remainder_trains_every_sample_over_epochs(tmp_path, tiny_spec):
    for k in range(5):
        make_image(tmp_path, f"i{k}")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=3, batch_size=2)
    assert data.steps_per_epoch == 2 and data.report.buckets[0].remainder == 1
    batches = _epochs(data, 5)  # 10 samples = two epochs of five
    assert all(len(b) == 2 and len(set(b)) == 2 for b in batches)
    assert set(Counter(p for b in batches for p in b).values()) == {2}


def test_smaller_batch_remainder_trains_the_rest_as_a_short_batch(tmp_path, tiny_spec):
    for k in range(5):
        make_image(tmp_path, f"i{k}")
    data = build_dataset(data_config(tmp_path, remainder="smaller_batch"), spec=tiny_spec, seed=3, batch_size=2)
    assert data.steps_per_epoch == 3
    batches = _epochs(data, 3)
    assert sorted(len(b) for b in batches) == [1, 2, 2] and len({p for b in batches for p in b}) == 5


def test_batches_are_deterministic_from_the_seed(tmp_path, tiny_spec):
    for k in range(6):
        make_image(tmp_path, f"i{k}")
    cfg = data_config(tmp_path)
    first = _epochs(build_dataset(cfg, spec=tiny_spec, seed=1, batch_size=2), 6)
    assert first == _epochs(build_dataset(cfg, spec=tiny_spec, seed=1, batch_size=2), 6)
    assert first != _epochs(build_dataset(cfg, spec=tiny_spec, seed=2, batch_size=2), 6)


def test_data_order_depends_on_every_bit_of_the_seed(tmp_path, tiny_spec):
    for k in range(8):
        make_image(tmp_path, f"i{k}")
    cfg = data_config(tmp_path)
    orders = {seed: _epochs(build_dataset(cfg, spec=tiny_spec, seed=seed, batch_size=1), 16)
              for seed in (0, 2**32, 2**63 - 1)}
    assert orders[0] != orders[2**32]  # the low 32 bits alone would make these equal
    assert len({tuple(map(tuple, o)) for o in orders.values()}) == 3


def test_start_batch_resumes_the_same_stream(tmp_path, tiny_spec):
    for k in range(4):
        make_image(tmp_path, f"i{k}")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=1, batch_size=1)
    full = _epochs(data, 7)
    it = data.batches(None, start_batch=4)
    assert [next(it)["paths"] for _ in range(3)] == full[4:]


@pytest.mark.parametrize(("remainder", "repeats", "n_batches", "each"),
                         [("carry", 4, 30, 24), ("carry", 3, 15, 12), ("smaller_batch", 3, 24, 18)])
def test_repeats_never_put_one_clip_twice_in_a_batch(tmp_path, tiny_spec, remainder, repeats, n_batches, each):
    for k in range(5):
        make_image(tmp_path, f"i{k}")
    cfg = datasets_config({"path": tmp_path, "repeats": repeats}, resolutions=[32], frames=[9], remainder=remainder)
    batches = _epochs(build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=4), n_batches)
    assert [b for b in batches if len(set(b)) < len(b)] == []
    # whole epochs of 5 clips x repeats: every clip still trained equally often
    assert set(Counter(p for b in batches for p in b).values()) == {each}


def test_start_batch_resumes_the_same_stream_with_repeats_and_carry(tmp_path, tiny_spec):
    for k in range(5):
        make_image(tmp_path, f"i{k}")
    cfg = datasets_config({"path": tmp_path, "repeats": 3}, resolutions=[32], frames=[9])
    data = build_dataset(cfg, spec=tiny_spec, seed=5, batch_size=4)
    full = _epochs(data, 12)  # four epochs of 15 samples, carried remainders included
    for start in (2, 5, 9):
        it = build_dataset(cfg, spec=tiny_spec, seed=5, batch_size=4).batches(None, start_batch=start)
        assert [next(it)["paths"] for _ in range(12 - start)] == full[start:]


def test_repeats_multiply_samples_per_epoch(tmp_path, tiny_spec):
    make_image(tmp_path / "a", "i0")
    make_image(tmp_path / "b", "i1")
    cfg = datasets_config({"path": tmp_path / "a", "repeats": 3}, {"path": tmp_path / "b"},
                          resolutions=[32], frames=[9])
    data = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=1)
    assert data.steps_per_epoch == 4 and data.report.buckets[0].samples == 4
