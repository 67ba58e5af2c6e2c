from __future__ import annotations

import pytest

from wantrain.core.errors import UserError
from wantrain.core.rundir import create_run_dir, sanitize_run_id


def test_run_dir_is_timestamp_plus_run_id(tmp_path):
    run_dir = create_run_dir(tmp_path, "exp_v1.2-a", now=0)
    assert run_dir.parent == tmp_path and run_dir.is_dir()
    assert run_dir.name.endswith("__exp_v1.2-a") and len(run_dir.name.split("__")[0]) == 15


@pytest.mark.parametrize(
    "bad", ["../escape", "a/b", "..", "...", "a..b", "with space", "", "ü", "a\\b", "ok\n", "ok\r\n", "\nok"]
)
def test_unsafe_run_ids_are_refused(bad):
    with pytest.raises(UserError, match="run id"):
        sanitize_run_id(bad)


def test_existing_run_dir_is_never_reused(tmp_path):
    first = create_run_dir(tmp_path, "x", now=0)
    (first / "keep.txt").write_text("precious")
    second = create_run_dir(tmp_path, "x", now=0)
    assert second != first and second.name == first.name + "-2"
    assert (first / "keep.txt").read_text() == "precious"


def test_appending_through_a_symbolic_link_is_refused_and_the_target_is_untouched(tmp_path):
    from wantrain.core.rundir import open_append, refuse_links

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open_append(run_dir / "log.jsonl", text=True) as fh:
        fh.write("one\n")
    with open_append(run_dir / "log.jsonl") as fh:
        fh.write(b"two\n")
    assert (run_dir / "log.jsonl").read_text() == "one\ntwo\n"
    refuse_links(run_dir)  # no link: nothing to say
    target = tmp_path / "elsewhere.txt"
    target.write_text("theirs\n")
    (run_dir / "metrics.jsonl").symlink_to(target)
    with pytest.raises(UserError, match="is a symbolic link"):
        open_append(run_dir / "metrics.jsonl")
    with pytest.raises(UserError, match=r"holds 1 symbolic link\(s\), e.g. 'metrics.jsonl' -> "):
        refuse_links(run_dir)
    assert target.read_text() == "theirs\n"
