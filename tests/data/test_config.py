import pytest

from wantrain.app.config import RunConfig
from wantrain.core.config import structure
from wantrain.core.errors import ConfigError


def test_simple_path_form_means_one_dataset(tmp_path):
    cfg = structure(RunConfig, {"data": {"path": str(tmp_path), "frames": [9, 17]}})
    (ds,) = cfg.data.dataset_list()
    assert ds.path == tmp_path
    assert cfg.data.resolved(ds).frames == [9, 17]


def test_dataset_tables_override_data_defaults(tmp_path):
    cfg = structure(RunConfig, {"data": {"repeats": 2, "frames": [9], "datasets": [
        {"path": str(tmp_path / "a")},
        {"path": str(tmp_path / "b"), "repeats": 5, "frames": [17], "clip_mode": "slide"}]}})
    a, b = (cfg.data.resolved(d) for d in cfg.data.dataset_list())
    assert (a.repeats, a.frames, a.clip_mode) == (2, [9], "head")
    assert (b.repeats, b.frames, b.clip_mode) == (5, [17], "slide")


def test_path_and_datasets_together_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="both set"):
        structure(RunConfig, {"data": {"path": str(tmp_path), "datasets": [{"path": str(tmp_path)}]}})


def test_frame_bucket_not_4k_plus_1_names_the_key():
    with pytest.raises(ConfigError, match=r"'data.frames'.*10 is not of the form 4k\+1"):
        structure(RunConfig, {"data": {"frames": [9, 10]}})


def test_unknown_clip_mode_lists_the_choices():
    with pytest.raises(ConfigError, match="'head', 'uniform', 'slide'"):
        structure(RunConfig, {"data": {"clip_mode": "chunk"}})


def test_relative_dataset_paths_are_resolved_against_the_config_file(tmp_path):
    from wantrain.app.config import load_config

    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "run.toml"
    path.write_text('[[data.datasets]]\npath = "../media"\n\n[data]\ncache_dir = "cache"\n')
    cfg = load_config(path)
    assert cfg.data.dataset_list()[0].path == (tmp_path / "media").resolve()
    assert cfg.data.cache_dir == (tmp_path / "cfg" / "cache").resolve()
