"""Control files beside a clip (``data/controls.py``, docs/data.md "Control files"): found by name, their frame
counts matched to the clip's (one skipped line per mismatch), read at the clip's frames and size, encoded with the
clip by the cache and part of its key and of the resume fingerprints."""

from __future__ import annotations

import pytest
import torch
from conftest import CountingEncoders, data_config, make_image, make_video

from wantrain.core.errors import UserError
from wantrain.data import build_dataset, ensure_cache
from wantrain.data.config import DataConfig
from wantrain.data.fingerprints import compare, file_fingerprints
from wantrain.models.wan22.variants import variant_spec

VACE = variant_spec("tiny-vace-t2v")


class ConditionEncoders(CountingEncoders):
    """The counting fakes, also taking the control files: their latents are pooled like the clip's."""

    def __init__(self) -> None:
        super().__init__()
        self.roles: list[tuple[str, ...]] = []

    def encode_media(self, pixels: torch.Tensor, conditions: dict | None = None) -> dict[str, torch.Tensor]:
        out = super().encode_media(pixels)
        self.roles.append(tuple(sorted(conditions or {})))
        for role, tensor in (conditions or {}).items():
            out[f"{role}_latents"] = torch.nn.functional.avg_pool3d(tensor, kernel_size=(1, 8, 8)).contiguous()
        return out


def control_folder(root):
    make_video(root, "a")
    make_video(root, "a.control", caption=None)
    make_video(root, "a.mask", caption=None)
    make_image(root, "a.ref", caption=None)
    make_video(root, "b")
    make_video(root, "b.control", frames=13, caption=None)  # the clip has 9
    make_video(root, "b.mask", frames=5, caption=None)
    make_video(root, "c")
    make_video(root, "lonely.control", caption=None)
    return root


def test_control_files_are_found_by_name_and_a_frame_count_mismatch_skips_the_clip_one_line_each(tmp_path):
    data = build_dataset(data_config(control_folder(tmp_path)), spec=VACE, seed=0, batch_size=1)
    assert {c.path.name: sorted(c.controls) for c in data.clips} == {"a.mp4": ["control", "mask", "ref"], "c.mp4": []}
    reasons = [s["reason"] for s in data.report.skipped if s["path"].endswith("b.mp4")]
    assert reasons == [
        "control video b.control.mp4 has 13 frames, the clip has 9; a control video follows its clip frame for frame "
        "(docs/data.md, Control files)",
        "mask video b.mask.mp4 has 5 frames, the clip has 9; a mask video follows its clip frame for frame "
        "(docs/data.md, Control files)"]
    report = data.report.format()
    assert "b.control.mp4 has 13 frames" in report and "b.mask.mp4 has 5 frames" in report
    assert any("lonely.control.mp4" in s["path"] and "of no clip" in s["reason"] for s in data.report.ignored_files)
    # a variant without VACE trains the clips and says it does not read their control files
    plain = build_dataset(data_config(tmp_path), spec=variant_spec("tiny-t2v"), seed=0, batch_size=1)
    assert sorted(c.path.name for c in plain.clips) == ["a.mp4", "b.mp4", "c.mp4"]
    assert {s["path"].rsplit("/", 1)[1] for s in plain.report.ignored_files if "only the VACE" in s["reason"]} == {
        "a.control.mp4", "a.mask.mp4", "a.ref.png", "b.control.mp4", "b.mask.mp4"}


def test_the_cache_encodes_control_files_with_their_clip_and_a_changed_control_file_is_encoded_again(tmp_path):
    root = control_folder(tmp_path)
    with pytest.raises(UserError, match=r"a.mp4 \(control, mask, ref\) and c.mp4 \(no control files\) share the "
                                        r"bucket 32x32x9 .* or set train.batch_size = 1"):
        build_dataset(data_config(root), spec=VACE, seed=0, batch_size=2)  # a batch could not stack them
    data = build_dataset(data_config(root), spec=VACE, seed=0, batch_size=1)
    encoders = ConditionEncoders()
    stats = ensure_cache(data, encoders)
    assert stats.latents_encoded == 2 and sorted(encoders.roles) == [(), ("control", "mask", "reference")]
    batch = next(b for b in data.batches(encoders) if b["paths"][0].endswith("a.mp4"))
    assert batch["control_latents"].shape == (1, 3, 9, 4, 4) and batch["reference_latents"].shape == (1, 3, 1, 4, 4)
    assert set(batch["mask_latents"].unique().tolist()) <= {0.0, 1.0}  # masks arrive as 0 / 1
    before = file_fingerprints(data.clips)
    make_video(root, "a.control", frames=9, width=48, caption=None)  # another control video, same clip
    again = build_dataset(data_config(root), spec=VACE, seed=0, batch_size=1)
    stats = ensure_cache(again, encoders)
    assert (stats.latents_hit, stats.latents_encoded) == (1, 1)  # only the clip whose control file changed
    assert compare(before, file_fingerprints(again.clips)).changed == (f"{root / 'a.mp4'} (content)",)


def test_a_metadata_file_names_control_files_in_its_columns(tmp_path):
    make_video(tmp_path / "clips", "a", caption=None)
    make_video(tmp_path / "clips", "pose", caption=None)
    make_image(tmp_path / "clips", "face", caption=None)
    lines = ['{"path": "clips/a.mp4", "caption": "a dancer", "control": "clips/pose.mp4", "ref": "clips/face.png"}',
             '{"path": "clips/a.mp4", "caption": "a dancer", "control_video": "clips/gone.mp4"}',
             '{"path": "clips/a.mp4", "caption": "a dancer", "mask": "clips/face.png"}']
    (tmp_path / "meta.jsonl").write_text("\n".join(lines) + "\n")
    data = build_dataset(DataConfig(metadata=tmp_path / "meta.jsonl", resolutions=[32], frames=[9]), spec=VACE,
                         seed=0, batch_size=1)
    (clip,) = data.clips
    assert {r: p.name for r, p in clip.controls.items()} == {"control": "pose.mp4", "ref": "face.png"}
    assert [s["reason"] for s in data.report.skipped] == [
        "line 2: control file clips/gone.mp4 does not exist",
        "mask video face.png is not a video wantrain reads (docs/data.md, Supported media)"]
