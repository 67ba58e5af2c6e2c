"""``Wan22Adapter``: the Wan 2.2 side of the ``wantrain.core.adapter.ModelAdapter`` contract.

Each trained expert is its own diffusers ``WanTransformer3DModel`` with its own peft LoRA (adapter name
``wantrain``) and its own optimizer parameter group. The high-noise expert (``transformer``) owns t >= boundary,
the low-noise one (``transformer_2``) the rest; with both trained they alternate every ``switch_every`` optimizer
steps and the inactive one waits on ``model.offload_device`` with its optimizer state; the training device never
holds two experts (``placement.py``).

Objective (flow matching, as diffusers' ``flow_prediction`` and the peer trainers):
``x_t = (1 - t) * x0 + t * eps``, target ``eps - x0``, model timestep ``t * 1000``, MSE.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wantrain.core.errors import UserError
from wantrain.core.optim_state import check_rescalable, rescale_state, state_kind
from wantrain.core.parallel.sharding import like
from wantrain.models.wan22 import adapter_forward, architecture, control, fp8
from wantrain.models.wan22.adapter_types import AdapterType, adapter_type, select_modules
from wantrain.models.wan22.attention import check_kernel, use_kernel
from wantrain.models.wan22.compile import check_compiler, compile_blocks
from wantrain.models.wan22.config import FP8_DTYPES, LOW_BIT_DTYPES, LoraConfig, ModelConfig
from wantrain.models.wan22.export import ADAPTER_NAME, Wan22Saver, lora_layers
from wantrain.models.wan22.loading import WeightSource
from wantrain.models.wan22.lora_files import LoraFile, check_fits, describe, resolve_init
from wantrain.models.wan22.lowbit import to_low_bit
from wantrain.models.wan22.offload import ActivationOffload
from wantrain.models.wan22.placement import ExpertPlacement, pin_budget
from wantrain.models.wan22.recompute import use_recompute
from wantrain.models.wan22.swap import BlockSwap, run_order, swapped_blocks
from wantrain.models.wan22.text import CLEANING, clean_prompt
from wantrain.models.wan22.timesteps import TimestepSampler, expert_band
from wantrain.models.wan22.variants import VARIANTS, VariantSpec
from wantrain.models.wan22.waiting import WaitingOnDisk, lending, qualified_names

GROUP_NAME = {"high_noise": "high_noise", "low_noise": "low_noise", None: "lora"}
# fp8 storage works functionally on the CPU too (tests use that), but it is only worth its cost on CUDA.
FP8_DEVICE_TYPES = ("cuda",)


def _storage_dtype(model: ModelConfig, spec: VariantSpec, device: torch.device, *, training: bool = True
                   ) -> tuple[torch.dtype, torch.dtype]:
    """(dtype the base weights are loaded in, dtype the transformer computes in). fp8 storage needs CUDA only when
    the transformers are built (``training``); the encoders alone just need the compute dtype."""
    choice = model.base_dtype
    if choice == "auto":
        choice = "fp32" if spec.tiny else "bf16"
    if choice in LOW_BIT_DTYPES:  # quantised as the file streams (single_file.py), the tiny twins by _store_base
        return torch.bfloat16, torch.bfloat16
    if choice in FP8_DTYPES:
        if training and device.type not in FP8_DEVICE_TYPES:
            raise UserError(f"model.base_dtype = '{choice}' needs a CUDA device (training device is {device.type}); "
                            "use 'bf16' or 'fp32'")
        return torch.bfloat16, torch.bfloat16
    dtype = torch.float32 if choice == "fp32" else torch.bfloat16
    return dtype, dtype


def lora_init_seed(seed: int, expert: str | None) -> int:
    """The seed of ``expert``'s LoRA initialisation, derived from the run seed."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}:lora:{expert}".encode()).digest()[:6], "little")


@torch.no_grad()
def init_adapter_in_fp32(transformer: nn.Module, seed: int, kind: AdapterType) -> None:
    """peft's default start of the adapter type (LoRA: ``A`` Kaiming-uniform with ``a = sqrt(5)``, ``B`` zero;
    the others: ``adapter_types.py``), drawn in float32 from a generator seeded by ``seed``, layer by layer in
    module order. peft casts a new adapter to its base layer's dtype before wantrain's ``.float()``: through bf16,
    or through float8 (which would leave ``A`` 9-19 distinct values, so that an fp8 run started from another LoRA
    than a bf16 one). Drawn here, the start depends on the seed alone, whatever the base dtype."""
    generator = torch.Generator().manual_seed(seed)
    for _, layer in lora_layers(transformer):
        kind.init_fp32(layer, generator)


def _store_base(transformer: nn.Module, storage: str, device: torch.device | None = None) -> None:
    """Store the frozen base Linears as ``model.base_dtype`` says: ``fp8`` through diffusers' layerwise casting,
    ``fp8_scaled`` as ``fp8.ScaledFp8Linear`` (a streamed file or folder comes converted already:
    ``single_file.py``; the tiny twins are converted here). Call before the LoRA is added."""
    if storage == "fp8":
        transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    elif storage == "fp8_scaled":
        fp8.to_scaled_fp8(transformer)
    elif storage in LOW_BIT_DTYPES:  # quantised on the training device where it is CUDA (seconds, not minutes)
        to_low_bit(transformer, storage, device=device if device is not None and device.type == "cuda" else None)


def _load_lora_file(transformer: nn.Module, path: Path, expert: str) -> None:
    """Load the LoRA file ``path`` into ``transformer`` the way ``WanPipeline.load_lora_weights`` does (its state
    dict conversion, then ``load_lora_into_transformer``), so a sample equals diffusers' with the same files."""
    from diffusers.loaders import WanLoraLoaderMixin

    try:
        state = WanLoraLoaderMixin.lora_state_dict(str(path))
        WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=transformer, adapter_name="other_expert")
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"config key 'sample.other_expert_lora' = '{path}' does not fit the {expert} expert "
                        f"({first[:200]}); give a LoRA file of that expert") from None


class Wan22Adapter:
    """Built by :func:`wantrain.models.wan22.build_adapter`. See the module docstring and docs/models.md."""

    def __init__(self, model: ModelConfig, lora: LoraConfig, *, seed: int, device: torch.device, base_lr: float,
                 transformers: bool = True, shard_load: str | None = None, waiting_folder: Path | None = None):
        self.spec: VariantSpec = VARIANTS[model.variant]
        self.model_config = model
        # lora.init_from*: rank and alpha come from the files (read and checked before any weight loads)
        self.lora_config, init_files = resolve_init(lora, model)
        self.loaded_files: list[dict[str, Any]] = []  # lora.init_from*: what each file held (lora_files.describe)
        self.kind: AdapterType = adapter_type(self.lora_config.type)  # the one object that knows the adapter type
        self.device = torch.device(device)
        self.experts: tuple[str | None, ...] = model.trained_experts
        self.base_lr = base_lr
        self.source = WeightSource(model, seed)
        self.encoder_identity: str = self.source.encoder_identity
        load_dtype, self.compute_dtype = _storage_dtype(model, self.spec, self.device, training=transformers)
        # UMT5 runs in the compute dtype: an fp32 run and a bf16 run must not share text embeddings.
        self.text_identity: str = (f"{self.encoder_identity}:text:dtype={str(self.compute_dtype)[6:]}:"
                                   f"len={self.spec.text_len}:clean={CLEANING}")
        self.sampler = TimestepSampler(
            method=model.timestep_sampling, shift=model.shift,
            mean=model.logit_mean if model.timestep_sampling == "logit_normal" else 0.0,
            std={"logit_normal": model.logit_std, "sigmoid": model.sigmoid_scale}.get(model.timestep_sampling, 1.0),
        )
        self.bands = {e: expert_band(self.spec.boundary_ratio, e, model.min_t, model.max_t) for e in self.experts}
        self._transformers: dict[str | None, nn.Module] = {}
        self._swaps: dict[str | None, BlockSwap] = {}  # model.blocks_to_swap > 0: per expert
        self._offload = (ActivationOffload(self.device, pin=model.pin_host_copies) if model.offload_activations
                         else None)
        if transformers:  # model.attention / model.compile this device cannot run: refused before any weight loads
            self.attention_kernel = check_kernel(model.attention, self.device, self.compute_dtype)
            check_compiler(model.compile, self.device)
        # model.waiting_expert = "disk": each expert's frozen base written once to its waiting file (waiting.py), read
        # back at each switch instead of held; "auto" left unresolved (no host plan ran) is resident
        self.waiting: WaitingOnDisk | None = None
        if transformers and shard_load is None and model.waiting_expert == "disk" and len(self.experts) > 1:
            if waiting_folder is None:
                raise ValueError("model.waiting_expert = 'disk' needs a waiting_folder (the cache folder's)")
            self.waiting = WaitingOnDisk(waiting_folder)
        # model.parallel = "fsdp" (shard_load): every rank builds its trained transformer on meta, to be sharded and
        # filled from rank 0's (core.parallel.sharding.load_from_rank0); rank 0 ("rank0") also loads it whole on the
        # host, prepared alike (LoRA included), as the source: no other rank ever holds a whole expert
        self.host_sources: dict[str | None, nn.Module] = {}
        # int8 / nf4 bases are quantised as they stream, on the training device where it is CUDA (seconds, not minutes)
        self._quantise_on = self.device if self.device.type == "cuda" else None
        self.placement = ExpertPlacement(self.device, torch.device(model.offload_device),
                                         pin_limit=pin_budget(model.host_ram_budget_gb) if model.pin_host_copies else 0,
                                         disk=self.waiting)
        for expert in self.experts if transformers else ():  # encoders only (build_encoders): none
            init_seed = lora_init_seed(seed, expert)
            if shard_load is None:
                transformer = self.source.transformer(expert, load_dtype, quantise_on=self._quantise_on)
            else:
                transformer = self.source.meta_transformer(load_dtype)
                if shard_load == "rank0":  # the global random streams advance once, as the other ranks' do
                    with torch.random.fork_rng(devices=[]):
                        host = self._prepare(self.source.transformer(expert, load_dtype), model.base_dtype,
                                             init_seed)
                    self.host_sources[expert] = host
            self._transformers[expert] = self._prepare(transformer, storage=model.base_dtype, init_seed=init_seed)
            if expert in init_files:
                self._start_from(expert, init_files[expert], self.host_sources.get(expert))
            if self.waiting is not None:  # every frozen tensor still on the module: before the swap takes some
                self.waiting.keep(expert, self.source.transformer_identity(expert), model.base_dtype,
                                  self._transformers[expert])
            if model.blocks_to_swap and shard_load is None:  # the host copies: the loaded tensors, before any move
                # (under fsdp FSDP2 keeps the swapped blocks' shards on the host: app.assemble.shard_experts)
                blocks, swapped = swapped_blocks(self._transformers[expert], model.blocks_to_swap)
                self._swaps[expert] = BlockSwap(self._transformers[expert], blocks, swapped, self.device,
                                                pin=model.pin_host_copies)
            if self.waiting is not None:  # on disk now: no expert is held whole beside the next one loading
                with self._swapped_blocks_excluded():
                    self.placement.park(expert, self._transformers[expert])
                if expert in self._swaps:
                    self._swaps[expert].drop_host()
        # The first expert starts on the training device; the others wait off it (activate() swaps them). The
        # swapped blocks' frozen tensors are no part of the placement: their host copies are the BlockSwap's.
        if transformers and shard_load is not None:  # on meta: placed when sharded and filled
            self.placement.add_sharded(self._transformers)
        elif transformers:
            with self._swapped_blocks_excluded():
                self.placement.add(self._transformers, first=self.experts[0])
            if self.waiting is not None and self.experts[0] in self._swaps:
                self._read_swapped(self.experts[0], self._swaps[self.experts[0]])
        self.active: str | None = self.experts[0]
        self.sampling_only: tuple[str, ...] = ()  # experts loaded for sampling only (add_sampling_expert)
        self.relayed: tuple[str, ...] = ()  # experts another group of ranks holds (add_relayed_expert)
        self._vae = None
        self._tokenizer = None
        self._text_encoder = None
        self._next_quantile: float | None = None  # set_timestep_quantile(): for the next loss() only
        self._stacked: dict[Path, tuple[dict[str, Any], list[str]]] = {}  # stacked_loras(): files read, by path

    def _prepare(self, transformer: nn.Module, storage: str, init_seed: int) -> nn.Module:
        transformer.requires_grad_(False)
        _store_base(transformer, storage, self.device)  # before the LoRA: only base Linears are stored quantised
        if self.model_config.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        lora = self.lora_config
        # lora.include / lora.exclude, checked against the modules this transformer has
        names = [n for n, _ in transformer.named_modules()]
        if self.model_config.vace_blocks == "frozen":  # the VACE blocks stay as they are: no adapter on them
            names = [n for n in names if not n.startswith("vace_blocks.")]
        targets = select_modules(names, lora.include, lora.exclude)
        with adapter_forward.dora_magnitudes_from_row_norms():  # DoRA on an fp8 or low-bit base
            transformer.add_adapter(self.kind.peft_config(lora, targets), adapter_name=ADAPTER_NAME)
        for name, param in transformer.named_parameters():
            if f".{ADAPTER_NAME}." in name or name.endswith(f".{ADAPTER_NAME}"):
                param.data = param.data.float()  # adapter weights train in fp32 whatever the base dtype
                param.requires_grad_(True)
        init_adapter_in_fp32(transformer, init_seed, self.kind)
        adapter_forward.install(transformer)  # LoKr/LoHa/DoRA without peft's full-size temporaries
        if self.model_config.gradient_checkpointing:  # 'auto' left unresolved (no planner ran): the whole block
            use_recompute(transformer, "lean" if self.model_config.recompute == "lean" else "block")
        self._speed_up(transformer)
        return transformer.train()

    def _speed_up(self, transformer: nn.Module) -> None:
        """``model.attention``'s kernel and ``model.compile``'s compiled blocks (``attention.py``, ``compile.py``)."""
        use_kernel(transformer, self.attention_kernel)
        if self.model_config.compile != "off":
            compile_blocks(transformer, self.model_config.compile, self.model_config.compile_dynamic)

    def _start_from(self, expert: str | None, lora: LoraFile, host: nn.Module | None = None) -> None:
        """Copy the adapter of a file into ``expert``'s adapter layers (fp32) with each module's alpha; modules the
        file does not hold keep their fresh start (an update of zero). ``host``: rank 0's whole copy under
        ``model.parallel = "fsdp"``, which the file's values reach (the meta build takes the alphas, then the
        values from it)."""
        if host is not None:
            self._start_from_layers(dict(lora_layers(host)), lora)
        self.loaded_files.append({"key": lora.key, "expert": expert, **describe(lora)})  # the run log names them
        self._start_from_layers(dict(lora_layers(self._transformers[expert])), lora)

    def _start_from_layers(self, layers: dict[str, nn.Module], lora: LoraFile) -> None:
        unadapted = sorted(set(lora.modules) - set(layers))
        if unadapted:
            raise UserError(f"{lora.key} '{lora.path}' holds module {unadapted[0]}, which this run does not adapt "
                            "(lora.include / lora.exclude); widen the selection or drop those keys")
        if lora.adapter_type != "lora":
            for module, parts in lora.parts.items():
                self.kind.load(layers[module], parts, f"{lora.key} '{lora.path}' module {module}")
            return
        check_fits(lora, {n: (layer.base_layer.out_features, layer.base_layer.in_features)
                          for n, layer in layers.items()})
        with torch.no_grad():
            for module, down in lora.down.items():
                layer = layers[module]
                layer.lora_A[ADAPTER_NAME].weight.copy_(down.to(torch.float32))
                layer.lora_B[ADAPTER_NAME].weight.copy_(lora.up[module].to(torch.float32))
                self.kind.set_alpha(layer, lora.alpha[module])

    # -- the ModelAdapter contract -------------------------------------------------------------------------
    def transformer_for(self, expert: str | None) -> nn.Module:
        """The peft-wrapped diffusers transformer of ``expert`` (``None`` for the 5B model)."""
        return self._transformers[expert]

    def trainable_parameters(self, expert: str | None = None) -> list[nn.Parameter]:
        experts = self.experts if expert is None or self.experts == (None,) else (expert,)
        return [p for e in experts for p in self._transformers[e].parameters() if p.requires_grad]

    def param_groups(self) -> list[dict[str, Any]]:
        """One group per trained expert (``high_noise``, ``low_noise``, or ``lora``) at its LR. With LoRA+
        (``lora.plus_lr_ratio``) each expert's B matrices get a group of their own, ``<group>_B``, at ratio x the
        expert's LR, which follows the expert's group: an LR set on that group for one step (``control.set_lr``)
        sets ratio x it on the B group too (``follows`` / ``lr_ratio``, read by the core)."""
        lrs = {"high_noise": self.model_config.lr_high_noise, "low_noise": self.model_config.lr_low_noise}
        ratio = self.lora_config.plus_lr_ratio
        groups = []
        for e in self.experts:
            lr, name, params = lrs.get(e) or self.base_lr, GROUP_NAME[e], self.trainable_parameters(e)
            if ratio is None:
                groups.append({"params": params, "lr": lr, "name": name})
                continue
            b = {id(self.kind.output_factor(layer)) for _, layer in lora_layers(self._transformers[e])}
            groups.append({"params": [p for p in params if id(p) not in b], "lr": lr, "name": name})
            groups.append({"params": [p for p in params if id(p) in b], "lr": lr * ratio, "name": f"{name}_B",
                           "follows": name, "lr_ratio": ratio})
        return groups

    def expert_for_step(self, step: int) -> str | None:
        """Step 1..switch_every trains ``experts[0]``, the next ``switch_every`` steps ``experts[1]``, ..."""
        if len(self.experts) == 1:
            return self.experts[0]
        return self.experts[((step - 1) // self.model_config.switch_every) % len(self.experts)]

    @property
    def offload_device(self) -> torch.device:
        """Where inactive experts' LoRA and optimizer state wait, and their base weights' waiting copy."""
        return self.placement.offload_device

    @offload_device.setter
    def offload_device(self, device: torch.device) -> None:
        self.placement.offload_device = torch.device(device)

    def activate(self, expert: str | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Put ``expert`` (weights, LoRA, gradients, optimizer state) on the training device after moving every
        other expert (trained, or :meth:`sampling-only <add_sampling_expert>`) off it: the device never holds two
        experts (``models/wan22/placement.py``). A no-op for an expert already in place. With block swap, an
        expert that leaves the device drops its ring."""
        if expert in self.relayed:  # held by another group: its calls travel there, nothing moves here
            self.active = expert
            return
        for e, swap in self._swaps.items():
            if e != expert:
                swap.release()  # the expert not training keeps no swapped block on the device
                if self.waiting is not None:
                    swap.drop_host()  # ... and, waiting on disk, no host copy (dropped before the next is read)
        swap = self._swaps.get(expert)
        if swap is not None and swap.dropped:
            self._read_swapped(expert, swap)
        moves = (any(e != expert for e in self.placement.resident())
                 or self.placement.where.get(expert) != self.placement.device)
        with self._swapped_blocks_excluded() if moves else contextlib.nullcontext():
            self.placement.activate(expert, optimizer)
        self.active = expert

    def _read_swapped(self, expert: str | None, swap: BlockSwap) -> None:
        """The host copies of ``expert``'s swapped blocks, back from its waiting file (``waiting.py``)."""
        assert self.waiting is not None
        name = qualified_names(self._transformers[expert])
        with self.waiting.reader(expert) as read:
            swap.restore_host(lambda module, attr: read(name(module, attr)))

    @contextlib.contextmanager
    def _swapped_blocks_excluded(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for swap in self._swaps.values():
                stack.enter_context(swap.excluded())
            yield

    def swap_for(self, expert: str | None) -> BlockSwap | None:
        """The block swap of ``expert`` (``model.blocks_to_swap`` > 0), else None."""
        return self._swaps.get(expert)

    def loss(self, batch: Mapping[str, Any], expert: str | None, generator: torch.Generator) -> torch.Tensor:
        """Mean flow-matching MSE of ``batch`` for ``expert``. ``batch`` is raw (``pixels``, ``captions``; encoded
        here without grad) or cached (``latents``, ``text_embeds`` and, for i2v-a14b, ``cond_latents``).

        Random draws, in order, all from ``generator``: t [G], noise [G, ...], and for ti2v the i2v coin [G], for
        the whole global batch of G samples, of which this batch keeps its own rows: ``batch["global_draws"]`` =
        (positions, G) under torchrun (``TrainingData.global_draws``), else G = B and every row. So N ranks of
        batch B draw exactly what one process of batch N x B draws. No host sync. TI2V i2v samples keep latent
        frame 0 clean (timestep 0 for its tokens) and weight it 0 in the loss.
        """
        if "latents" not in batch:
            batch = self.encode_batch(batch)
        x0 = batch["latents"].to(self.device, torch.float32, non_blocking=True)
        text = batch["text_embeds"].to(self.device, self.compute_dtype, non_blocking=True)
        b, _, frames, height, width = x0.shape
        positions, total = batch.get("global_draws") or (None, b)
        own = _rows(positions)
        quantile, self._next_quantile = self._next_quantile, None
        t = self.sampler.sample(total, self.bands[expert], generator, self.device, quantile=quantile)[own]  # float64
        noise = torch.randn((total, *x0.shape[1:]), generator=generator, device=generator.device)[own]
        noise = noise.to(self.device, non_blocking=True)
        t_mix = t.to(torch.float32).view(b, 1, 1, 1, 1)
        x_t = (1 - t_mix) * x0 + t_mix * noise
        target = noise - x0
        timestep = (t * 1000).to(torch.float32)
        weight = None
        extra = self._control_inputs(batch)
        if "reference_frames" in batch:  # VACE: the reference's latent frame in front is no part of the loss
            weight = torch.ones(b, 1, frames, 1, 1, device=self.device)
            weight[:, :, :batch["reference_frames"].shape[1]] = 0.0  # a count in the shape: no host sync
        if self.spec.conditioning == "i2v":
            x_t = torch.cat([x_t, batch["cond_latents"].to(self.device, torch.float32, non_blocking=True)], dim=1)
        elif self.spec.conditioning == "ti2v":
            coin = torch.rand(total, generator=generator, device=generator.device)[own].to(self.device)
            i2v = coin < self.model_config.i2v_probability if frames > 1 else torch.zeros_like(coin, dtype=torch.bool)
            weight = torch.ones(b, 1, frames, 1, 1, device=self.device)
            weight[:, :, 0] = (~i2v).to(torch.float32).view(b, 1, 1, 1)
            x_t = weight * x_t + (1 - weight) * x0  # clean first latent frame for i2v samples
            tokens = (height // 2) * (width // 2)
            timestep = (weight[:, 0, :, 0, 0] * timestep[:, None]).repeat_interleave(tokens, dim=1)  # [B, seq]
        with self._offload.active() if self._offload is not None else contextlib.nullcontext():
            pred = self._transformers[expert](
                hidden_states=x_t.to(self.compute_dtype), timestep=timestep, encoder_hidden_states=text,
                return_dict=False, **extra,
            )[0].to(torch.float32)
        err = (pred - target) ** 2
        rows = batch.get("row_weights")  # a padded short global batch (TrainingData.row_weights): per-row weights
        if rows is not None:
            rows = torch.tensor(rows, dtype=torch.float32).to(self.device, non_blocking=True)
            if weight is None:
                return (err.flatten(1).mean(dim=1) * rows).sum()
            weight = weight.expand_as(err)
            per_row = (err * weight).flatten(1).sum(dim=1) / weight.flatten(1).sum(dim=1).clamp_min(1.0)
            return (per_row * rows).sum()
        if weight is None:
            return err.mean()
        weight = weight.expand_as(err)
        return (err * weight).sum() / weight.sum().clamp_min(1.0)

    def set_timestep_quantile(self, quantile: float) -> None:
        """Make the next :meth:`loss` place its timesteps at ``quantile`` (in [0, 1)) of the expert's t
        distribution instead of drawing them (sample k of the batch at ``(quantile + k/B) mod 1``); one call, one
        forward pass. The LR finder's ``noise = "stratified"`` calls it before every micro-step."""
        if not 0.0 <= quantile < 1.0:
            raise ValueError(f"timestep quantile must lie in [0, 1), got {quantile}")
        self._next_quantile = float(quantile)

    # -- validation and sampling (the validation and sample observers) ----------------------------------------
    def expert_for_timestep(self, t: float) -> str | None:
        """The trained expert that owns ``t`` in (0, 1) (high noise: t >= boundary); ``"untrained"`` when the
        owner is not trained in this run."""
        boundary = self.spec.boundary_ratio
        if boundary is None:
            return self.experts[0]
        owner = "high_noise" if t >= boundary else "low_noise"
        return owner if owner in self.experts else "untrained"

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Every trained transformer in eval mode (LoRA dropout off: nothing is drawn from the global RNG) under
        ``torch.no_grad``; train mode is restored after, also on an error."""
        modes = {e: t.training for e, t in self._transformers.items()}
        try:
            for transformer in self._transformers.values():
                transformer.eval()
            with torch.no_grad():
                yield
        finally:
            for e, transformer in self._transformers.items():
                transformer.train(modes[e])

    def validation_loss(self, batch: Mapping[str, Any], t: float, noise: torch.Tensor) -> torch.Tensor:
        """Flow-matching MSE of a cached ``batch`` at the fixed timestep ``t`` with the given ``noise`` (shape of
        ``batch["latents"]``), by the expert that owns ``t`` (which must be on the device: ``activate`` it).
        The text-to-video objective for every variant (TI2V: no clean first frame). A 0-dim float32 tensor on
        the device; no host sync, no random draw. Call inside :meth:`evaluating`."""
        expert = self.expert_for_timestep(t)
        x0 = batch["latents"].to(self.device, torch.float32, non_blocking=True)
        text = batch["text_embeds"].to(self.device, self.compute_dtype, non_blocking=True)
        b, _, frames, height, width = x0.shape
        noise = noise.to(self.device, torch.float32, non_blocking=True)
        x_t = (1 - t) * x0 + t * noise
        timestep = torch.full((b,), t * 1000, dtype=torch.float32, device=self.device)
        if self.spec.conditioning == "i2v":
            x_t = torch.cat([x_t, batch["cond_latents"].to(self.device, torch.float32, non_blocking=True)], dim=1)
        elif self.spec.conditioning == "ti2v":  # per-token timesteps, as the model is trained and sampled
            timestep = timestep[:, None].repeat_interleave(frames * (height // 2) * (width // 2), dim=1)
        pred = self._transformers[expert](
            hidden_states=x_t.to(self.compute_dtype), timestep=timestep, encoder_hidden_states=text, return_dict=False,
            **self._control_inputs(batch),
        )[0].to(torch.float32)
        err = (pred - (noise - x0)) ** 2
        if "reference_frames" in batch:  # VACE: as in training, the reference's latent frame is left out
            return err[:, :, batch["reference_frames"].shape[1]:].mean()
        return err.mean()

    def _control_inputs(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The transformer's control arguments of a cached ``batch``: VACE's ``control_hidden_states`` (the
        ``vace_context`` the cache holds, ``control.vace_context``), nothing for the other variants."""
        if not self.spec.vace:
            return {}
        return {"control_hidden_states": batch["vace_context"].to(self.device, self.compute_dtype, non_blocking=True)}

    @property
    def boundary_ratio(self) -> float | None:
        """The variant's expert boundary (``spec.boundary_ratio``; None: one transformer)."""
        return self.spec.boundary_ratio

    def load_vae(self) -> nn.Module:
        """A fresh VAE from the model folder (the sample observer loads one per round and drops it)."""
        return self.source.vae()

    def sampling_scheduler(self):
        """The sampling scheduler: ``scheduler/scheduler_config.json`` of ``model.path`` when it has one; else
        (the tiny twins, single-file transformers) the one diffusers' Wan conversion writes:
        ``UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True)`` with ``flow_shift``
        3.0 (A14B, Wan 2.1 VAE) or 5.0 (TI2V-5B)."""
        import diffusers

        path = self.source.path
        config_file = path / "scheduler" / "scheduler_config.json" if path is not None else None
        if config_file is not None and config_file.is_file():
            config = json.loads(config_file.read_text())
            cls = getattr(diffusers, config.get("_class_name", ""), None)
            if cls is None:
                raise UserError(f"'{config_file}' names scheduler class {config.get('_class_name')!r}, which "
                                "diffusers does not have")
            return cls.from_config(config)
        return diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                 flow_shift=5.0 if self.spec.vae == "wan2.2" else 3.0)

    def add_sampling_expert(self, lora_file: Path | None = None) -> str | None:
        """With one expert of an A14B model trained, load the other one for sampling its timesteps: its base
        weights from the same kind of source as a trained expert (``model.*_file``: one file or a folder of
        shards; else its folder in ``model.path``; the tiny twin), frozen, with ``lora_file`` (a Wan 2.2 LoRA in
        any naming diffusers reads) loaded into it by diffusers' own LoRA loader. It joins the placement as a
        frozen expert (``ExpertPlacement.add_frozen``): it waits on ``offload_device`` (one host copy) and comes
        onto the device only through :meth:`activate`, like a trained expert, with its own block swap when
        ``model.blocks_to_swap`` is set; it has no optimizer group and is neither saved nor checkpointed. Returns
        the expert (None when there is nothing to add: both experts trained, or a single-transformer variant).
        Raises ``UserError`` (one line) for missing weights or a LoRA file that does not fit."""
        missing = [e for e in self.model_config.untrained_experts if e not in self._transformers]
        if not missing:
            return None
        (expert,) = missing
        self.source.check_expert(expert, "needed to sample with one trained expert")
        load_dtype, _ = _storage_dtype(self.model_config, self.spec, self.device)
        transformer = self.source.transformer(expert, load_dtype, quantise_on=self._quantise_on)
        _store_base(transformer, self.model_config.base_dtype)
        if lora_file is not None:
            _load_lora_file(transformer, Path(lora_file), expert)
        transformer.requires_grad_(False).eval()
        self._speed_up(transformer)
        if self.model_config.blocks_to_swap:  # as for a trained expert: the host copies are the loaded tensors
            blocks, swapped = swapped_blocks(transformer, self.model_config.blocks_to_swap)
            self._swaps[expert] = BlockSwap(transformer, blocks, swapped, self.device,
                                            pin=self.model_config.pin_host_copies)
        self._transformers[expert] = transformer
        with self._swapped_blocks_excluded():
            self.placement.add_frozen(expert, transformer)
        self.sampling_only = (*self.sampling_only, expert)
        return expert

    def add_relayed_expert(self, expert: str, stand_in: nn.Module) -> None:
        """With ``model.expert_groups``: ``stand_in`` (``core.parallel.expert_relay.RelayedExpert``) takes the place of
        ``expert``, which another group of ranks holds, in the sampling pipeline and for ``validation_loss``;
        :meth:`activate` of it moves nothing (this rank's expert stays on the device). Not placed, trained or
        saved, like a sampling-only expert."""
        self._transformers[expert] = stand_in
        self.relayed = (*self.relayed, expert)

    def _stacked_targets(self, lora: Any) -> list[str | None]:
        if self.spec.boundary_ratio is None:
            return [None]
        return [e for e in ("high_noise", "low_noise")
                if lora.expert in ("both", e) and e in self._transformers and e not in self.relayed]

    def _read_stacked(self, path: Path) -> tuple[dict[str, Any], list[str]]:
        from wantrain.models.wan22.stacked import read_stacked

        path = Path(path)
        if path not in self._stacked:
            self._stacked[path] = read_stacked(path, "sample.loras")
        return self._stacked[path]

    def check_stacked_loras(self, loras: Any) -> list[str]:
        """Read each file of ``loras`` (``StackedLora`` settings) and say, one line per file that has them, which of
        its keys match no module of the experts it applies to. Raises ``UserError`` (one line) for a file diffusers
        cannot read, or one that matches nothing at all."""
        from wantrain.models.wan22.stacked import attach

        lines = []
        for lora in loras:
            targets = self._stacked_targets(lora)
            if not targets:  # for an expert another group holds (model.expert_groups): checked there
                continue
            modules, strays = self._read_stacked(lora.path)
            missed: dict[str, list[str]] = {}
            for expert in targets:
                handles, unmatched = attach(self._transformers[expert], modules, lora.strength)
                for handle in handles:
                    handle.remove()
                missed[expert or "transformer"] = unmatched
            if modules and all(len(m) == len(modules) for m in missed.values()):
                raise UserError(f"config key 'sample.loras' = '{lora.path}': none of its {len(modules)} modules "
                                f"fits {self.spec.name} (e.g. {sorted(modules)[0]}); is it a LoRA for another model?")
            names = sorted({*strays, *(n for m in missed.values() for n in m)})
            if names:
                lines.append(f"'{lora.path}': {len(names)} of its modules match nothing in {self.spec.name} and are "
                             f"left out: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
        return lines

    @contextlib.contextmanager
    def stacked_loras(self, loras: Any) -> Iterator[None]:
        """While inside, each LoRA file of ``loras`` (``StackedLora``: path, strength, expert) adds its update under
        the trained LoRA of the experts it names (``stacked.py``: forward hooks, removed on exit, also on an error;
        nothing trains, nothing enters a checkpoint or an export)."""
        from wantrain.models.wan22.stacked import attach

        handles: list[Any] = []
        try:
            for lora in loras:
                modules, _ = self._read_stacked(lora.path)
                for expert in self._stacked_targets(lora):
                    handles += attach(self._transformers[expert], modules, lora.strength)[0]
            yield
        finally:
            for handle in handles:
                handle.remove()

    def sampling_pipeline(self, vae: nn.Module, *, image_to_video: bool):
        """diffusers' own ``WanPipeline`` / ``WanImageToVideoPipeline`` around the training transformers (LoRA
        active, no copies) and ``vae``; no text encoder (pass ``prompt_embeds`` and ``negative_prompt_embeds``).
        An A14B variant needs both experts: trained ones, or one trained and the other added by
        :meth:`add_sampling_expert`. The caller places the experts (:meth:`activate`)."""
        WanPipeline, WanImageToVideoPipeline = architecture.wan_pipelines()
        if self.spec.vace:  # WanVACEPipeline: a control video, mask and reference images (none: its defaults)
            WanPipeline = architecture.vace_pipeline()
        parts: dict[str, Any] = dict(tokenizer=None, text_encoder=None, vae=vae, scheduler=self.sampling_scheduler())
        if self.spec.boundary_ratio is None:
            parts.update(transformer=self._transformers[None], expand_timesteps=True)
        else:
            parts.update(transformer=self._transformers["high_noise"], transformer_2=self._transformers["low_noise"],
                         boundary_ratio=self.spec.boundary_ratio)
        if image_to_video:
            pipe = WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None)
        else:
            pipe = WanPipeline(**parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # -- encoders ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_batch(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """A raw batch (``pixels``, ``captions``) in cached form."""
        media = self.encode_media(batch["pixels"], batch.get("conditions"))
        return {**media, **self.encode_text(list(batch["captions"]))}

    def _vae_model(self):
        if self._vae is None:
            self._vae = self.source.vae().to(self.device).requires_grad_(False)
        return self._vae

    def _encode_normalized(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        z = vae.encode(pixels).latent_dist.mode()  # the mean, like the pipelines' sample_mode="argmax"
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(shape)
        return (z - mean) / std

    @torch.no_grad()
    def encode_media(self, pixels: torch.Tensor, conditions: Mapping[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
        """``pixels`` [B, 3, F, H, W] in [-1, 1] (F = 4k+1) -> ``latents`` [B, C, 1+(F-1)//4, h, w], normalized,
        float32 on the adapter's device. For i2v-a14b also ``cond_latents`` [B, 20, f, h, w]: channels 0-3 are
        the mask (1 on latent frame 0, 0 elsewhere), channels 4-19 the normalized latents of the clip
        ``[first frame, zeros...]`` encoded as a whole (encoding zeros does not give zero latents); with
        ``model.condition = "first_last"`` ``control.first_last_condition``. For a VACE variant ``latents`` and
        ``vace_context`` (``control.vace_context``) from ``conditions`` (``control`` video, ``mask``, ``reference``
        image: the clip's control files, ``data.controls``), and with a reference ``reference_frames`` [B, R]
        (zeros: R, the reference's latent frames in front, is in the shape)."""
        vae = self._vae_model()
        x = pixels.to(self.device, vae.dtype)

        def encode(video: torch.Tensor) -> torch.Tensor:
            return self._encode_normalized(vae, video.to(self.device, vae.dtype)).float()

        if self.spec.vace:
            conditions = {k: v.to(self.device, vae.dtype) for k, v in (conditions or {}).items()}
            out = control.vace_context(encode, x, conditions, stride=2 ** len(vae.temperal_downsample))
            if "reference" in conditions:  # their number is the shape's (read without a device sync)
                out["reference_frames"] = torch.zeros(x.shape[0], conditions["reference"].shape[2])
            return out
        out = {"latents": encode(x)}
        if self.spec.conditioning == "i2v" and self.model_config.condition == "first_last":
            out["cond_latents"] = control.first_last_condition(encode, x)
        elif self.spec.conditioning == "i2v":
            first = torch.cat([x[:, :, :1], torch.zeros_like(x[:, :, 1:])], dim=2)
            y = self._encode_normalized(vae, first).float()
            mask = torch.zeros(y.shape[0], 4, *y.shape[2:], device=y.device, dtype=y.dtype)
            mask[:, :, 0] = 1.0
            out["cond_latents"] = torch.cat([mask, y], dim=1)
        return out

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """``text_embeds`` [B, text_len, D] in the compute dtype: UMT5 outputs, zeros past each prompt's length
        (like the pipelines), prompts cleaned like the pipelines (:func:`~wantrain.models.wan22.text.clean_prompt`)."""
        if self._text_encoder is None:
            self._tokenizer, encoder = self.source.text_encoder(self.compute_dtype)
            self._text_encoder = encoder.to(self.device).requires_grad_(False)
        ids = self._tokenizer([clean_prompt(c) for c in captions], padding="max_length",
                              max_length=self.spec.text_len, truncation=True, add_special_tokens=True,
                              return_attention_mask=True, return_tensors="pt")
        mask = ids.attention_mask.to(self.device)
        hidden = self._text_encoder(ids.input_ids.to(self.device), mask).last_hidden_state
        return {"text_embeds": (hidden * mask[..., None].to(hidden.dtype)).to(self.compute_dtype)}

    def release_encoders(self) -> None:
        """Drop the VAE, text encoder and tokenizer (they reload lazily if needed again)."""
        self._vae = self._text_encoder = self._tokenizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def encoders_loaded(self) -> bool:
        return self._vae is not None or self._text_encoder is not None

    # -- LoRA alpha (for the alpha controller) and saving --------------------------------------------------
    def lora_alpha(self, expert: str | None) -> float:
        """The alpha in force on ``expert``'s adapter (the first layer's; all layers share it unless set apart)."""
        return self.kind.alpha(next(layer for _, layer in lora_layers(self._transformers[expert])))

    def set_lora_alpha(self, alpha: float, expert: str | None = None) -> None:
        """Set alpha on every LoRA layer of ``expert`` (all trained experts when ``None``); the export follows."""
        for e in self.experts if expert is None else (expert,):
            for _, layer in lora_layers(self._transformers[e]):
                self.kind.set_alpha(layer, float(alpha))

    def change_lora_alpha(self, alpha: float, expert: str | None, optimizer: torch.optim.Optimizer | None = None,
                          *, preserve_output: bool = True) -> None:
        """Set alpha on ``expert``'s LoRA between optimizer steps (the alpha controller calls this at a log step).

        ``preserve_output``: keep the model's function: each layer's ``B`` becomes ``B * old/new`` so that
        ``(new/r) * B' A = (old/r) * B A`` (the other types: the factor ``AdapterType.output_factor`` names, which
        the update is linear in), and its optimizer state follows the gradients of the new
        parametrisation (dL/dB' = new/old * dL/dB), by the optimizer's map in :mod:`wantrain.core.optim_state`
        (Adam/AdamW, SGD, 8-bit AdamW, Adafactor, schedule-free AdamW). A's weights, gradients and state do not
        change. Every layer's state is checked first: state no map knows raises ``TypeError`` before anything
        changed (the config check refuses such optimizers earlier, so this is a bug). Without ``preserve_output``
        only alpha changes and the LoRA's output is scaled by new/old (the seed's jump). In place, device ops only
        (no sync); the expert may sit on the offload device.
        """
        alpha = float(alpha)
        layers = [layer for _, layer in lora_layers(self._transformers[expert])]
        kind = state_kind(optimizer)
        if preserve_output and optimizer is not None:
            for layer in layers:  # the check pass: nothing is changed unless every layer's state can follow
                if self.kind.alpha(layer) != alpha:
                    check_rescalable(kind, optimizer.state.get(self.kind.output_factor(layer), {}))
        with torch.no_grad():
            for layer in layers:
                old = self.kind.alpha(layer)
                if preserve_output and old != alpha:
                    weight = self.kind.output_factor(layer)
                    weight.mul_(old / alpha)
                    if optimizer is not None and optimizer.state.get(weight):
                        rescale_state(kind, optimizer.state[weight], alpha / old)
                self.kind.set_alpha(layer, alpha)

    def adapter_tensors(self, expert: str | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``expert``'s adapter in the file layout of its type (``export.adapter_state_dict``). DoRA's export reads
        the base weights; with block swap each swapped block is loaded through the swap while it is read and the
        ring is emptied after (the next forward pass loads what it needs)."""
        from wantrain.models.wan22.export import adapter_state_dict

        transformer, swap = self._transformers[expert], self._swaps.get(expert)
        if self.kind.reads_base and self.waiting is not None and self.placement.on_disk(expert):
            # the expert waiting on disk holds no base tensor: each block's lent from its waiting file while read
            blocks = run_order(transformer)
            with self.waiting.reader(expert) as read, lending(transformer, read, self.device) as lend:
                return adapter_state_dict(transformer, self.kind, dtype, before_block=lambda k: lend(blocks[k]))
        if swap is None or not self.kind.reads_base:
            return adapter_state_dict(transformer, self.kind, dtype)
        try:
            return adapter_state_dict(transformer, self.kind, dtype,
                                      before_block=lambda k: swap.load(k) if k in swap.swapped else None)
        finally:
            swap.release()

    def saver(self, run_dir: Path, name: str, *, writes: bool = True) -> Wan22Saver:
        return Wan22Saver(self, run_dir, name, writes=writes)

    # -- checkpoint state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The trainable (LoRA) weights of every trained expert, fp32, by parameter name, and the live alpha of
        each: what a checkpoint needs to restore the model exactly (live references; the writer copies)."""
        weights = {}
        for e in self.experts:
            for name, param in self._transformers[e].named_parameters():
                if param.requires_grad:
                    weights[f"{e or 'single'}/{name}"] = param
        return {"weights": weights, "alpha": {e or "single": self.lora_alpha(e) for e in self.experts}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output in place (parameter identity is kept: the optimizer's references stay
        valid). A checkpoint of another LoRA layout is refused with one line."""
        mine = self.state_dict()
        saved = state["weights"]
        missing, extra = sorted(set(mine["weights"]) - set(saved)), sorted(set(saved) - set(mine["weights"]))
        if missing or extra:
            example = (missing or extra)[0]
            raise UserError(f"the checkpoint's LoRA does not match this model ({len(missing)} tensors missing, "
                            f"{len(extra)} unexpected, e.g. {example!r}); resume with the model and LoRA settings "
                            "the run was started with")
        with torch.no_grad():
            for key, param in mine["weights"].items():
                value = saved[key]
                if value.shape != param.shape:
                    raise UserError(f"the checkpoint's LoRA tensor {key!r} has shape {tuple(value.shape)}, this model "
                                    f"has {tuple(param.shape)}; the checkpoint is damaged or from other LoRA "
                                    "settings (core.state_check names which before a resume)")
                param.copy_(like(value, param))  # fsdp: this rank's shard of the saved whole tensor
        for e in self.experts:
            self.set_lora_alpha(float(state["alpha"][e or "single"]), e)


def _rows(positions: Sequence[int] | None) -> slice | list[int]:
    """The index of a batch's own rows in its global batch's draws (``Wan22Adapter.loss``): a slice when they are
    consecutive (a view, no copy), else the positions; every row when ``positions`` is None."""
    if positions is None:
        return slice(None)
    first = positions[0]
    if list(positions) == list(range(first, first + len(positions))):
        return slice(first, first + len(positions))
    return list(positions)
