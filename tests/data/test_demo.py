"""The demo generator: deterministic, captioned, varied."""

from pathlib import Path

import av

from wantrain.data.demo import make_demo_dataset
from wantrain.data.media import probe


def test_demo_data_is_deterministic_from_the_seed(tmp_path):
    a = make_demo_dataset(tmp_path / "a", seed=7, clips=3, images=1, frame_range=(9, 11))
    b = make_demo_dataset(tmp_path / "b", seed=7, clips=3, images=1, frame_range=(9, 11))
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert [p.with_suffix(".txt").read_text() for p in a] == [p.with_suffix(".txt").read_text() for p in b]


def test_demo_data_varies_size_length_and_rate(tmp_path):
    paths = make_demo_dataset(tmp_path, seed=1, clips=12, images=0, sizes=((32, 32), (48, 32), (32, 48)),
                              frame_range=(9, 17), fps_choices=(12.0, 16.0, 24.0))
    infos = [probe(p) for p in paths]
    assert len({(i.width, i.height) for i in infos}) == 3
    assert len({i.frames for i in infos}) > 2 and {i.fps for i in infos} == {12.0, 16.0, 24.0}
    caption = paths[0].with_suffix(".txt").read_text()
    assert caption.startswith("a ") and " moving " in caption and caption.rstrip().endswith("background")


def test_committed_demo_data_is_small_and_complete():
    root = Path(__file__).resolve().parents[2] / "examples" / "demo_data"
    media = sorted(p for p in root.iterdir() if p.suffix in (".mp4", ".png"))
    assert len([p for p in media if p.suffix == ".mp4"]) == 16 and len([p for p in media if p.suffix == ".png"]) == 4
    assert all(p.with_suffix(".txt").is_file() for p in media)
    assert sum(p.stat().st_size for p in root.iterdir()) < 1_000_000
    with av.open(str(media[0])) as c:
        assert c.streams.video[0].average_rate == 16
