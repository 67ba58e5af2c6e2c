"""Where the weights come from: a local diffusers-format directory, single-file transformer checkpoints, or the
tiny random twins. Nothing here touches the network (every ``from_pretrained`` is ``local_files_only``).

A :class:`WeightSource` checks up front that every part the run will need exists (one-line ``UserError`` naming
the missing part), and can compute the encoders' identity from file sizes and times without loading anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from wantrain.core.errors import UserError
from wantrain.models.wan22 import architecture, model_files, sharded
from wantrain.models.wan22.config import ModelConfig
from wantrain.models.wan22.lowbit import LOW_BIT_DTYPES
from wantrain.models.wan22.variants import VARIANTS, VariantSpec

# diffusers folder of each expert; the high-noise expert is ``transformer`` (it also holds the 5B model).
EXPERT_FOLDER = {"high_noise": "transformer", None: "transformer", "low_noise": "transformer_2"}
_EXPERT_FILE_KEY = {"high_noise": "high_noise_file", "low_noise": "low_noise_file", None: "transformer_file"}
_ENCODER_PARTS = ("vae", "text_encoder", "tokenizer")
_ROLE = {"high_noise": "the high-noise expert", "low_noise": "the low-noise expert"}


class WeightSource:
    """Loads the components of one variant. ``experts`` are the transformers the run trains."""

    def __init__(self, model: ModelConfig, seed: int) -> None:
        self.spec: VariantSpec = VARIANTS[model.variant]
        self.model = model
        self.seed = seed
        self.experts = model.trained_experts
        self.path = Path(model.path).expanduser() if model.path is not None else None
        self.random = self.spec.tiny and self.path is None and not any(
            getattr(model, _EXPERT_FILE_KEY[e]) is not None for e in self.experts
        ) and not model_files.everything_from_files(model)
        if not self.random:
            self._check()

    # -- checks --------------------------------------------------------------------------------------------
    def _check(self) -> None:
        model_files.check_files(self.model, self.spec)  # vae_file, text_encoder_file, tokenizer_path, expert files
        if self.path is None and model_files.everything_from_files(self.model):
            return
        if self.path is None:
            raise UserError(
                f"model.path is required for {self.spec.name}: point it at a local diffusers-format directory "
                "with vae/, text_encoder/ and tokenizer/ (and the transformer folders), or give every part as a "
                "file (model.vae_file, model.text_encoder_file, model.tokenizer_path and each expert's *_file)"
            )
        if not self.path.is_dir():
            raise UserError(f"model.path '{self.path}' is not a directory (expected a diffusers-format model folder)")
        for expert in self.experts:
            if self._expert_file(expert) is None:  # a file or folder of shards: checked by model_files.check_files
                why = f"needed with model.experts = '{self.model.experts}'" if expert else "needed to train"
                self._check_expert_folder(expert, why)
        if self.model.vae_file is None:
            self._check_vae_folder()
        if self.model.text_encoder_file is None:
            self._require("text_encoder", "the UMT5 text encoder")
        if self.model.tokenizer_path is None and not any(
                (self.path / "tokenizer" / n).is_file() for n in model_files.TOKENIZER_FILES):
            raise UserError(
                f"model.path '{self.path}' has no tokenizer/ folder with tokenizer files (the UMT5 tokenizer)"
            )

    def _check_vae_folder(self) -> None:
        self._require("vae", "the VAE")
        vae_z = self._read_config("vae").get("z_dim")
        if vae_z != self.spec.latent_channels:
            raise UserError(
                f"model.path '{self.path}': vae/config.json has z_dim = {vae_z}, but {self.spec.name} uses the "
                f"{self.spec.vae} VAE with {self.spec.latent_channels} latent channels"
            )

    def check_expert(self, expert: str | None, why: str) -> None:
        """Refuse, in one line, a missing or unusable transformer of an expert the run does not train but needs
        (the other A14B expert for sampling), from the same kinds of source as a trained one: its
        ``model.*_file`` (one file, or the original repos' folder of shards), else its folder in ``model.path``;
        ``why`` says what it is needed for. Nothing to check for the tiny random twins."""
        if self.random:
            return
        key = _EXPERT_FILE_KEY[expert]
        if self._expert_file(expert) is not None:
            model_files.check_expert_source(self.model, expert)
            return
        if self.path is None:
            raise UserError(
                f"model.{key} or model.path is needed for {_ROLE.get(expert, 'the transformer')} ({why}): give "
                "its file (or folder of shards), or a diffusers-format model folder"
            )
        self._check_expert_folder(expert, why)

    def _check_expert_folder(self, expert: str | None, why: str) -> None:
        folder = EXPERT_FOLDER[expert]
        self._require(folder, f"{_ROLE.get(expert, 'the transformer')}, {why}; or set model.{_EXPERT_FILE_KEY[expert]}")
        self._check_transformer_config(folder)

    def _check_transformer_config(self, folder: str) -> None:
        """Every architecture key of ``folder/config.json`` must equal the variant's (``architecture.py``); keys
        the file leaves out take diffusers' defaults. A Wan 2.1 I2V-14B folder has the same 36 input channels as
        I2V-A14B but sets ``image_dim`` / ``added_kv_proj_dim`` (its CLIP image branch)."""
        config = self._read_config(folder)
        defaults = architecture.transformer_defaults(self.spec)
        differ = []
        for key, want in architecture.transformer_kwargs(self.spec).items():
            have = config.get(key, defaults.get(key))
            if _normalise(have) != _normalise(want):
                differ.append(f"{key} = {have!r} (needs {want!r})")
        if differ:
            hint = (" (image_dim is set: a Wan 2.1 image-to-video model; Wan 2.2 has no CLIP image branch)"
                    if config.get("image_dim") is not None else "")
            raise UserError(
                f"model.path '{self.path}': {folder}/config.json does not match {self.spec.name}: "
                f"{', '.join(differ)}{hint}; is this the right model?"
            )

    def _require(self, folder: str, what: str) -> None:
        assert self.path is not None
        if not (self.path / folder / "config.json").is_file():
            missing = f"{folder}/" if not (self.path / folder).is_dir() else f"{folder}/config.json"
            raise UserError(f"model.path '{self.path}' is missing {missing} ({what})")

    def _read_config(self, folder: str) -> dict:
        assert self.path is not None
        try:
            return json.loads((self.path / folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"model.path '{self.path}': {folder}/config.json is not readable JSON ({exc})") from None

    def _expert_file(self, expert: str | None) -> Path | None:
        value = getattr(self.model, _EXPERT_FILE_KEY[expert])
        return Path(value).expanduser() if value is not None else None

    # -- identity ------------------------------------------------------------------------------------------
    @property
    def encoder_identity(self) -> str:
        """Identity of the VAE + text encoder + tokenizer, computed without loading them: the variant plus the
        seed and architecture hash (tiny random) or every file's relative path, size and mtime (directory)."""
        files = model_files.files_digest(self.model)  # model.vae_file, text_encoder_file, tokenizer_path
        if self.random or (self.path is None and not files):
            arch = architecture.tiny_config_hash(self.spec)
            return f"wan22:{self.spec.name}:tiny-random:seed={self.seed}:arch={arch}"
        if self.path is None:
            return f"wan22:{self.spec.name}:files:{files}"
        digest = hashlib.sha256()
        replaced = {"vae": self.model.vae_file, "text_encoder": self.model.text_encoder_file,
                    "tokenizer": self.model.tokenizer_path}
        digest.update(files.encode())
        for part in _ENCODER_PARTS:
            if replaced[part] is not None:
                continue
            for file in sorted(p for p in (self.path / part).rglob("*") if p.is_file()):
                stat = file.stat()
                digest.update(f"{file.relative_to(self.path)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        return f"wan22:{self.spec.name}:{self.path.resolve()}:{digest.hexdigest()[:16]}"

    def transformer_identity(self, expert: str | None) -> str:
        """What decides ``expert``'s loaded base weights, read without loading them: the tiny twin's variant, seed
        and architecture hash, or every file of its source (``model.*_file``, a folder of shards, its folder in
        ``model.path``) with its resolved path, size and modification time."""
        if self.random:
            arch = architecture.tiny_config_hash(self.spec)
            return f"wan22:{self.spec.name}:{expert}:tiny-random:seed={self.seed}:arch={arch}"
        source = self._expert_file(expert)
        if source is None:
            assert self.path is not None
            source = self.path / EXPERT_FOLDER[expert]
        files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
        digest = hashlib.sha256()
        for file in files:
            stat = file.stat()
            digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        return f"wan22:{self.spec.name}:{expert}:{digest.hexdigest()[:16]}"

    # -- loading -------------------------------------------------------------------------------------------
    def transformer(self, expert: str | None, dtype: torch.dtype, quantise_on: torch.device | None = None):
        """A fresh base transformer of ``expert`` in ``dtype`` on the CPU (call again for an identical copy). Files
        and folders stream tensor by tensor into the dtypes a run trains in (``single_file.py``); with
        ``model.base_dtype = "fp8"`` the Linears diffusers' layerwise casting stores in float8 arrive in float8, so
        the host never holds the expert in bf16 (it would be 2x the fp8 expert: 28.6 GB for one A14B expert).
        With ``model.base_dtype = "fp8_scaled"`` the block Linears are read straight into scaled fp8 (``fp8.py``),
        keeping an ``fp8_scaled`` file's own scales. With ``"int8"`` / ``"nf4"`` they are quantised as they are read
        (on ``quantise_on``, default the CPU), so the host never holds the expert in bf16 either (the tiny twins
        are quantised once built, by the adapter)."""
        if self.random:
            transformer = architecture.tiny_transformer(self.spec, self.seed, expert)
            return architecture.cast_keeping_fp32_modules(transformer, dtype)
        file = self._expert_file(expert)
        if file is not None:
            return self._single_file(file, expert, dtype, quantise_on)
        assert self.path is not None
        folder = self.path / EXPERT_FOLDER[expert]
        return self._stream(folder, "path", dtype, key_map=lambda keys: {k: k for k in keys}, quantise_on=quantise_on)

    def meta_transformer(self, dtype: torch.dtype):
        """The architecture of this variant's transformer built on ``meta`` (no storage), each tensor in the dtype
        :meth:`transformer` would load it in (``dtype``; fp32 for ``_keep_in_fp32_modules``): what a rank other
        than 0 builds under ``model.parallel = "fsdp"`` before its shards are filled from rank 0's
        (``core.parallel.sharding.load_from_rank0``). Reads no file."""
        with torch.device("meta"):
            transformer = architecture.transformer_class(self.spec)(**architecture.transformer_kwargs(self.spec))
        return architecture.cast_keeping_fp32_modules(transformer, dtype).eval()

    def check_expert_files(self) -> None:
        """The trained experts' ``model.*_file`` against the variant's transformer by tensor names (headers only):
        what loading them refuses first (a VAE given as an expert file), for ``wantrain check``."""
        from wantrain.models.wan22.single_file import check_transformer_keys

        kwargs, cls = architecture.transformer_kwargs(self.spec), architecture.transformer_class(self.spec)
        for expert in () if self.random else self.experts:
            file = self._expert_file(expert)
            if file is None:
                continue
            key = _EXPERT_FILE_KEY[expert]
            _refuse_wan21_image_branch(file, key, self.spec.name)
            reader = sharded.ShardReader(file, key) if file.is_dir() else None
            check_transformer_keys(file, key, self.spec.name, lambda: cls(**kwargs), reader=reader)

    def _single_file(self, file: Path, expert: str | None, dtype: torch.dtype, quantise_on: torch.device | None):
        """Original-Wan or ComfyUI keys, read with the variant's explicit architecture (diffusers' own detection
        only knows Wan 2.1 and would build I2V/5B files with the wrong config), streamed tensor by tensor into the
        dtypes of the folder path (``single_file.py``: float32 for ``_keep_in_fp32_modules``, ``dtype`` else).
        An original-repo expert folder (shards + index) streams shard by shard (``sharded.ShardReader``)."""
        key = _EXPERT_FILE_KEY[expert]
        _refuse_wan21_image_branch(file, key, self.spec.name)
        return self._stream(file, key, dtype, quantise_on=quantise_on)

    def _stream(self, source: Path, key: str, dtype: torch.dtype, key_map=None, quantise_on=None):
        from wantrain.models.wan22.single_file import load_transformer

        kwargs, cls = architecture.transformer_kwargs(self.spec), architecture.transformer_class(self.spec)

        def build():
            return cls(**kwargs)

        store = fp8_stored(build) if self.model.base_dtype == "fp8" else None
        reader = sharded.ShardReader(source, key) if source.is_dir() else None
        return load_transformer(source, key, self.spec.name, build, dtype, reader=reader, key_map=key_map,
                                store=store, fp8_scaled=self.model.base_dtype == "fp8_scaled",
                                low_bit=self.model.base_dtype if self.model.base_dtype in LOW_BIT_DTYPES else None,
                                quantise_on=quantise_on)

    def vae(self):
        from diffusers import AutoencoderKLWan

        if self.model.vae_file is not None and not self.random:
            from wantrain.models.wan22.vae_file import load_vae

            return load_vae(Path(self.model.vae_file), latent_channels=self.spec.latent_channels)
        if self.random or self.path is None:
            return architecture.tiny_vae(self.spec, self.seed)
        return AutoencoderKLWan.from_pretrained(str(self.path), subfolder="vae", torch_dtype=torch.float32,
                                                local_files_only=True).eval()

    def text_encoder(self, dtype: torch.dtype):
        """(tokenizer, encoder)."""
        from transformers import AutoTokenizer, UMT5EncoderModel

        if self.random:
            return architecture.tiny_tokenizer(self.spec), architecture.tiny_text_encoder(self.spec, self.seed)
        m = self.model
        if m.tokenizer_path is None and self.path is None:
            tokenizer = architecture.tiny_tokenizer(self.spec)
        else:
            folder = Path(m.tokenizer_path).expanduser() if m.tokenizer_path is not None else self.path / "tokenizer"
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if m.text_encoder_file is not None:
            from wantrain.models.wan22.text_file import load_text_encoder

            return tokenizer, load_text_encoder(Path(m.text_encoder_file), dtype)
        if self.path is None:
            return tokenizer, architecture.tiny_text_encoder(self.spec, self.seed)
        encoder = UMT5EncoderModel.from_pretrained(str(self.path / "text_encoder"), torch_dtype=dtype,
                                                   local_files_only=True)
        return tokenizer, encoder.eval()


def fp8_stored(build) -> dict[str, torch.dtype]:
    """{name: float8_e4m3fn} of the tensors diffusers' layerwise casting stores in float8 (what the adapter's
    ``enable_layerwise_casting`` does to the loaded model), found on a ``meta`` build: streamed straight into float8,
    they are already in their storage dtype when the adapter enables the casting (a no-op cast for them)."""
    with torch.device("meta"):
        probe = build()
    probe.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    return {name: t.dtype for name, t in probe.state_dict().items() if t.dtype == torch.float8_e4m3fn}


def _normalise(value):
    """JSON lists and Python tuples compare equal (``patch_size``)."""
    return list(value) if isinstance(value, tuple | list) else value


def _refuse_wan21_image_branch(file: Path, key: str, variant: str) -> None:
    """A Wan 2.1 I2V file has the same shapes as I2V-A14B plus a CLIP image branch, which diffusers would drop with
    a mere warning; read the key names (the header only) and refuse it."""
    names = sharded.tensor_names(file, key)
    found = next((n for n in names if "img_emb." in n or ".k_img." in n or ".v_img." in n), None)
    if found is not None:
        raise UserError(
            f"model.{key} '{file}' holds a Wan 2.1 CLIP image branch ({found}); {variant} is a Wan 2.2 model, "
            "which has none: use a Wan 2.2 checkpoint"
        )
