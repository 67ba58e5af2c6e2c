"""ai-toolkit to wantrain: its YAML job (``config.process[0]``: ``network``, ``save``, ``datasets``, ``train``,
``model``, ``sample``), key by key through :data:`KEYS` (the path under the process -> what it is in wantrain),
keeping what each setting means:

* ``model.arch`` is the variant (``wan22_14b`` T2V-A14B, its I2V twin when the model's name says I2V,
  ``wan22_5b`` TI2V-5B); a Wan 2.1 architecture is written as given so that ``check`` refuses it, with a line;
* no ``network.linear_alpha`` is alpha 1.0 in ai-toolkit (its ``alpha`` default): written out;
* ``datasets[].resolution`` are area budgets (square sides), as wantrain's ``resolutions``; each dataset stays
  a ``[[data.datasets]]`` table when there are several;
* ``train.optimizer: "adamw8bit"`` is ``optimizer.type``, ``train.lr`` ``optimizer.lr``.

Keys are the names of ai-toolkit's ``config/examples/train_lora_wan22_14b_24gb.yaml`` and its Wan 2.1 twin."""

from __future__ import annotations

import re
from typing import Any

from wantrain.app.conversion import Conversion, area_side, frames_4k1, shown
from wantrain.core.errors import UserError

_YAML_FLOAT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")
_ARCH = {"wan22_14b": "t2v-a14b", "wan22_14b_i2v": "i2v-a14b", "wan22_5b": "ti2v-5b"}
_TIMESTEPS = {"linear": "uniform", "sigmoid": "sigmoid"}


def _caption_extension(v: Any) -> str:
    return str(v) if str(v).startswith(".") else f".{v}"


KEYS: dict[str, tuple[str, Any] | str] = {
    # path under config.process[0] -> (wantrain key, value function or None) | why it is left out
    "type": "the job type (sd_trainer): wantrain trains LoRAs",
    "training_folder": ("run.output_dir", None),
    "device": ("train.device", None),
    "trigger_word": ("data.caption_prefix", lambda v: f"{v}, "),
    "performance_log_every": "wantrain's progress line shows the speed (train.log_every sets how often it logs)",
    "network.type": ("lora.type", None),
    "network.linear": ("lora.rank", None),
    "network.linear_alpha": ("lora.alpha", None),
    "save.dtype": "wantrain saves the LoRA in bf16 or fp32 (lora.save_dtype; bf16 unless set)",
    "save.save_every": ("train.save_every", None),
    "save.max_step_saves_to_keep": "wantrain keeps every saved LoRA; checkpoint.keep_last limits the checkpoints",
    "save.push_to_hub": "wantrain uploads nothing",
    "datasets.folder_path": ("path", None),
    "datasets.caption_ext": ("caption_extension", _caption_extension),
    "datasets.caption_dropout_rate": ("caption_dropout", None),
    "datasets.shuffle_tokens": ("tag_shuffles", int),
    "datasets.cache_latents_to_disk": "wantrain always caches latents (data.cache_dir)",
    "datasets.num_frames": ("frames", lambda v: [frames_4k1(v)]),
    "datasets.resolution": ("resolutions", lambda v: [area_side(r) for r in (v if isinstance(v, list) else [v])]),
    "train.batch_size": ("train.batch_size", None),
    "train.steps": ("train.max_steps", None),
    "train.gradient_accumulation": ("train.grad_accum", None),
    "train.train_unet": "wantrain trains the transformer's LoRA always",
    "train.train_text_encoder": "wantrain never trains the text encoder",
    "train.gradient_checkpointing": ("model.gradient_checkpointing", None),
    "train.noise_scheduler": "wantrain trains flow matching always",
    "train.timestep_type": ("model.timestep_sampling", _TIMESTEPS.get),
    "train.optimizer": ("optimizer.type", lambda v: str(v).lower()),
    "train.lr": ("optimizer.lr", float),
    "train.optimizer_params.weight_decay": ("optimizer.weight_decay", float),
    "train.optimizer_params.eps": ("optimizer.eps", float),
    "train.dtype": "wantrain computes in bf16 always; model.base_dtype is the frozen weights' dtype",
    "train.switch_boundary_every": ("model.switch_every", None),
    "train.cache_text_embeddings": "wantrain always caches the caption embeddings",
    "train.unload_text_encoder": "wantrain encodes every caption once and frees the text encoder; captions are "
                                 "kept (trigger_word: data.caption_prefix)",
    "train.skip_first_sample": "wantrain samples every sample.every steps, the first at step sample.every",
    "train.disable_sampling": ("sample.enabled", lambda v: not v),
    "train.ema_config.use_ema": "wantrain keeps no EMA of the LoRA",
    "train.ema_config.ema_decay": "wantrain keeps no EMA of the LoRA",
    "model.name_or_path": ("model.path", None),
    "model.quantize": ("model.base_dtype", lambda v: "fp8" if v else None),
    "model.quantize_te": "the text encoder runs once, to fill the caption cache, in bf16",
    "model.qtype_te": "the text encoder runs once, to fill the caption cache, in bf16",
    "model.low_vram": "wantrain plans memory itself (model.vram_budget_gb, blocks_to_swap)",
    "sample.sampler": "wantrain samples with the variant's flow-matching sampler",
    "sample.sample_every": ("sample.every", None),
    "sample.sample_start_step": "wantrain samples every sample.every steps, the first at step sample.every",
    "sample.width": ("sample.width", None),
    "sample.height": ("sample.height", None),
    "sample.num_frames": ("sample.frames", frames_4k1),
    "sample.fps": ("sample.fps", None),
    "sample.prompts": ("sample.prompts", lambda v: [str(p) for p in v]),
    "sample.neg": ("sample.negative_prompt", None),
    "sample.seed": ("sample.seed", None),
    "sample.walk_seed": "wantrain samples every prompt with sample.seed (or its own seed), not seed + index",
    "sample.guidance_scale": ("sample.guidance_scale", float),
    "sample.sample_steps": ("sample.steps", None),
}


def _walk(table: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in table.items():
        if isinstance(value, str) and _YAML_FLOAT.fullmatch(value):
            value = float(value)  # PyYAML reads YAML 1.1: "1e-4" (no dot) is a string there
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in KEYS and path != "model.model_kwargs":
            _walk(value, f"{path}.", out)
        else:
            out[path] = value


def convert_yaml(doc: Any, c: Conversion) -> None:
    """ai-toolkit's job ``doc`` (parsed YAML) into ``c``."""
    config = doc.get("config") if isinstance(doc, dict) else None
    processes = config.get("process") if isinstance(config, dict) else None
    if not isinstance(processes, list) or not processes or not isinstance(processes[0], dict):
        raise UserError("not an ai-toolkit job: it has no config.process list (job: extension, config: name, "
                        "process: [...])")
    for i, _ in enumerate(processes[1:], 1):
        c.skip(f"config.process[{i}]", f"config.process[{i}]: a second process; wantrain converts the first only")
    if "name" in config:
        c.put("config.name", "run.name", config["name"])
    for key in doc:
        if key not in ("job", "config"):
            c.skip(key, f"{key}: left out (ai-toolkit's metadata of the job)")
    c.seen.add("job")
    flat: dict[str, Any] = {}
    _walk({k: v for k, v in processes[0].items() if k != "datasets"}, "", flat)
    for path, value in flat.items():
        if path == "model.arch":
            _arch(value, flat.get("model.name_or_path"), c)
        elif path == "model.qtype":
            c.skip(path, f"model.qtype = {shown(value)}: wantrain's low-bit base is fp8 (model.base_dtype = "
                   "\"fp8\", written for quantize: true); a 4-bit base or an accuracy recovery adapter it has not")
        elif path == "model.model_kwargs":
            _experts(value, c)
        else:
            _key(path, path, value, c.flat, c)
    if "network.linear_alpha" not in flat:
        c.default("lora.alpha", 1.0, "ai-toolkit's default linear_alpha; wantrain's own default is alpha = rank")
    if "train.timestep_type" not in flat:
        c.default("model.timestep_sampling", "sigmoid", "ai-toolkit's default timestep_type")
    if flat.get("sample.prompts") and not flat.get("train.disable_sampling"):
        c.flat.setdefault("sample.enabled", True)  # ai-toolkit samples whenever it has prompts
    _datasets(processes[0].get("datasets") or [], c)


def _key(source: str, path: str, value: Any, out: dict[str, Any], c: Conversion) -> None:
    rule = KEYS.get(path)
    if isinstance(rule, str):
        c.skip(source, f"{source} = {shown(value)}: left out ({rule})")
        return
    if rule is None:
        c.skip(source, f"{source} = {shown(value)}: no wantrain key known for it")
        return
    key, fn = rule
    try:
        converted = fn(value) if fn is not None else value
    except (TypeError, ValueError):
        converted = None
    if converted is None or (isinstance(converted, list) and None in converted):
        c.skip(source, f"{source} = {shown(value)}: not converted; set {key} by hand")
        return
    c.seen.add(source)
    out[key] = converted
    if path.endswith("num_frames") and converted != ([value] if path.startswith("datasets") else value):
        c.unmapped.append(f"{source} = {value}: {key} = {converted} (wantrain's frame counts are 4k+1)")
    if path == "trigger_word":
        c.unmapped.append(f"{source} = {shown(value)}: written as data.caption_prefix = {shown(converted)}, put in "
                          "front of every caption (ai-toolkit adds it only where a caption lacks it, or replaces "
                          "[trigger])")
    if path == "model.name_or_path" and not str(value).startswith(("/", ".", "~")) and re.fullmatch(r"[\w.-]+/[\w.-]+",
                                                                                                   str(value)):
        c.unmapped.append(f"{source} = {shown(value)}: a Hugging Face repo id; wantrain reads a local folder: "
                          "download it and set model.path to that folder")


def _arch(value: Any, name: Any, c: Conversion) -> None:
    arch = str(value)
    if arch == "wan22_14b" and "i2v" in str(name).lower():
        arch = "wan22_14b_i2v"
    variant = _ARCH.get(arch)
    if variant is not None:
        c.put("model.arch", "model.variant", variant)
        return
    c.put("model.arch", "model.variant", arch)
    c.unmapped.append(f"model.arch = {shown(value)}: not a Wan 2.2 model wantrain trains (wan22_14b, wan22_14b_i2v, "
                      "wan22_5b); written as model.variant so that check refuses it")


def _experts(kwargs: Any, c: Conversion) -> None:
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    high, low = kwargs.get("train_high_noise", True), kwargs.get("train_low_noise", True)
    for key in kwargs:
        if key not in ("train_high_noise", "train_low_noise"):
            c.skip(f"model.model_kwargs.{key}", f"model.model_kwargs.{key} = {shown(kwargs[key])}: no wantrain key "
                   "known for it")
    c.seen.update(f"model.model_kwargs.{k}" for k in ("train_high_noise", "train_low_noise") if k in kwargs)
    if high and low:
        c.put("model.model_kwargs", "model.experts", "both")
    elif high or low:
        c.put("model.model_kwargs", "model.experts", "high_noise" if high else "low_noise")
    else:
        c.skip("model.model_kwargs", "model.model_kwargs: neither expert trained; model.experts left at \"both\"")


def _datasets(datasets: Any, c: Conversion) -> None:
    tables = []
    if not isinstance(datasets, list):
        c.skip("datasets", f"datasets = {shown(datasets)}: not a list of datasets; left out")
        datasets = []
    for i, d in enumerate(datasets):
        table: dict[str, Any] = {}
        if not isinstance(d, dict):
            c.skip(f"datasets[{i}]", f"datasets[{i}] = {shown(d)}: not a dataset table; left out")
            continue
        for key, value in d.items():
            if isinstance(value, str) and _YAML_FLOAT.fullmatch(value):
                value = float(value)
            _key(f"datasets[{i}].{key}", f"datasets.{key}", value, table, c)
        tables.append(table)
    if len(tables) == 1:
        c.flat.update({f"data.{k}": v for k, v in tables[0].items()})
    elif tables:
        c.datasets.extend(tables)
