"""`wantrain check` and `wantrain cache` at the function level (the lead wires them into wantrain.cli.main)."""

import argparse
import json
import sys
import types

from conftest import CountingEncoders, make_image, make_video

from wantrain.cli import cache as cache_cmd
from wantrain.cli import check as check_cmd


def _args(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def _config(tmp_path):
    media = tmp_path / "demo_data"
    make_video(media, "v0", frames=9)
    make_image(media, "i0")
    (media / "bad.mp4").write_bytes(b"")
    (media / "bad.txt").write_text("x")
    path = tmp_path / "run.toml"
    path.write_text('[model]\nvariant = "tiny-t2v"\n\n[data]\npath = "demo_data"\nresolutions = [32]\nframes = [9]\n')
    return path


def test_check_prints_the_report_and_writes_json(tmp_path, capsys):
    cfg = _config(tmp_path)
    rc = check_cmd.run(_args(check_cmd, [str(cfg), "--json", str(tmp_path / "r.json"), "--set", "train.batch_size=2"]))
    out = capsys.readouterr().out
    assert rc == 0
    assert "32x32x9" in out and "bad.mp4: empty file (0 bytes)" in out and "card needs" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["batch_size"] == 2 and rep["skipped"][0]["reason"] == "empty file (0 bytes)"


def test_check_verify_decodes_every_clip(tmp_path, capsys):
    rc = check_cmd.run(_args(check_cmd, [str(_config(tmp_path)), "--verify"]))
    assert rc == 0 and "decode verification events" not in capsys.readouterr().out


def test_cache_command_encodes_once_then_hits(tmp_path, capsys, monkeypatch):
    enc = CountingEncoders()
    fake = types.ModuleType("wantrain.models.wan22")
    fake.build_adapter = fake.build_encoders = lambda *a, **k: enc
    monkeypatch.setitem(sys.modules, "wantrain.models.wan22", fake)
    cfg = _config(tmp_path)
    assert cache_cmd.run(_args(cache_cmd, [str(cfg)])) == 0
    assert "2 latents and 2 text embeddings encoded" in capsys.readouterr().out
    calls = enc.calls
    assert cache_cmd.run(_args(cache_cmd, [str(cfg)])) == 0
    assert enc.calls == calls and "2 latents and 2 text embeddings already cached" in capsys.readouterr().out


def test_cache_loads_no_transformer_and_accepts_an_fp8_config(tmp_path, capsys, monkeypatch):
    """Caching needs the VAE and the text encoder only: no transformer is loaded (an A14B config would load two
    14B experts for nothing), and an fp8 config is not refused for want of CUDA (text embeddings in bf16)."""
    from wantrain.models.wan22.loading import WeightSource

    def no_transformer(*args, **kwargs):
        raise AssertionError("wantrain cache loaded a transformer")

    monkeypatch.setattr(WeightSource, "transformer", no_transformer)
    cfg = _config(tmp_path)
    cfg.write_text(cfg.read_text().replace('variant = "tiny-t2v"\n', 'variant = "tiny-t2v"\nbase_dtype = "fp8"\n'))
    assert cache_cmd.run(_args(cache_cmd, [str(cfg), "--set", "train.device=cpu"])) == 0
    assert "2 latents and 2 text embeddings encoded" in capsys.readouterr().out
    texts = list((tmp_path / "demo_data" / ".wantrain_cache" / "text").glob("*.safetensors"))
    from safetensors.torch import load_file

    assert len(texts) == 2 and load_file(str(texts[0]))["text_embeds"].dtype == __import__("torch").bfloat16
