"""One process fills the cache and encodes the sample prompts with the VAE and the text encoder alone, and releases
them, before the experts load (``wantrain.app.assemble.encode_before_the_experts``; docs/models.md, Host memory): the
host never holds the encoders and the experts' copies at once."""

from __future__ import annotations

import weakref
from pathlib import Path

from wantrain.models.wan22.loading import WeightSource


def _config(tmp_path: Path) -> Path:
    from wantrain.data.demo import render, write_video

    media = tmp_path / "media"
    media.mkdir()
    for i, direction in enumerate(("left", "up")):
        write_video(media / f"v{i}.mp4", render("circle", (230, 40, 40), (0, 0, 0), direction, 32, 32, 9), 16.0)
        (media / f"v{i}.txt").write_text(f"a red circle moving {direction}", encoding="utf-8")
    config = tmp_path / "run.toml"
    config.write_text(f"""[run]
output_dir = "{tmp_path / 'out'}"
seed = 0

[model]
variant = "tiny-t2v"
experts = "both"
gradient_checkpointing = false
switch_every = 1

[lora]
rank = 4

[data]
path = "{media}"
frames = [9]

[train]
max_steps = 1
device = "cpu"

[validation]
enabled = true
from_training = 1
every = 1000

[sample]
enabled = true
prompts = ["a red circle"]
every = 1000
frames = 5
steps = 2
guidance_scale = 3.0

[observers]
progress = false
""", encoding="utf-8")
    return config


def test_one_process_fills_the_cache_and_releases_the_encoders_before_any_expert_loads(tmp_path, monkeypatch):
    events: list[tuple] = []
    encoders: list[weakref.ref] = []  # every VAE and text encoder the run loaded, weakly: freed means released
    transformer, vae, text_encoder = WeightSource.transformer, WeightSource.vae, WeightSource.text_encoder

    def recorded_transformer(self, expert, dtype, **options):  # options: quantise_on (int8 / nf4 while loading)
        events.append(("expert", expert, sum(r() is not None for r in encoders)))
        return transformer(self, expert, dtype, **options)

    def recorded_vae(self):
        module = vae(self)
        encoders.append(weakref.ref(module))
        events.append(("vae",))
        return module

    def recorded_text_encoder(self, dtype):
        tokenizer, module = text_encoder(self, dtype)
        encoders.append(weakref.ref(module))
        events.append(("text encoder",))
        return tokenizer, module

    monkeypatch.setattr(WeightSource, "transformer", recorded_transformer)
    monkeypatch.setattr(WeightSource, "vae", recorded_vae)
    monkeypatch.setattr(WeightSource, "text_encoder", recorded_text_encoder)
    from wantrain.app.train import train

    outcome = train(_config(tmp_path))
    assert outcome.status == "completed", outcome.reason
    experts = [i for i, e in enumerate(events) if e[0] == "expert"]
    assert [events[i][1] for i in experts] == ["high_noise", "low_noise"]
    before = events[: experts[0]]
    assert ("vae",) in before and ("text encoder",) in before  # the cache filled and the prompts encoded first
    assert all(events[i][2] == 0 for i in experts)  # ... and every encoder was freed before an expert loaded
    # the sample prompts were encoded then: the text encoder never loads again (with the experts' copies held)
    assert events.count(("text encoder",)) == 1
    log = (outcome.run_dir / "log.jsonl").read_text()
    assert '"event": "cache_ready"' in log and '"latents_encoded": 2' in log
