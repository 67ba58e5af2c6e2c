"""musubi-tuner to wantrain: its training arguments (a ``--config_file`` TOML, or the ``accelerate launch ...
wan_train_network.py --task t2v-A14B ...`` command line its docs print) and its dataset TOML (``[general]``,
``[[datasets]]``), keeping what each setting means:

* no ``network_alpha`` is alpha 1 in musubi-tuner (wantrain's own default is alpha = rank): written out;
* no ``timestep_sampling`` is its ``"sigma"`` (uniform, shifted by ``discrete_flow_shift``): written out;
* ``resolution = [960, 544]`` (width, height) is one area: ``resolutions = [723]`` (the same pixel count), with
  ``aspect_ratios = [960 / 544]`` when ``enable_bucket`` is off (musubi-tuner's default: every clip that shape);
* each ``[[datasets]]`` table stays a ``[[data.datasets]]`` table, ``[general]`` filling what it leaves out;
* ``dit`` alone trains one expert: the high-noise one when its file or ``min_timestep`` (at or above the boundary)
  says so, else the low-noise one; with ``dit_high_noise`` both.

Keys are the names in musubi-tuner's docs (``docs/wan.md``, ``docs/dataset_config.md``); the key table shared
with ``check``'s hints is :data:`wantrain.app.migration.PEER_KEYS`."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

from wantrain.app.conversion import Conversion, area_side, frames_4k1, shown
from wantrain.app.migration import (
    MUSUBI_PROMPT_DEFAULTS,
    NOT_NEEDED,
    PEER_KEYS,
    PEER_VALUES,
    PROMPT_NOT_MAPPED,
    PROMPT_OPTIONS,
    _assignments,
    _to,
)
from wantrain.core.errors import UserError

_BOUNDARY = {"t2v-a14b": 875, "i2v-a14b": 900}  # musubi-tuner's and wantrain's switch timestep, 0-1000 units
_WAN21_TASKS = ("t2v-1.3B", "t2v-14B", "i2v-14B", "t2i-14B", "flf2v-14B", "t2v-1.3B-FC", "t2v-14B-FC", "i2v-14B-FC")
_OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit", "prodigy": "prodigy", "prodigyopt.prodigy": "prodigy",
               "adafactor": "adafactor", "transformers.optimization.adafactor": "adafactor"}
_SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}
_OPTIMIZER_ARGS = {"weight_decay": "optimizer.weight_decay", "eps": "optimizer.eps"}
_SAME_NAME = {"seed": "run.seed", "output_dir": "run.output_dir", "gradient_checkpointing":
              "model.gradient_checkpointing", "blocks_to_swap": "model.blocks_to_swap", "guidance_scale":
              "sample.guidance_scale", "batch_size": "train.batch_size"}
"""musubi-tuner keys with a wantrain key of the same leaf name."""

LEFT_OUT = {
    "timestep_boundary": "wantrain switches experts at the variant's boundary (0.875 T2V, 0.9 I2V)",
    "preserve_distribution_shape": "wantrain draws t from its distribution and keeps those in [min_t, max_t]",
    "sample_at_first": "wantrain samples every sample.every steps, the first at step sample.every",
    "fp8_t5": "the text encoder runs once, to fill the caption cache, in bf16",
    "network_args": "no wantrain key for LoRA network arguments; lora.include / lora.exclude pick the layers",
    "lr_scheduler_num_cycles": "wantrain's cosine is one half cycle; cosine_annealing_warm_restarts_decay restarts",
    "lr_scheduler_power": "no polynomial schedule in wantrain",
    "lr_scheduler_min_lr_ratio": "set lr_scheduler.eta_min (an LR, not a ratio) by hand",
    "save_last_n_epochs": "wantrain keeps every saved LoRA; checkpoint.keep_last limits the checkpoints",
    "save_last_n_steps": "wantrain keeps every saved LoRA; checkpoint.keep_last limits the checkpoints",
    "max_frames": "wantrain cuts clips of data.frames frames",
    "source_fps": "wantrain reads each video's own frame rate",
    "logging_dir": "TensorBoard files go to the run directory's tensorboard/",
    "offload_inactive_dit": "one expert trains at a time; the other waits in host memory",
    "num_cpu_threads_per_process": "an accelerate option; wantrain is started without accelerate",
    "num_processes": "an accelerate option; several GPUs: torchrun (docs/distributed.md)",
    "vae_cache_cpu": "a caching option; wantrain caches latents itself",
}
"""musubi-tuner keys (and ``accelerate launch`` options) with no wantrain key, and why."""


def command_line(text: str) -> dict[str, Any] | None:
    """musubi-tuner's training command line (``accelerate launch [options] wan_train_network.py --key value ...``,
    ``\\`` or ``^`` line continuations) as its arguments (a flag without a value is ``true``; several values a
    list); ``None`` when ``text`` holds no ``*_train_network.py``. A value is read as TOML would (2e-4 a float)."""
    if not re.search(r"\w+_train_network\.py", text):
        return None
    try:
        words = shlex.split(re.sub(r"[\\^]\r?\n", " ", text), comments=True)
    except ValueError as exc:
        raise UserError(f"the musubi-tuner command line could not be read ({exc}); give it as one command") from None
    args: dict[str, Any] = {}
    key = None
    for word in words:
        if word.startswith("--"):
            key, _, inline = word[2:].partition("=")
            args[key] = _literal(inline) if inline else True
        elif key is not None:
            value = _literal(word)
            args[key] = value if args[key] is True else [*_as_list(args[key]), value]
        if re.search(r"_train_network\.py$", word):
            args = {k: v for k, v in args.items() if k in ("num_cpu_threads_per_process", "num_processes")}
            key = None  # accelerate's own options before the script: mixed_precision is the script's too
    return args


def _is_text(path: Path) -> bool:
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _literal(word: str) -> Any:
    try:
        return tomllib.loads(f"v = {word}")["v"]
    except tomllib.TOMLDecodeError:
        return word


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def training_arguments(args: dict[str, Any], c: Conversion, base: Path, dataset: Path | None, dash: str) -> Path | None:
    """Map musubi-tuner's training arguments into ``c`` (``dash`` is ``"--"`` for a command line, for the lines);
    the dataset TOML to read next (``dataset``, else the one ``dataset_config`` names), if any."""
    def name(key: str) -> str:
        return f"{dash}{key}"

    task = args.get("task")
    if task is not None and not isinstance(task, str):
        c.skip(name("task"), f"{name('task')} = {shown(task)}: not a task name (t2v-A14B, i2v-A14B, ti2v-5B)")
    elif task is not None:
        c.put(name("task"), "model.variant", PEER_KEYS["task"].convert(task)["model.variant"])
        if task in _WAN21_TASKS:
            c.unmapped.append(f"{name('task')} = {shown(task)}: a Wan 2.1 task, which wantrain does not train (Wan "
                              "2.2: t2v-A14B, i2v-A14B, ti2v-5B); written as model.variant so that check refuses it")
    _experts(args, c, name)
    if "network_alpha" not in args:
        c.default("lora.alpha", 1.0, "musubi-tuner's default network_alpha; wantrain's own default is alpha = rank")
    if "timestep_sampling" not in args:
        c.default("model.timestep_sampling", "uniform", "musubi-tuner's default timestep_sampling \"sigma\", "
                  "shifted by discrete_flow_shift")
    if "max_train_steps" not in args and "max_train_epochs" not in args:
        c.default("train.max_steps", 1600, "musubi-tuner's default max_train_steps")
    if "learning_rate" not in args:
        c.default("optimizer.lr", 2e-6, "musubi-tuner's default learning_rate")
    done = {"task", "dit", "dit_high_noise", "min_timestep", "max_timestep", "timestep_boundary"}
    for key, value in args.items():
        if key in done:
            continue
        if key == "optimizer_type":
            found = _OPTIMIZERS.get(str(value).lower())
            c.put(name(key), "optimizer.type", found or str(value))
            if found is None:
                c.unmapped.append(f"{name(key)} = {shown(value)}: written as optimizer.type, which check refuses "
                                  "unless it is a wantrain type (adamw, adamw8bit, prodigy, adafactor) or "
                                  "'external' with optimizer.class_path")
        elif key == "optimizer_args":
            _optimizer_args(name(key), value, c)
        elif key == "lr_scheduler":
            found = _SCHEDULERS.get(str(value))
            if found is None:
                c.skip(name(key), f"{name(key)} = {shown(value)}: no such schedule in wantrain (constant, linear, "
                                  "cosine, cosine_annealing_warm_restarts_decay); set lr_scheduler.type by hand")
            else:
                c.put(name(key), "lr_scheduler.type", found)
        elif key == "dataset_config":
            c.seen.add(name(key))
            named = base / str(value)
            if dataset is None and named.is_file():
                dataset = named
            elif dataset is None:
                c.unmapped.append(f"{name(key)} = {shown(value)}: not found beside the file; pass --dataset")
        elif key == "sample_prompts":
            c.seen.add(name(key))
            prompts = base / str(value)
            if prompts.is_file() and _is_text(prompts):
                c.flat.update({f"sample.{k}": v for k, v in prompt_file(prompts, c.unmapped).items()})
            else:
                c.unmapped.append(f"{name(key)} = {shown(value)}: not found; convert it with wantrain convert "
                                  "PROMPTS.txt")
        elif key == "fp8_base" and args.get("fp8_scaled"):
            c.seen.add(name(key))  # fp8_scaled says the rest
        else:
            map_key(name(key), key, value, c)
    return dataset


def map_key(source: str, key: str, value: Any, c: Conversion) -> None:
    """One peer key through the shared tables: a value a peer spells differently, :data:`PEER_KEYS`, a wantrain
    key of the same name, :data:`NOT_NEEDED` or :data:`LEFT_OUT`; else a line saying no key is known."""
    entry = PEER_KEYS.get(key)
    spelled = PEER_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
    if spelled is not None:
        for wkey, v in spelled.becomes.items():
            c.put(source, wkey, v)
        if not spelled.exact:
            c.unmapped.append(f"{source} = {shown(value)}: converted to {_assignments(spelled.becomes)}; set "
                              f"{spelled.also}")
    elif entry is not None:
        try:
            found = (entry.convert or _to(entry.wantrain))(value)
        except (TypeError, ValueError, ZeroDivisionError):  # a value of a type the peer would refuse too
            found = {}
        if not found:
            c.skip(source, f"{source} = {shown(value)}: not converted; set {entry.wantrain} by hand"
                   + (f" ({entry.note})" if entry.note else ""))
        for wkey, v in found.items():
            c.put(source, wkey, v)
    elif key in _SAME_NAME:
        c.put(source, _SAME_NAME[key], value)
    elif key in NOT_NEEDED or key in LEFT_OUT:
        why = NOT_NEEDED[key][1] if key in NOT_NEEDED else LEFT_OUT[key]
        c.skip(source, f"{source} = {shown(value)}: left out ({why})")
    else:
        c.skip(source, f"{source} = {shown(value)}: no wantrain key known for it")


def _experts(args: dict[str, Any], c: Conversion, name: Any) -> None:
    """``dit``/``dit_high_noise`` and the timestep range: which expert trains, from which file."""
    variant = c.flat.get("model.variant", "t2v-a14b")  # musubi-tuner's --task is required
    boundary = _BOUNDARY.get(variant)
    low, high = args.get("min_timestep"), args.get("max_timestep")
    for key, value in (("min_timestep", low), ("max_timestep", high)):
        if isinstance(value, int | float):
            c.put(name(key), f"model.{key[:3]}_t", value / 1000)
    given = args.get("timestep_boundary")
    if given is not None:
        at = given * 1000 if isinstance(given, float) and given <= 1 else given
        if boundary is not None and at == boundary:
            c.seen.add(name("timestep_boundary"))  # the variant's own: nothing to write
        else:
            c.skip(name("timestep_boundary"), f"{name('timestep_boundary')} = {shown(given)}: left out "
                   f"({LEFT_OUT['timestep_boundary']})")
    dit, dit_high = args.get("dit"), args.get("dit_high_noise")
    if dit_high is not None:
        c.put(name("dit_high_noise"), "model.high_noise_file", dit_high)
    if dit is None:
        return
    if boundary is None:  # TI2V-5B: one transformer
        c.put(name("dit"), "model.transformer_file", dit)
        return
    if dit_high is not None:
        c.put(name("dit"), "model.low_noise_file", dit)
        return
    high_noise = "high_noise" in Path(str(dit)).name.lower() or (isinstance(low, int | float) and low >= boundary)
    expert = "high_noise" if high_noise else "low_noise"
    c.put(name("dit"), f"model.{expert}_file", dit)
    c.put(name("dit"), "model.experts", expert)
    if not high_noise and not (isinstance(high, int | float) and high <= boundary):
        c.unmapped.append(f"{name('dit')} = {shown(dit)} alone: musubi-tuner trains that one DiT at every timestep; "
                          f"wantrain trains it as the low-noise expert, below the boundary ({boundary / 1000}) only")


def _optimizer_args(source: str, value: Any, c: Conversion) -> None:
    """``optimizer_args = ["weight_decay=0.01", "betas=(0.9,0.99)"]``: each one its [optimizer] key."""
    c.seen.add(source)
    for item in _as_list(value):
        key, _, raw = str(item).partition("=")
        key, raw = key.strip(), raw.strip()
        numbers = [float(x) for x in re.findall(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?", raw)]
        if key in _OPTIMIZER_ARGS and len(numbers) == 1:
            c.put(source, _OPTIMIZER_ARGS[key], numbers[0])
        elif key == "betas" and len(numbers) == 2:
            c.put(source, "optimizer.beta1", numbers[0])
            c.put(source, "optimizer.beta2", numbers[1])
        else:
            c.unmapped.append(f"{source} {shown(item)}: no wantrain [optimizer] key known for it")


def prompt_file(path: Path, unmapped: list[str]) -> dict[str, Any]:
    """musubi-tuner's ``--sample_prompts`` text file (one prompt a line, ``--w 832 --h 480 --f 81 --s 20 --d 42
    --n negative`` options after it, ``#`` comments) as wantrain's ``[sample]`` table (``sample.prompts`` tables,
    nested form); an option it cannot map gets a line in ``unmapped``. A frame count not of the form 4k+1 is rounded
    down to one, as musubi-tuner does."""
    prompts: list[dict[str, Any]] = []
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        text, *options = line.split(" --")
        prompt: dict[str, Any] = {"prompt": text.strip()}
        for option in options:
            name, _, value = option.strip().partition(" ")
            value = value.strip()
            where = f"{Path(path).name} line {number}: --{name} {value}".rstrip()
            if name in PROMPT_OPTIONS:
                key, kind = PROMPT_OPTIONS[name]
                try:
                    prompt[key] = kind(value)
                except ValueError:
                    unmapped.append(f"{where}: not a {kind.__name__}; left out")
                    continue
                if key == "frames" and (prompt[key] - 1) % 4:
                    prompt[key] = max(1, (prompt[key] - 1) // 4 * 4 + 1)
                    unmapped.append(f"{where}: frames = {prompt[key]} (wantrain samples 4k+1 frames)")
            elif name:
                why = PROMPT_NOT_MAPPED.get(name, "no wantrain option known for it")
                unmapped.append(f"{where}: left out ({why})")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"'{path}' holds no prompt (one a line; '#' starts a comment); give musubi-tuner's "
                        "--sample_prompts file")
    section: dict[str, Any] = {"enabled": True}
    section.update({k: v for k, v in MUSUBI_PROMPT_DEFAULTS.items() if any(k not in p for p in prompts)})
    section["prompts"] = prompts
    return section


# -- the dataset TOML ---------------------------------------------------------------------------------------------
_PER_DATASET = {"video_directory": "path", "image_directory": "path", "video_jsonl_file": "metadata",
                "image_jsonl_file": "metadata", "num_repeats": "repeats", "caption_extension": "caption_extension",
                "resolution": "resolutions", "target_frames": "frames", "frame_extraction": "clip_mode"}
_PER_RUN = {"cache_directory": "data.cache_dir", "frame_stride": "data.clip_stride",
            "frame_sample": "data.clips_per_video", "batch_size": "train.batch_size"}
_HANDLED = {"enable_bucket", "source_fps", "max_frames"}


def dataset_tables(data: dict[str, Any], c: Conversion) -> None:
    """musubi-tuner's dataset TOML into ``c``: one ``[[datasets]]`` as ``[data]`` keys, several as
    ``[[data.datasets]]`` tables; ``[general]`` fills what a table leaves out, as in musubi-tuner."""
    general = data.get("general") or {}
    if not isinstance(general, dict) or not isinstance(data.get("datasets", []), list):
        raise UserError("a musubi-tuner dataset config has a [general] table and [[datasets]] tables; this file's "
                        "are not tables")
    tables, per_run = [], {}
    for i, raw in enumerate(data.get("datasets") or []):
        where = f"[[datasets]][{i}] "
        if not isinstance(raw, dict):
            c.skip(f"[[datasets]][{i}]", f"[[datasets]][{i}] = {shown(raw)}: not a table; left out")
            continue
        merged = {**{k: (f"[general] {k}", v) for k, v in general.items()},
                  **{k: (f"{where}{k}", v) for k, v in (raw or {}).items()}}
        tables.append(_one_dataset(merged, c, per_run))
    for key, values in per_run.items():
        distinct = list(dict.fromkeys(shown(v) for _, v in values))
        c.put(values[0][0], key, values[0][1])
        for source, _ in values:
            c.seen.add(source)
        if len(distinct) > 1:
            c.unmapped.append(f"{key}: the datasets give {', '.join(distinct)}; wantrain has one for the run: "
                              f"{distinct[0]} written")
    for i, _ in enumerate(data.get("validation_datasets") or []):
        c.skip(f"[[validation_datasets]][{i}]", f"[[validation_datasets]][{i}]: not converted; set [validation] "
               "path by hand")
    if len(tables) == 1:
        c.flat.update({f"data.{k}": v for k, v in tables[0].items()})
    elif tables:
        c.datasets.extend(tables)
    if tables and "general" in data:  # named, so that a [general] with nothing but per-dataset keys counts
        c.seen.update(f"[general] {k}" for k in general)


def _one_dataset(merged: dict[str, tuple[str, Any]], c: Conversion, per_run: dict[str, list]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    value_of = {k: v for k, (_, v) in merged.items()}
    extraction = None
    for key, (source, value) in merged.items():
        if key == "resolution":
            side = area_side(value)
            if side is None:
                c.skip(source, f"{source} = {shown(value)}: not a width and height; set resolutions by hand")
                continue
            c.seen.add(source)
            table["resolutions"] = [side]
            if not value_of.get("enable_bucket") and isinstance(value, list):  # musubi-tuner's default: no buckets
                per_run.setdefault("data.aspect_ratios", []).append((source, [round(value[0] / value[1], 4)]))
        elif key == "target_frames" and not all(isinstance(f, int) for f in _as_list(value)):
            c.skip(source, f"{source} = {shown(value)}: not frame counts; set frames by hand")
        elif key == "target_frames":
            frames = [frames_4k1(f) for f in _as_list(value)]
            c.seen.add(source)
            table["frames"] = list(dict.fromkeys(frames))
            if frames != _as_list(value):
                c.unmapped.append(f"{source} = {shown(value)}: frames = {table['frames']} (4k+1, as musubi-tuner "
                                  "truncates them)")
        elif key == "frame_extraction":
            extraction = (source, value)  # read once the frame counts are
        elif key == "caption_extension":
            c.seen.add(source)
            table["caption_extension"] = value if str(value).startswith(".") else f".{value}"
        elif key in _PER_DATASET:
            c.seen.add(source)
            table[_PER_DATASET[key]] = value
        elif key in _PER_RUN:
            per_run.setdefault(_PER_RUN[key], []).append((source, value))
        elif key == "enable_bucket":  # on: wantrain's buckets; off: the resolution's aspect ratio, written with it
            c.seen.add(source)
        elif key == "source_fps":
            per_run.setdefault("data.retime", []).append((source, "resample"))
        elif key == "max_frames" and value_of.get("frame_extraction") == "full":
            c.seen.add(source)
        else:
            map_key(source, key, value, c)
    if extraction is not None:
        _clip_mode(*extraction, value_of, table, c, per_run)
    if any(k in value_of for k in ("video_directory", "video_jsonl_file")) and "source_fps" not in value_of:
        # without source_fps musubi-tuner uses every frame, whatever the video's rate
        per_run.setdefault("data.retime", []).append(("", "off"))
    return table


def _clip_mode(source: str, value: Any, value_of: dict[str, Any], table: dict[str, Any], c: Conversion,
               per_run: dict[str, list]) -> None:
    if value in ("head", "uniform", "slide"):
        c.seen.add(source)
        table["clip_mode"] = value
    elif value == "chunk" and len(table.get("frames") or []) == 1:
        n = table["frames"][0]
        c.seen.add(source)
        table["clip_mode"] = "slide"
        per_run.setdefault("data.clip_stride", []).append((source, n))  # chunks of n: a window every n frames
    elif value == "full" and isinstance(value_of.get("max_frames"), int):
        n = frames_4k1(value_of["max_frames"])
        table.update(clip_mode="head", frames=[n])
        c.skip(source, f"{source} = \"full\" (max_frames = {value_of['max_frames']}): written as clip_mode = \"head\" "
               f"with frames = [{n}]; wantrain cuts clips of the frame buckets, and a video shorter than {n} frames "
               "goes to a smaller bucket of data.frames or is skipped")
    else:
        c.skip(source, f"{source} = {shown(value)}: no such clip mode in wantrain (head, uniform, slide); set "
               "data.clip_mode by hand")
