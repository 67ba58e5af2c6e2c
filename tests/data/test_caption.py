"""`wantrain caption`: a tiny randomly initialised image-text-to-text model, built here from a config and saved with a
processor whose tokenizer is built offline, captions clips; the trigger word is in every caption; a second pass
skips captioned clips; a missing or incompatible model folder is one line, exit 2.

The tiny model is a LLaVA (``LlavaForConditionalGeneration``: a CLIP vision tower and a Llama text model), loaded
back through ``AutoModelForImageTextToText`` and ``AutoProcessor`` as a user's Qwen2.5-VL folder is. Qwen2-VL's own
processor cannot be built here: transformers requires torchvision for its video processor, which wantrain does
not depend on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_image, make_video

from wantrain.cli.main import main
from wantrain.data.prepare_caption import CaptionerSettings, caption_folder, finish_caption, load_model

SPECIAL = ["<pad>", "<s>", "</s>", "<image>"]
WORDS = "a the of in on and is with video frame red blue circle square moving left camera background user assistant :"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


def build_tiny_vlm(folder: Path) -> Path:
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    vocab = {t: i for i, t in enumerate([*SPECIAL, *WORDS.split(), "[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="[UNK]")
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", chat_template=TEMPLATE, image_token="<image>",
                               num_additional_image_tokens=1)
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256),
        image_token_id=vocab["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = vocab["</s>"], vocab["<pad>"], vocab["<s>"]
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-llava")


def test_captions_carry_the_trigger_and_a_second_pass_skips_them(tiny_vlm, tmp_path):
    clips = tmp_path / "clips"
    make_video(clips, "a_scene000_clip00", frames=9, caption=None)
    make_image(clips, "still", caption=None)
    make_video(clips, "done", frames=9, caption="ohwx, a circle written by hand")
    (clips / "broken.mp4").write_bytes(b"not a video")
    loads, lines = [], []

    def loader(settings, device):
        loads.append(device)
        return load_model(settings, device)

    settings = CaptionerSettings(model=tiny_vlm, trigger="ohwx", style="Be brief.", frames=3, batch_size=2,
                                 max_new_tokens=6, device="cpu")
    summary = caption_folder(clips, settings, progress=False, loader=loader, log=lines.append)
    assert sorted(Path(p).name for p in summary.written) == ["a_scene000_clip00.mp4", "still.png"]
    assert lines == [f"unreadable: {clips / 'broken.mp4'}: {summary.unreadable[0]['reason']}"]
    assert not (clips / "broken.txt").exists()
    assert summary.skipped == [str(clips / "done.mp4")] and summary.images_shown == 3 + 1
    for name in ("a_scene000_clip00", "still"):
        text = (clips / f"{name}.txt").read_text()
        assert text.startswith("ohwx") and text.endswith("\n") and len(text.split()) > 1
    assert (clips / "done.txt").read_text() == "ohwx, a circle written by hand"
    stamps = {p.name: p.stat().st_mtime_ns for p in clips.glob("*.txt")}

    (clips / "broken.mp4").unlink()
    again = caption_folder(clips, settings, progress=False, loader=loader)
    assert again.written == [] and len(again.skipped) == 3 and len(loads) == 1  # nothing to do: no model loaded
    assert {p.name: p.stat().st_mtime_ns for p in clips.glob("*.txt")} == stamps

    import attrs
    redo = caption_folder(clips, attrs.evolve(settings, overwrite=True), progress=False, loader=loader)
    assert len(redo.written) == 3 and (clips / "done.txt").read_text().startswith("ohwx")


def test_the_trigger_is_put_in_front_only_when_the_answer_lacks_it():
    assert finish_caption("  A  red\ncircle ", "ohwx") == "ohwx, A red circle"
    assert finish_caption("an OHWX circle", "ohwx") == "an OHWX circle"
    assert finish_caption("", "ohwx") == "ohwx" and finish_caption("a b", "") == "a b"


def test_a_missing_or_incompatible_model_folder_is_one_line_and_exit_2(tmp_path, capsys):
    clips = tmp_path / "clips"
    make_video(clips, "c", frames=9, caption=None)
    assert main(["caption", str(clips), "--model", str(tmp_path / "nowhere"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"caption model folder '{tmp_path / 'nowhere'}' does not exist" in err[0]
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8, "hidden_size": 8}))
    assert main(["caption", str(clips), "--model", str(text_only), "--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"wantrain caption: error: caption model folder '{text_only}'")
    assert not (clips / "c.txt").exists()


def test_ctrl_c_keeps_the_captions_of_the_batches_done(tiny_vlm, tmp_path, monkeypatch):
    from wantrain.data import prepare_caption

    clips = tmp_path / "clips"
    for k in range(3):
        make_video(clips, f"c{k}", frames=9, caption=None)
    real, calls = prepare_caption._generate, []

    def generate(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(prepare_caption, "_generate", generate)
    settings = CaptionerSettings(model=tiny_vlm, trigger="ohwx", frames=2, batch_size=2, max_new_tokens=4,
                                 device="cpu")
    with pytest.raises(KeyboardInterrupt, match=r"stopped \(Ctrl-C\): 2 captions written and kept"):
        caption_folder(clips, settings, progress=False)
    assert sorted(p.name for p in clips.glob("*.txt")) == ["c0.txt", "c1.txt"]
    monkeypatch.setattr(prepare_caption, "_generate", real)
    rest = caption_folder(clips, settings, progress=False)
    assert [Path(p).name for p in rest.written] == ["c2.mp4"] and len(rest.skipped) == 2
