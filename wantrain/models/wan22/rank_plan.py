"""The memory plan per GPU for a layout of several GPUs (docs/distributed.md, "The plan per rank"): a layer over the
one-GPU estimate of ``memory.py``, which it reads and never changes.

A layout of ``gpus`` GPUs (:class:`Layout`) has three degrees; each expert group's GPUs form one mesh:

* ``expert_groups``: 2 puts each A14B expert on its own group of ``gpus / 2`` GPUs (one expert per GPU with 2
  GPUs), 1 keeps the experts together (every GPU alternates them, the waiting one on the host);
* ``sequence_degree``: Ulysses sequence parallelism splits each clip's tokens over this many GPUs of a group; the
  attention exchanges heads for tokens (an all-to-all), so the degree must divide the heads (40 for A14B, 24 for
  TI2V-5B); ``gpus / (expert_groups x sequence_degree)`` clips train at once per group (data parallel);
* ``shard_degree``: FSDP2 shards each block's frozen weights, the LoRA, its gradients and AdamW's moments over this
  many GPUs of a group (``core.parallel.sharding``), across the sequence and data-parallel GPUs alike (torchtitan folds
  its context-parallel ranks into the shard dimension the same way); it divides the group's GPUs, and the shards are
  replicated ``gpus / (expert_groups x shard_degree)`` times (HSDP: shard inside a machine, replicate across).

Parts per GPU (bytes), from :func:`memory.estimate`'s one-GPU parts with the same settings (base dtype, block swap,
recompute, adapter type, kernel: at one GPU the parts add up to the one-GPU plan's):

* ``weights (shard)``: the expert's frozen weights over ``shard_degree``, each tensor's rows rounded up to a
  multiple of the degree (FSDP2 pads dim 0), exactly as :func:`sharded_weight_bytes` counts them on ``meta``;
* ``gathered blocks``: with ``shard_degree`` > 1, two blocks' whole weights (the one running and the one
  prefetched), less this GPU's own shard of them; with block swap (FSDP2's CPU offload of the last N blocks'
  shards: ``weights (shard)`` and ``LoRA + optimizer`` without them, ``rank_offload``) each offloaded block of the
  two adds its shard, copied to the GPU for its all-gather (:func:`rank_estimate`);
* ``LoRA + optimizer``: 16 bytes per LoRA parameter (``memory.LORA_BYTES_PER_PARAM``) over ``shard_degree``;
* ``checkpointed inputs``, ``one recomputed block``: the one-GPU figures of ``tokens / sequence_degree`` tokens;
* ``sequence exchange``: with ``sequence_degree`` > 1, the all-to-all's send and receive buffers of q, k, v and
  the output of one attention (8 bf16 copies of this GPU's tokens x width): an assumption, not traced;
* ``workspace``: as one GPU, at this GPU's tokens.

The load's peak under FSDP (:func:`load_peak`, printed by ``wantrain check``) is apart from the step's: each GPU
holds its shards of the weights and the fp32 LoRA, the buffers and one tensor whole (``core.parallel.sharding``'s load
from rank 0); rank 0's host holds the expert whole. Checked against the bytes two gloo ranks allocate while loading the
tiny twin (tests/test_distributed_fsdp_load.py: within 0.1 %).

The weights, LoRA and optimizer parts are checked against ``FSDPMemTracker`` under fake tensors on a fake process
group (tests/models/test_rank_plan.py); the activation parts reuse ``memory.py``'s traced constants, and their split
over the sequence degree is checked against a ``saved_tensors_hooks`` trace of the Ulysses-sharded block on rank 0
of Q (fake process group, fake tensors, 832x480x81: within 2.1 % for Q = 2, 4); what NCCL and real links add
(their buffers, overlap) is not measured.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs

from wantrain.core.errors import UserError
from wantrain.models.wan22 import memory
from wantrain.models.wan22.memory import GIB, LORA, LORA_BYTES_PER_PARAM, AdapterSpec, MemorySettings
from wantrain.models.wan22.rank_offload import block_lora_shards, meta_expert, offloaded_shards


@attrs.frozen
class Layout:
    """How ``gpus`` GPUs share one run (module docstring)."""

    gpus: int = 1
    expert_groups: int = 1
    shard_degree: int = 1
    sequence_degree: int = 1

    @property
    def group(self) -> int:
        """GPUs per expert group."""
        return self.gpus // self.expert_groups

    @property
    def data_parallel(self) -> int:
        """Clips trained at once per expert group."""
        return self.group // self.sequence_degree

    def describe(self) -> str:
        parts = [f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"]
        if self.expert_groups > 1:
            parts.append(f"one expert per group of {self.gpus // self.expert_groups}")
        if self.shard_degree > 1:
            replicas = self.group // self.shard_degree
            parts.append(f"FSDP over {self.shard_degree}" + (f" x {replicas} replicas" if replicas > 1 else ""))
        if self.sequence_degree > 1:
            parts.append(f"Ulysses over {self.sequence_degree}")
        if self.data_parallel > 1:
            parts.append(f"{self.data_parallel} data-parallel replicas")
        return ", ".join(parts)


def check_layout(variant: str, layout: Layout) -> None:
    """Refuse (one line) a layout the variant cannot run: degrees that do not divide the GPUs, two expert groups
    for a one-expert model, a sequence degree that does not divide the attention heads."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    for key, value in (("expert_groups", layout.expert_groups), ("shard_degree", layout.shard_degree),
                       ("sequence_degree", layout.sequence_degree), ("gpus", layout.gpus)):
        if value < 1:
            raise UserError(f"{key} = {value}: must be 1 or more")
    if layout.gpus % layout.expert_groups:
        raise UserError(f"{layout.gpus} GPUs cannot be split into {layout.expert_groups} expert groups; use a "
                        f"multiple of {layout.expert_groups} GPUs")
    for key, value in (("shard degree", layout.shard_degree), ("sequence degree", layout.sequence_degree)):
        if layout.group % value:
            raise UserError(f"{key} {value} does not divide the {layout.group} GPU(s) of each expert group "
                            f"({layout.gpus} GPUs / {layout.expert_groups} group(s)); use a divisor of "
                            f"{layout.group}")
    if layout.expert_groups not in (1, len(spec.experts)):
        raise UserError(f"{variant} has {len(spec.experts)} expert(s): expert groups must be 1"
                        + (f" or {len(spec.experts)}" if len(spec.experts) > 1 else ""))
    heads = planner_kwargs(spec)["num_attention_heads"]
    if heads % layout.sequence_degree:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise UserError(f"sequence degree {layout.sequence_degree} does not divide the {heads} attention heads of "
                        f"{variant} (Ulysses gives each GPU whole heads); valid degrees: "
                        f"{', '.join(map(str, valid))}")


@functools.lru_cache(maxsize=32)
def sharded_weight_bytes(variant: str, shard_degree: int, layers: int | None = None) -> tuple[float, float]:
    """(bytes of one expert's bf16 frozen weights one GPU holds under FSDP2 with ``shard_degree``, bytes of its
    largest block whole), counted on a ``meta`` build: each tensor's dim 0 rounded up to a multiple of the degree
    (``fully_shard``'s padding), the ``_keep_in_fp32_modules`` tensors in fp32."""
    model = meta_expert(variant, layers)

    def shard(t: Any) -> float:
        if t.dim() == 0:
            return float(t.element_size())
        rows = math.ceil(t.shape[0] / shard_degree)
        return float(rows * (t.numel() // max(t.shape[0], 1)) * t.element_size())

    params = sum(shard(p) for p in model.parameters())
    buffers = sum(float(b.numel() * b.element_size()) for b in model.buffers())  # buffers stay whole
    largest = max(float(sum(p.numel() * p.element_size() for p in b.parameters())) for b in model.blocks)
    return params + buffers, largest


def lora_shard_params(variant: str, rank: int, shard_degree: int, layers: int | None = None) -> float:
    """LoRA parameters one GPU holds: every A [rank, in] and B [out, rank] matrix's rows rounded up to a multiple
    of ``shard_degree`` (:func:`block_lora_shards` of each block)."""
    n = layers if layers is not None else planner_kwargs_layers(variant)
    return float(n * sum(block_lora_shards(variant, rank, shard_degree)))


@functools.lru_cache(maxsize=32)
def _expert_tensors(variant: str, dtype_name: str, layers: int | None) -> tuple[tuple[tuple[int, ...], int], ...]:
    """(shape, element size) of every parameter and buffer of one expert as it loads (``dtype_name``: "bf16" or
    "fp32"; fp32 for ``_keep_in_fp32_modules``), counted on a ``meta`` build; buffers flagged by a negative size."""
    import torch
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = planner_kwargs(VARIANTS[variant])
    if layers is not None:
        kwargs["num_layers"] = layers
    with torch.device("meta"):
        model = WanTransformer3DModel(**kwargs)
    cast_keeping_fp32_modules(model, torch.float32 if dtype_name == "fp32" else torch.bfloat16)
    return (*((tuple(p.shape), p.element_size()) for p in model.parameters()),
            *((tuple(b.shape), -b.element_size()) for b in model.buffers()))


@attrs.frozen
class LoadPeak:
    """The load of one expert under ``model.parallel = "fsdp"`` (``core.parallel.sharding.load_from_rank0``), in
    bytes."""

    per_gpu: float  # each GPU: its shards of the weights and the LoRA, the buffers, and one tensor whole
    rank0_host: float  # rank 0's host: the whole expert and its LoRA (fp32), the source of every shard
    whole_expert: float  # what each GPU held at load before: the whole expert and its LoRA

    def line(self, shard_degree: int, expert_groups: int = 1) -> str:
        """``wantrain check``'s line; with expert groups each group's first rank (its leader) is the source."""
        source = "each group's first rank" if expert_groups > 1 else "rank 0"
        host = "each group leader's host" if expert_groups > 1 else "rank 0's host"
        return (f"load (FSDP over {shard_degree}, from {source}): {self.per_gpu / GIB:.2f} GiB per GPU at its peak "
                f"(a whole expert: {self.whole_expert / GIB:.2f} GiB), {host} {self.rank0_host / GIB:.2f} GiB")


def load_peak(variant: str, shard_degree: int, rank: int, *, dtype_name: str = "bf16",
              layers: int | None = None) -> LoadPeak:
    """The peak of loading one expert sharded over ``shard_degree`` GPUs from rank 0 (``core.parallel.sharding``,
    ``load_from_rank0``): every GPU allocates its shards (dim 0 rounded up to a multiple of the degree, FSDP2's
    padding) of the frozen weights and of the fp32 LoRA, the buffers whole, and receives each tensor whole, one at a
    time, before slicing it: its peak is the shards, the buffers and the largest tensor. Rank 0's host holds the
    expert as loaded and its LoRA whole (the source). No optimizer state yet (AdamW makes it at the first step)."""
    s = shard_degree
    shard = whole = largest = buffers = 0.0
    for shape, size in _expert_tensors(variant, dtype_name, layers):
        numel = math.prod(shape)
        if size < 0:
            buffers += numel * -size
            continue
        whole += numel * size
        largest = max(largest, float(numel * size))
        rows = shape[0] if shape else 1
        shard += math.ceil(rows / s) * (numel // max(rows, 1)) * size if shape else size
    lora_shard = lora_shard_params(variant, rank, s, layers) * 4.0
    lora_whole = lora_shard_params(variant, rank, 1, layers) * 4.0
    largest = max(largest, max(block_lora_shards(variant, rank, 1)) * 4.0)  # a LoRA matrix (fp32) may be the largest
    return LoadPeak(per_gpu=shard + buffers + lora_shard + largest, rank0_host=whole + buffers + lora_whole,
                    whole_expert=whole + buffers + lora_whole)


SAVE_BYTES_PER_PARAM = 12
"""What a save gathers whole per LoRA parameter: its fp32 value and AdamW's two fp32 moments (no gradient)."""


@attrs.frozen
class SaveGather:
    """A save under ``model.parallel = "fsdp"`` (``core.parallel.sharding.whole_to_writer``), in bytes. Between two
    steps the GPUs of rank 0's copy send their rows of each LoRA and AdamW tensor to rank 0, one tensor at a time;
    rank 0 gathers it on its GPU and moves it to its host. No other GPU holds more than its shards and one padded
    shard to send. DoRA's export gathers each frozen weight the same way (bf16) for its norm."""

    host: float  # rank 0's host: the whole LoRA and AdamW state, and the checkpoint writer's copy of it
    writer_extra: float  # rank 0's GPU: one tensor whole (the largest), over its resident shards
    writer_peak: float
    other_extra: float  # any other GPU: a shard padded to the largest, to send
    other_peak: float

    def lines(self) -> list[str]:
        return [f"save, rank 0 (gathers the LoRA and AdamW state one tensor at a time, between steps): "
                f"+{_size(self.writer_extra)}, {self.writer_peak / GIB:.2f} GiB on its GPU at its peak; "
                f"{self.host / GIB:.2f} GiB on its host",
                f"save, every other GPU (sends its rows, gathers nothing): +{_size(self.other_extra)}, "
                f"{self.other_peak / GIB:.2f} GiB per GPU at its peak"]


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= 0.1 * GIB else f"{nbytes / 2**20:.1f} MiB"


def save_gather(variant: str, layout: Layout, rank: int, *, layers: int | None = None,
                adapter: AdapterSpec = LORA, blocks_to_swap: int = 0) -> SaveGather:
    """The gathers of one save under ``layout`` (its shard degree > 1; module docstring's weights and LoRA parts).
    Rank 0's host holds the gathered state twice at the checkpoint's write (``core.checkpoint`` copies the tree).
    ``blocks_to_swap``: those blocks' shards and LoRA state wait on the host (``rank_offload``), not on the GPU."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    s = layout.shard_degree
    resident = sharded_weight_bytes(variant, s, layers)[0] + lora_shard_params(variant, rank, s, layers) * \
        LORA_BYTES_PER_PARAM
    if blocks_to_swap:
        resident -= sum(offloaded_shards(variant, s, blocks_to_swap, rank, layers)[:2])
    largest = max(block_lora_shards(variant, rank, 1)) * 4.0  # fp32, gathered whole on rank 0's GPU
    if adapter.type == "dora":  # its export's base norm: the largest frozen Linear weight, bf16
        kwargs = planner_kwargs(VARIANTS[variant])
        largest = max(largest, kwargs["num_attention_heads"] * kwargs["attention_head_dim"] * kwargs["ffn_dim"] * 2.0)
    send = math.ceil(largest / s)
    host = 2.0 * lora_shard_params(variant, rank, 1, layers) * SAVE_BYTES_PER_PARAM
    return SaveGather(host=host, writer_extra=largest, writer_peak=resident + largest, other_extra=send,
                      other_peak=resident + send)


@attrs.frozen
class RankEstimate:
    layout: Layout
    parts: dict[str, float]

    attention_backward: float = 0.0  # bytes: memory.attention_backward_bytes at this GPU's heads and tokens
    settings: MemorySettings | None = None  # what it was planned with (None: bf16, nothing swapped or offloaded)
    link_bytes: float = 0.0  # host<->device bytes per step of this GPU the settings add (swap, offloaded inputs)
    host_bytes: float = 0.0  # block swap under FSDP: the offloaded blocks' shards and LoRA state on this GPU's host

    @property
    def total(self) -> float:
        """Bytes of the tensors at the step's peak on one GPU."""
        return sum(self.parts.values())

    @property
    def card_gib(self) -> float:
        """What each card must have (GiB): the tensors, attention's backward buffer, the fragmentation margin and
        the CUDA context (``memory.card_gib``)."""
        return memory.card_gib(self.total + self.attention_backward)

    def lines(self) -> list[str]:
        return [f"{self.layout.describe()}: {self.total / GIB:.1f} GiB of tensors, {self.card_gib:.1f} GiB per "
                "card"] + [f"  {name}: {value / GIB:.2f} GiB" for name, value in self.parts.items() if value]


def rank_estimate(variant: str, layout: Layout, *, width: int, height: int, frames: int, rank: int,
                  batch: int = 1, layers: int | None = None, settings: MemorySettings | None = None,
                  adapter: AdapterSpec = LORA, attention: str = "sdpa", gradient_checkpointing: bool = True
                  ) -> RankEstimate:
    """The parts of one training step's peak on one GPU of ``layout`` (module docstring), planned as the one-GPU
    planner plans (:func:`memory.estimate` with the same ``settings`` -- base dtype, block swap, activation offload,
    recompute --, ``adapter`` type, ``attention`` kernel and checkpointing): at one GPU its parts add up to the
    one-GPU estimate's. Sharded (``shard_degree`` > 1), the weights are FSDP2's bf16 shards (fsdp refuses fp8
    storage); the adapter's parameters and state are split over the shard degree, the token-proportional parts over
    the sequence degree.

    Block swap sharded (``settings.blocks_to_swap`` = N, FSDP2's CPU offload of the last N blocks: the model): those
    blocks' frozen shards and their LoRA's shards, gradients and AdamW moments leave the GPU for the host
    (``rank_offload.offloaded_shards``, ``host_bytes``); the GPU keeps ``gathered blocks``, two blocks whole at a
    time (the one running and the one prefetched, as without swap) plus, for each of the two that is an offloaded
    block, its shard copied to the GPU for the all-gather (a resident block's own shard is part of its whole
    weights). Each offloaded shard crosses the host link twice per step (the forward, and the backward's recompute
    all-gathers it again) and its LoRA gradient once (``link_bytes``)."""
    check_layout(variant, layout)
    settings = settings if settings is not None else MemorySettings("bf16")
    single = memory.estimate(variant, settings, width=width, height=height, frames=frames, rank=rank,
                             batch=batch, layers=layers, adapter=adapter, attention=attention,
                             gradient_checkpointing=gradient_checkpointing)
    s, q = layout.shard_degree, layout.sequence_degree
    p = single.parts
    trainable = (lora_shard_params(variant, rank, s, layers) * LORA_BYTES_PER_PARAM if adapter == LORA
                 else p["LoRA + optimizer"] / s)  # other types: their rows split alike (rounding not counted)
    link, host = single.link_bytes, 0.0
    if s > 1:
        weights, largest = sharded_weight_bytes(variant, s, layers)
        gathered = 2.0 * largest * (1.0 - 1.0 / s)
        swap = settings.blocks_to_swap
        if swap:  # FSDP2's CPU offload of the last ``swap`` blocks' shards (the one-GPU ring is not used)
            frozen, lora, _ = offloaded_shards(variant, s, swap, rank, layers)
            n = layers if layers is not None else planner_kwargs_layers(variant)
            lora = lora if adapter == LORA else trainable * min(swap, n) / n
            weights, trainable, host = weights - frozen, trainable - lora, frozen + lora
            gathered += min(swap, 2) * largest / s  # an offloaded block's shard, copied up for its all-gather
            _, blocks = memory.weight_bytes(variant, settings.base_dtype, layers)
            one_gpu = 2.0 * sum(blocks[len(blocks) - min(swap, len(blocks)):])  # the one-GPU swap's share of link
            link = link - one_gpu + 2.0 * frozen + lora / LORA_BYTES_PER_PARAM * 4.0
    else:  # whole on every GPU: the one-GPU figures (Ulysses runs with block swap and fp8 storage)
        weights, gathered = p["weights resident"] + p["swap buffers"], 0.0
    # the token-proportional parts at this GPU's share of the tokens (the text tokens' share of a recomputed block
    # is counted split too: a few percent of it at 832x480x81); the workspace keeps its fixed part whole
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = planner_kwargs(VARIANTS[variant])
    d = kwargs["num_attention_heads"] * kwargs["attention_head_dim"]
    tokens = memory.tokens_of(VARIANTS[variant], width, height, frames, batch) / q
    parts = {
        "weights (shard)": weights,
        "gathered blocks": gathered,
        "LoRA + optimizer": trainable,
        "checkpointed inputs": p["checkpointed inputs"] / q,
        "one recomputed block": p["one recomputed block"] / q,
        **{name: p[name] / q for name in (memory.ADAPTER_PART, "VACE hints") if name in p},
        "sequence exchange": 8.0 * tokens * d * 2.0 if q > 1 else 0.0,
        "workspace": memory.WORKSPACE_FIXED + (p["workspace"] - memory.WORKSPACE_FIXED) / q,
    }
    # Ulysses: all tokens and 1/q of the heads in the attention, so its backward buffer is 1/q of one GPU's
    return RankEstimate(layout, parts, single.attention_backward / q, settings, link, host)


def planner_kwargs_layers(variant: str) -> int:
    """The main blocks of one expert of ``variant`` (what :func:`sharded_weight_bytes` builds)."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    return int(planner_kwargs(VARIANTS[variant])["num_layers"])


def plan_sharded(variant: str, budget_gib: float, layout: Layout, *, base_dtype: str, recompute: str = "auto",
                 **size: Any) -> tuple[RankEstimate | None, RankEstimate]:
    """``model.vram_budget_gb`` under ``model.parallel = "fsdp"``: (the chosen per-GPU estimate or None, the
    smallest). It chooses what fsdp runs with -- ``base_dtype`` as stored (bf16; fp32 for the tiny twins), activation
    offload and block swap (FSDP2's CPU offload of the last N blocks' shards) -- in the one-GPU planner's order
    (:func:`memory.plan`): the first recompute path in which something fits (``auto``: the whole block before the
    lean one), and in it the fitting setting that moves the fewest bytes over this GPU's host link per step (ties:
    fewer swapped blocks, activations on the device). Each candidate is planned per GPU with the shard
    (:func:`rank_estimate` at ``layout``) and its card figure held against the budget. ``size``:
    :func:`rank_estimate`'s size keywords (width, height, frames, rank, batch, adapter, attention, checkpointing)."""
    best: RankEstimate | None = None
    smallest: RankEstimate | None = None
    n = planner_kwargs_layers(variant) if size.get("layers") is None else size["layers"]
    blocks = n if layout.shard_degree > 1 and size.get("gradient_checkpointing", True) else 0
    for settings in memory.candidates(base_dtype, blocks, recompute):
        if best is not None and settings.recompute != best.settings.recompute:
            break
        est = rank_estimate(variant, layout, settings=settings, **size)
        if smallest is None or est.card_gib < smallest.card_gib:
            smallest = est
        if est.card_gib <= budget_gib and (best is None or est.link_bytes < best.link_bytes):
            best = est
    assert smallest is not None
    return best, smallest
