"""Coming from musubi-tuner or ai-toolkit: the peers' key names with the wantrain key that does the same, and the
recognition of a peer's config file given where a wantrain config belongs.

* :data:`PEER_KEYS` -- the table (``docs/config.md`` renders it; a test checks that every wantrain key in it
  exists). :func:`peer_hint` turns an unknown key into "that is musubi-tuner's name; wantrain's is ``lora.rank``"
  (``wantrain.core.config`` asks it before its own did-you-mean, so ``data.shuffle_tokens`` is never sent to
  ``data.shuffle``, another thing).
* :func:`peer_file_problem` -- one line for a musubi-tuner dataset config (``[general]``, ``[[datasets]]``), a file of
  musubi-tuner training arguments (``network_dim = 32`` at the top level) or an ai-toolkit YAML config
  (``job``/``config``/``process``), saying where its keys go and, for a dataset wantrain can read, how to point
  ``[data]`` at it.

Key names are the peers' documented ones (musubi-tuner's ``dataset_config.md`` and its training arguments,
ai-toolkit's ``config/examples/train_lora_wan22_14b_24gb.yaml``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from wantrain.app.conversion import area_side

MUSUBI, AI_TOOLKIT, KOHYA = "musubi-tuner", "ai-toolkit", "sd-scripts"


@attrs.frozen
class PeerKey:
    peer: str  # whose name it is
    wantrain: str  # the wantrain key that does the same (section.key)
    note: str = ""  # how the value changes, when it does
    # ``wantrain convert``: the value -> {wantrain key: value} (None: copied as it is; a function returning {}:
    # not converted, the key gets an "unmapped" line with the note)
    convert: Callable[[Any], dict[str, Any]] | None = None


def _to(key: str, fn: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], dict[str, Any]]:
    return lambda v: {key: fn(v)}


def _manual(_: Any) -> dict[str, Any]:
    return {}


_TASKS = {"t2v-A14B": "t2v-a14b", "i2v-A14B": "i2v-a14b", "ti2v-5B": "ti2v-5b"}
_NETWORKS = {"networks.lora_wan": "lora", "networks.lora": "lora", "lycoris.kohya": "lokr"}


PEER_KEYS: dict[str, PeerKey] = {
    # musubi-tuner training arguments (wan_train_network.py; a --config_file TOML holds the same names)
    "network_dim": PeerKey(MUSUBI, "lora.rank"),
    "network_alpha": PeerKey(MUSUBI, "lora.alpha"),
    "network_weights": PeerKey(MUSUBI, "lora.init_from", "or lora.init_from_high_noise / _low_noise per expert"),
    "network_module": PeerKey(MUSUBI, "lora.type", '"networks.lora_wan" is "lora"',
                              _to("lora.type", lambda v: _NETWORKS.get(v, v))),
    "task": PeerKey(MUSUBI, "model.variant", '"t2v-A14B" is "t2v-a14b", "i2v-A14B" "i2v-a14b", "ti2v-5B" "ti2v-5b"',
                    _to("model.variant", lambda v: _TASKS.get(v, str(v).lower()))),
    "learning_rate": PeerKey(MUSUBI, "optimizer.lr"),
    "optimizer_type": PeerKey(MUSUBI, "optimizer.type"),
    "optimizer_args": PeerKey(MUSUBI, "optimizer.weight_decay", "and the other [optimizer] keys, one key each",
                              _manual),
    "lr_warmup_steps": PeerKey(MUSUBI, "lr_scheduler.warmup_steps"),
    "max_train_steps": PeerKey(MUSUBI, "train.max_steps"),
    "max_train_epochs": PeerKey(MUSUBI, "train.max_epochs"),
    "gradient_accumulation_steps": PeerKey(MUSUBI, "train.grad_accum"),
    "max_grad_norm": PeerKey(MUSUBI, "train.clip_grad_norm"),
    "save_every_n_steps": PeerKey(MUSUBI, "train.save_every"),
    "save_every_n_epochs": PeerKey(MUSUBI, "train.save_every_epochs"),
    "output_name": PeerKey(MUSUBI, "run.name"),
    "dit": PeerKey(MUSUBI, "model.low_noise_file", "Wan 2.2 A14B; TI2V-5B: model.transformer_file"),
    "dit_high_noise": PeerKey(MUSUBI, "model.high_noise_file"),
    "vae": PeerKey(MUSUBI, "model.vae_file"),
    "t5": PeerKey(MUSUBI, "model.text_encoder_file"),
    "fp8_base": PeerKey(MUSUBI, "model.base_dtype", 'base_dtype = "fp8"',
                        lambda v: {"model.base_dtype": "fp8"} if v else {}),
    "fp8_scaled": PeerKey(MUSUBI, "model.base_dtype", 'base_dtype = "fp8_scaled"',
                          lambda v: {"model.base_dtype": "fp8_scaled"} if v else {}),
    "discrete_flow_shift": PeerKey(MUSUBI, "model.shift"),
    "min_timestep": PeerKey(MUSUBI, "model.min_t", "0-1 units: 900 is 0.9", _to("model.min_t", lambda v: v / 1000)),
    "max_timestep": PeerKey(MUSUBI, "model.max_t", "0-1 units: 900 is 0.9", _to("model.max_t", lambda v: v / 1000)),
    "sample_prompts": PeerKey(MUSUBI, "sample.prompts", "the prompts themselves, not a file: `wantrain convert "
                              "PROMPTS.txt` writes them from its prompt file", _manual),
    "sample_every_n_steps": PeerKey(MUSUBI, "sample.every"),
    "sample_every_n_epochs": PeerKey(MUSUBI, "sample.every_epochs"),
    "log_with": PeerKey(MUSUBI, "observers.wandb", "TensorBoard is on by default (observers.tensorboard)",
                        lambda v: {"observers.wandb": True} if v in ("wandb", "all") else {}),
    "dataset_config": PeerKey(MUSUBI, "data.datasets", "the [[datasets]] tables become [[data.datasets]]", _manual),
    # musubi-tuner dataset config ([general] and [[datasets]])
    "video_directory": PeerKey(MUSUBI, "data.path", "or data.datasets[].path"),
    "image_directory": PeerKey(MUSUBI, "data.path", "or data.datasets[].path"),
    "video_jsonl_file": PeerKey(MUSUBI, "data.metadata", "read as it is"),
    "image_jsonl_file": PeerKey(MUSUBI, "data.metadata", "read as it is"),
    "cache_directory": PeerKey(MUSUBI, "data.cache_dir"),
    "target_frames": PeerKey(MUSUBI, "data.frames"),
    "resolution": PeerKey(MUSUBI, "data.resolutions", "an area: [960, 544] (width, height) is [723], the side of the "
                          "square of as many pixels; enable_bucket off: data.aspect_ratios = [960 / 544]",
                          lambda v: {"data.resolutions": [area_side(v)]} if area_side(v) else {}),
    "num_repeats": PeerKey(MUSUBI, "data.repeats"),
    "frame_extraction": PeerKey(MUSUBI, "data.clip_mode"),
    "frame_stride": PeerKey(MUSUBI, "data.clip_stride"),
    "frame_sample": PeerKey(MUSUBI, "data.clips_per_video"),
    # sd-scripts' caption keys (musubi-tuner's users bring them too)
    "shuffle_caption": PeerKey(KOHYA, "data.tag_shuffles", "the number of shuffled orders per caption",
                        _to("data.tag_shuffles", lambda v: int(v))),  # true: one shuffled order
    "keep_tokens": PeerKey(KOHYA, "data.keep_tags"),
    # ai-toolkit (YAML: config.process[0].<table>.<key>)
    "trigger_word": PeerKey(AI_TOOLKIT, "data.caption_prefix", 'the text put in front of every caption: "ohwx, "'),
    "linear": PeerKey(AI_TOOLKIT, "lora.rank"),
    "linear_alpha": PeerKey(AI_TOOLKIT, "lora.alpha"),
    "folder_path": PeerKey(AI_TOOLKIT, "data.path"),
    "caption_ext": PeerKey(AI_TOOLKIT, "data.caption_extension", 'with the dot: ".txt"'),
    "caption_dropout_rate": PeerKey(AI_TOOLKIT, "data.caption_dropout"),
    "shuffle_tokens": PeerKey(AI_TOOLKIT, "data.tag_shuffles", "the number of shuffled orders per caption",
                        _to("data.tag_shuffles", lambda v: int(v))),  # true: one shuffled order
    "num_frames": PeerKey(AI_TOOLKIT, "data.frames", "or sample.frames in [sample]", _to("data.frames", lambda v: [v])),
    "steps": PeerKey(AI_TOOLKIT, "train.max_steps", "or sample.steps in [sample]"),
    "gradient_accumulation": PeerKey(AI_TOOLKIT, "train.grad_accum"),
    "switch_boundary_every": PeerKey(AI_TOOLKIT, "model.switch_every"),
    "train_high_noise": PeerKey(AI_TOOLKIT, "model.experts", '"both", "high_noise" or "low_noise"', _manual),
    "train_low_noise": PeerKey(AI_TOOLKIT, "model.experts", '"both", "high_noise" or "low_noise"', _manual),
    "name_or_path": PeerKey(AI_TOOLKIT, "model.path", "a local diffusers folder"),
    "quantize": PeerKey(AI_TOOLKIT, "model.base_dtype", '"fp8" or "fp8_scaled"',
                        lambda v: {"model.base_dtype": "fp8"} if v else {}),
    "timestep_type": PeerKey(AI_TOOLKIT, "model.timestep_sampling", '"uniform", "logit_normal" or "sigmoid"',
                             _manual),
    "sample_every": PeerKey(AI_TOOLKIT, "sample.every"),
    "sample_steps": PeerKey(AI_TOOLKIT, "sample.steps"),
    "neg": PeerKey(AI_TOOLKIT, "sample.negative_prompt"),
    "training_folder": PeerKey(AI_TOOLKIT, "run.output_dir"),
}
"""Peer key name -> the wantrain key that does the same. Only names that are not wantrain keys anywhere: a name
wantrain has (``seed``, ``lr``, ``batch_size``, ``blocks_to_swap``) gets the config machinery's own "belongs at"
hint."""

NOT_NEEDED: dict[str, tuple[str, str]] = {
    "mixed_precision": (MUSUBI, "wantrain computes in bf16 always; model.base_dtype is the frozen weights' dtype"),
    "enable_bucket": (MUSUBI, "buckets are always on (data.resolutions, data.aspect_ratios, data.frames)"),
    "bucket_no_upscale": (MUSUBI, "a clip is never upscaled past its bucket: the nearest bucket is picked"),
    "sdpa": (MUSUBI, "PyTorch's scaled-dot-product attention is always used"),
    "persistent_data_loader_workers": (MUSUBI, "training reads the latent cache; there are no loader workers"),
    "max_data_loader_n_workers": (MUSUBI, "training reads the latent cache; there are no loader workers"),
    "save_state": (MUSUBI, "every checkpoint is a resumable state (checkpoint.every, --resume auto)"),
}
"""Peer keys wantrain needs no key for (what it does instead)."""


@attrs.frozen
class PeerValue:
    peer: str
    becomes: dict[str, Any]  # the wantrain keys and values that do the same (the converter writes them)
    also: str = ""  # what else to set, which the value alone does not tell
    exact: bool = True  # False: no exact equivalent; ``wantrain convert`` names it among the keys to set by hand


_SHIFT_ALSO = "model.shift = musubi-tuner's discrete_flow_shift (its default 1.0)"
PEER_VALUES: dict[str, dict[Any, PeerValue]] = {
    # musubi-tuner's --timestep_sampling (hv_train_network.py): "shift" draws sigmoid(sigmoid_scale * N(0, 1)) and
    # shifts it by discrete_flow_shift -- wantrain's "sigmoid" with model.shift, not a uniform draw
    "timestep_sampling": {
        "shift": PeerValue(MUSUBI, {"model.timestep_sampling": "sigmoid"},
                           f"model.sigmoid_scale = its sigmoid_scale (default 1.0) and {_SHIFT_ALSO}"),
        "sigma": PeerValue(MUSUBI, {"model.timestep_sampling": "uniform"}, _SHIFT_ALSO),
        "flux_shift": PeerValue(MUSUBI, {"model.timestep_sampling": "sigmoid"},
                                "model.shift = a fixed shift (wantrain has no resolution-dependent one; 3.0 is "
                                "common for Wan)", exact=False),
        "qwen_shift": PeerValue(MUSUBI, {"model.timestep_sampling": "sigmoid"},
                                "model.shift = a fixed shift (wantrain has no resolution-dependent one; 3.0 is "
                                "common for Wan)", exact=False),
    },
}
"""A wantrain key name whose value a peer spells differently (``timestep_sampling = "shift"``): the peer's
value -> what it is in wantrain. :func:`peer_value_line` says it for a config, ``wantrain convert`` writes it,
``docs/config.md`` lists it."""


def _assignments(values: dict[str, Any]) -> str:
    return " and ".join(f"{k} = {json.dumps(v)}" for k, v in values.items())


def peer_value_line(key: str, value: Any) -> str | None:
    """The line for a value of ``key`` that is a peer's spelling (musubi-tuner's ``timestep_sampling = "shift"``):
    the wantrain keys and values that do the same, and what else to set; or for musubi-tuner's prompt file given
    as ``sample.prompts``: how to convert it. ``None`` when it is neither."""
    if key == "prompts" and isinstance(value, str) and value.endswith(".txt"):
        return (f"a musubi-tuner prompt file? `wantrain convert {value}` writes its prompts as the [sample] table "
                f"to paste here ({DOCS})")
    entry = PEER_VALUES.get(key, {}).get(value) if isinstance(value, str | int | float) else None
    if entry is None:
        return None
    also = f", with {entry.also}" if entry.also else ""
    return f"{key} = {json.dumps(value)} is {entry.peer}'s; in wantrain it is {_assignments(entry.becomes)}{also}"


PROMPT_OPTIONS: dict[str, tuple[str, Any]] = {
    "w": ("width", int), "h": ("height", int), "f": ("frames", int), "d": ("seed", int), "s": ("steps", int),
    "l": ("guidance_scale", float), "n": ("negative_prompt", str), "i": ("image", str),
}
"""musubi-tuner's prompt-file options (its ``sampling_during_training.md``) -> the ``[[sample.prompts]]`` key."""

PROMPT_NOT_MAPPED = {
    "g": "embedded guidance, which Wan ignores; its CFG scale is --l",
    "fs": "wantrain samples with the variant's flow shift (Wan 2.1 VAE 3.0, TI2V-5B 5.0)",
    "cn": "control videos (Wan-Fun-Control) are not trained by wantrain",
    "ci": "control images are not trained by wantrain",
}

MUSUBI_PROMPT_DEFAULTS = {"width": 256, "height": 256, "frames": 1, "steps": 20}
"""What musubi-tuner samples with when a prompt line omits an option (wantrain's defaults are the variant's and
30 steps): written to ``[sample]`` so that the converted prompts sample as musubi-tuner did."""


DOCS = "docs/config.md, Coming from musubi-tuner or ai-toolkit"


def peer_hint(key: str, value: Any = None) -> str | None:
    """The hint for an unknown config key that is a peer's name, or for a key whose ``value`` is a peer's
    spelling (:data:`PEER_VALUES`), else ``None``."""
    line = peer_value_line(key, value)
    if line is not None:
        return line
    entry = PEER_KEYS.get(key)
    if entry is None and key in NOT_NEEDED:
        peer, why = NOT_NEEDED[key]
        return f"'{key}' is {peer}'s; wantrain needs no key for it ({why}): remove it"
    if entry is None:
        return None
    note = f" ({entry.note})" if entry.note else ""
    return f"'{key}' is {entry.peer}'s name; wantrain's key for it is '{entry.wantrain}'{note}"


def peer_arguments(extra: list[str]) -> list[str]:
    """For command-line arguments argparse did not know (``--network_dim 32 --learning_rate 1e-4``): the ``--set``
    each peer argument is in wantrain, one string each; empty when none is a peer's."""
    out = []
    for i, arg in enumerate(extra):
        name, _, inline = arg.lstrip("-").partition("=")
        entry = PEER_KEYS.get(name.replace("-", "_")) if arg.startswith("--") else None
        value = inline or (extra[i + 1] if i + 1 < len(extra) and not extra[i + 1].startswith("--") else "VALUE")
        spelled = PEER_VALUES.get(name.replace("-", "_"), {}).get(value) if arg.startswith("--") else None
        if spelled is not None:  # --timestep_sampling shift: the --set of each key it is
            sets = " ".join(f"--set {k}={json.dumps(v)}" for k, v in spelled.becomes.items())
            out.append(f"{arg.split('=')[0]} {value} is {spelled.peer}'s; wantrain's is {sets}"
                       + (f", with {spelled.also}" if spelled.also else ""))
            continue
        if entry is None:
            continue
        out.append(f"{arg.split('=')[0]} is {entry.peer}'s argument; wantrain's is --set {entry.wantrain}={value}"
                   + (f" ({entry.note})" if entry.note else ""))
    return out


def _where(keys: list[str]) -> str:
    known = [k for k in keys if k in PEER_KEYS]
    return ", ".join(f"{k} -> {PEER_KEYS[k].wantrain}" for k in known)  # every one: the list a user acts on


def _musubi_dataset_line(path: Path, data: dict[str, Any]) -> str:
    tables = [t for t in data.get("datasets") or [] if isinstance(t, dict)]
    points = []
    for t in tables:
        for key, wkey in (("video_directory", "path"), ("image_directory", "path"), ("video_jsonl_file", "metadata"),
                          ("image_jsonl_file", "metadata")):
            if isinstance(t.get(key), str):
                points.append(f'{wkey} = "{t[key]}"')
    if len(points) == 1:
        point = f"[data] {points[0]}"
    elif points:
        point = " and ".join(f"[[data.datasets]] {p}" for p in points)
    else:
        point = '[data] path = "<your clips folder>"'
    keys = _where(sorted({k for t in [data.get("general") or {}, *tables] if isinstance(t, dict) for k in t}))
    return (f"config file '{path}' is a musubi-tuner dataset config ([general], [[datasets]]), not a wantrain run "
            f"config; wantrain reads the clips and captions themselves: in a run config (start from "
            f"examples/quickstart.toml) put {point}{'; its keys go to: ' + keys if keys else ''}, or let `wantrain "
            f"convert {path}` write it ({DOCS})")


def peer_file_problem(path: Path, data: dict[str, Any] | None = None, text: str | None = None) -> str | None:
    """One line when ``path`` is a peer's config rather than a wantrain run config; ``data`` is the parsed TOML
    (``None`` when it is not TOML), ``text`` the file's text (for YAML, read without a YAML parser). ``None`` when
    it is neither."""
    if data is not None:
        if "datasets" in data and set(data) <= {"general", "datasets", "validation_datasets"}:
            return _musubi_dataset_line(path, data)
        if "general" in data and "run" not in data:
            return _musubi_dataset_line(path, data)
        peer = [k for k in data if k in PEER_KEYS and not isinstance(data[k], dict)]
        if peer and not any(isinstance(v, dict) for v in data.values()):
            return (f"config file '{path}' holds musubi-tuner training arguments ({', '.join(peer[:3])}, ...), not a "
                    f"wantrain run config (TOML tables [model], [lora], [data], [train], ...; start from "
                    f"examples/quickstart.toml); its keys go to: {_where(list(data))}; `wantrain convert {path}` "
                    f"writes the wantrain config ({DOCS})")
        return None
    if text is not None and re.search(r"^job\s*:", text, re.M) and re.search(r"^config\s*:", text, re.M):
        keys = re.findall(r"^\s*-?\s*([A-Za-z_]+)\s*:", text, re.M)
        return (f"config file '{path}' is an ai-toolkit config (job/config/process, YAML), not a wantrain run config "
                f"(TOML; start from examples/quickstart.toml); its keys go to: {_where(list(dict.fromkeys(keys)))}; "
                f"`wantrain convert {path}` writes the wantrain config ({DOCS})")
    return None


def table_markdown() -> str:
    """The migration table of ``docs/config.md``."""
    lines = [
        "## Coming from musubi-tuner or ai-toolkit",
        "",
        "A peer's key in a wantrain config is refused with the wantrain key that does the same; a musubi-tuner",
        "dataset TOML or an ai-toolkit YAML given as the config is named as such, with where its keys go. A",
        "musubi-tuner dataset needs no conversion: point `data.path` at its `video_directory` (or `data.metadata` at",
        "its `video_jsonl_file`, read as it is).",
        "",
        "| their key | from | wantrain key | note |",
        "|---|---|---|---|",
    ]
    for key, e in PEER_KEYS.items():
        how = "by hand: " if e.convert is _manual else ""
        lines.append(f"| `{key}` | {e.peer} | `{e.wantrain}` | {how}{e.note} |")
    for key, (peer, why) in NOT_NEEDED.items():
        lines.append(f"| `{key}` | {peer} | (none) | {why} |")
    lines += ["", "Values a peer spells differently, for a key wantrain has too:", "",
              "| their value | from | wantrain | also set |", "|---|---|---|---|"]
    for key, values in PEER_VALUES.items():
        for value, v in values.items():
            how = "" if v.exact else "by hand: "
            lines.append(f"| `{key} = {json.dumps(value)}` | {v.peer} | `{_assignments(v.becomes)}` | {how}{v.also} |")
    lines += ["", "`wantrain convert FILE [--dataset DATASET.toml] [-o OUT.toml]` writes a wantrain config from a",
              "musubi-tuner config (training arguments as TOML or as the `accelerate launch ... wan_train_network.py",
              "...` command line in a text file, its dataset TOML) or an ai-toolkit YAML job, printing a line for",
              "every key it did not map (\"by hand\" above, or unknown) and for every peer default it wrote out",
              "because wantrain's differs (musubi-tuner's `network_alpha` 1, its `timestep_sampling` \"sigma\";",
              "ai-toolkit's `linear_alpha` 1). Each `[[datasets]]` table stays a `[[data.datasets]]` table; a `dit`",
              "alone trains one expert (the high-noise one when its file name or `min_timestep` says so);",
              "ai-toolkit's `arch` is the variant. A diffusion-pipe config is refused in one line that names where",
              "its keys go; so is a file that is not valid TOML or YAML.", "",
              "`wantrain convert PROMPTS.txt` turns musubi-tuner's `--sample_prompts` file (one prompt a line, `#`",
              "comments) into the `[sample]` table to paste into a run config, one `[[sample.prompts]]` table per",
              "line; a training-arguments TOML whose `sample_prompts` names the file gets them too. Its options:", "",
              "| musubi-tuner | wantrain (`[[sample.prompts]]`) |", "|---|---|"]
    lines += [f"| `--{o}` | `{key}` |" for o, (key, _) in PROMPT_OPTIONS.items()]
    lines += [f"| `--{o}` | not mapped: {why} |" for o, why in PROMPT_NOT_MAPPED.items()]
    lines += ["", "A frame count not of the form 4k+1 is rounded down to one (as musubi-tuner does); an option a line",
              "omits takes musubi-tuner's default, written to `[sample]`: "
              + ", ".join(f"`{k} = {v}`" for k, v in MUSUBI_PROMPT_DEFAULTS.items()) + "."]
    return "\n".join(lines) + "\n"
