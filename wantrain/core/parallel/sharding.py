"""Sharded base weights on PyTorch's own engine: FSDP2 ``fully_shard`` per block, and the trainable state (the LoRA
and its optimizer state, never the base weights) through ``torch.distributed.checkpoint`` (docs/distributed.md,
"Sharded base weights").

Model-free: the caller names the blocks (for a Wan transformer, ``transformer.blocks``) and owns the optimizer.

- :func:`shard_per_block` wraps each block, then the root, with ``fully_shard``. Every parameter of a block, frozen
  base weight and trainable LoRA alike, becomes a ``DTensor`` holding ``1/N`` of the rows on each of the ``N``
  ranks; a block's full weights exist only between its all-gather and its reshard (forward, and again in the
  backward). Gradients are reduce-scattered (averaged over the ranks) in ``reduce_dtype``: the one-process gradient
  of the global batch, each rank holding its rows. No flat all-reduce of ``core.parallel.distributed`` is needed for
  them.
- :func:`save_trainable` / :func:`load_trainable` write and read the trainable parameters and the optimizer state by
  their global names and shapes (DCP: one safetensors file per rank), so a checkpoint written by ``N`` ranks is
  read by ``M`` (one process included, without a process group): the resharding is DCP's.
- :func:`load_from_rank0` fills a model sharded on ``meta`` from rank 0's whole state on the host: each rank
  allocates its shards only, and each tensor travels whole from rank 0 one at a time (then sliced), so no rank but
  0 ever holds the whole model, and rank 0 holds it on the host only.
- :func:`full_trainable` gathers the trainable parameters as whole tensors on rank 0 (every rank calls it; an
  all-gather per parameter), for the tests' twins; ``wantrain run``'s saves use :func:`whole_to_writer`, a gather
  to the writing rank alone.

No pickle: the files are DCP's safetensors storage (``HuggingFaceStorageWriter``, each rank its own file, the
offsets of its shards in the file's JSON header); only tensors travel (the optimizer's hyperparameters come from
the config and the scheduler). DCP's default writer would pickle its ``.metadata`` and any non-tensor value.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn


def shard_per_block(module: nn.Module, blocks: Sequence[nn.Module], *, mesh: Any = None,
                    param_dtype: torch.dtype | None = torch.bfloat16,
                    reduce_dtype: torch.dtype | None = torch.float32,
                    gradient_divide_factor: float | None = None, on_host: Sequence[nn.Module] = (),
                    pin: bool = False) -> nn.Module:
    """``fully_shard`` each of ``blocks`` and then ``module`` itself (the embeddings and head left over) on
    ``mesh`` (None: every rank of the default group), in place; returns ``module``.

    ``on_host``: those of ``blocks`` whose shards live in host memory (block swap under FSDP,
    ``model.blocks_to_swap``): FSDP2's ``CPUOffloadPolicy`` for them, so their shards (frozen and LoRA alike), their
    gradients and the optimizer's step on them stay on the host; each forward and backward copies the block's
    shards to the device before its all-gather, and its reduce-scattered gradient back. ``pin``: pinned host shards
    (CUDA only: the copies overlap). Materialise the module with :func:`materialise` (those blocks on the CPU).

    ``param_dtype``: the dtype a block's weights are all-gathered and computed in (bf16 on a GPU; None keeps each
    parameter's own, fp32 for the CPU tests' exactness); ``reduce_dtype``: the dtype gradients are averaged in
    (fp32). The LoRA's own parameters keep their fp32 storage: the sharded copy is what the optimizer steps, so the
    optimizer is built after this call, over ``module.parameters()`` (the ``DTensor`` parameters replace the
    originals). Blocks reshard after their forward (the default), so at most one block's full weights (two while
    the next is prefetched) live at once.

    ``gradient_divide_factor``: what the gradients summed over every rank of ``mesh`` are divided by (None: the
    ranks, a mean). Ranks that split one sample's tokens (Ulysses) each hold a share of its gradient, so they are
    summed and divided by the data-parallel size only (``wan22.sequence.split_sequences``). A sum in fp32 and a
    division after it: the same arithmetic on gloo (which has no pre-multiplied sum) as on NCCL."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    host = {id(block) for block in on_host}
    for part in [*blocks, module]:
        offload = CPUOffloadPolicy(pin_memory=pin) if id(part) in host else OffloadPolicy()
        fully_shard(part, mesh=mesh, mp_policy=policy, offload_policy=offload)
        if gradient_divide_factor is not None:
            part.set_gradient_divide_factor(gradient_divide_factor)
            part.set_force_sum_reduction_for_comms(True)
    return module


def held_on_host(part: nn.Module) -> bool:
    """Whether ``part`` (a module :func:`shard_per_block` wrapped) keeps its shards on the host (``on_host``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    state = getattr(part, "_get_fsdp_state", None)
    group = state()._fsdp_param_group if state is not None else None
    return group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)


def materialise(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)`` for a module sharded on ``meta``, except the blocks held on the host
    (:func:`held_on_host`), allocated on the CPU (FSDP2 refuses offloaded shards anywhere else): each module's own
    tensors, children first (a wrapped module re-registers its shards after its own)."""
    def walk(part: nn.Module, where: torch.device) -> None:
        where = torch.device("cpu") if held_on_host(part) else where
        for child in part.children():
            walk(child, where)
        part.to_empty(device=where, recurse=False)

    walk(module, torch.device(device))


def load_from_rank0(module: nn.Module, source: nn.Module | None, device: torch.device) -> None:
    """Fill ``module`` -- built on ``meta`` and sharded (:func:`shard_per_block`) on every rank -- with the values
    of ``source``, the same model whole on rank 0's host (None on the other ranks). Every rank calls it.

    :func:`materialise` allocates this rank's shards on ``device`` (uninitialised; host-held blocks' on the CPU); then
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` sends rank 0's tensors one at a time:
    each arrives whole on every rank's ``device`` and is sliced into the shards, so a rank's peak at load is its
    shards plus the largest tensor whole. The non-persistent buffers (a state dict has none: the RoPE tables) are
    broadcast after it, each whole (they are never sharded). Parameters, buffers and their dtypes must match
    ``source``'s (the same build, prepared alike)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    materialise(module, device)
    full = get_model_state_dict(source) if source is not None else {}  # plain tensors, names without wrappers
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    persistent = set(module.state_dict())
    held = dict(source.named_buffers()) if source is not None else {}
    for name, buffer in module.named_buffers():  # every rank, in the same module order
        if name in persistent:
            continue
        if source is not None:
            buffer.copy_(held[name])
        dist.broadcast(buffer, src=0)


def load_from_leader(module: nn.Module, source: nn.Module | None, device: torch.device, mesh: Any,
                     group: Any = None) -> None:
    """:func:`load_from_rank0` inside a group of ranks: ``module`` is sharded on ``mesh`` (one expert group's
    ranks, :func:`group_shard_mesh`), ``source`` is the model whole on the group's first rank (its leader; None on
    the others). Each tensor travels whole from the leader to the group only (a broadcast on ``group``: the
    process group of the expert group's ranks, by default the 1-D mesh's own) and each rank keeps its rows (sliced
    locally), so groups load their experts side by side and a rank's peak is its shards, the buffers and one
    tensor whole. Every rank of the group calls it, in the same order. A 2-D ``mesh`` (HSDP inside the group)
    needs ``group``."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    materialise(module, device)
    group = group if group is not None else mesh.get_group()
    leader = dist.get_global_rank(group, 0)
    held = dict(source.named_parameters()) | dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            if source is not None:
                full.copy_(held[name])
            dist.broadcast(full, src=leader, group=group)
            if is_sharded(tensor):
                mine = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(mine.to_local())
            else:
                tensor.copy_(full)
            del full


def group_shard_mesh(device_type: str, world_size: int, groups: int, shard_degree: int | None = None) -> Any:
    """This rank's shard mesh when ``world_size`` ranks split into ``groups`` groups of consecutive ranks, each
    sharding its own model (``model.expert_groups`` with ``model.parallel = "fsdp"``: one expert per group): the
    ``shard`` dimension of the 2-D mesh ``(expert, shard)``, whose group is this rank's expert group. With a
    ``shard_degree`` below the group's size, HSDP inside the group: the ``(replicate, shard)`` dimensions of the
    3-D mesh ``(expert, replicate, shard)`` (``shard_degree`` consecutive ranks hold one copy)."""
    from torch.distributed.device_mesh import init_device_mesh

    size = world_size // groups
    degree = shard_degree or size
    if degree == size:
        mesh = init_device_mesh(device_type, (groups, size), mesh_dim_names=("expert", "shard"))
        return mesh["shard"]
    mesh = init_device_mesh(device_type, (groups, size // degree, degree),
                            mesh_dim_names=("expert", "replicate", "shard"))
    return mesh["replicate", "shard"]


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def trainable_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """The trainable parameters of ``module`` and the state of ``optimizer`` by global names (sharded
    ``DTensor``\\ s under FSDP, plain tensors in one process), as ``get_state_dict`` gives them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(module, optimizer, options=_options())


def _tensors(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of both states under flat names (``lora/<name>``, ``optim/<name>/<key>``): what travels through
    DCP. The optimizer's hyperparameters (``param_groups``) stay out: the config and the LR scheduler give them, and
    non-tensor values would go through pickle."""
    flat = {f"lora/{name}": value for name, value in model_state.items()}
    for name, entries in optim_state.get("state", {}).items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                flat[f"optim/{name}/{key}"] = value
    return flat


def _storage(path: str | Path, *, writing: bool) -> Any:
    """DCP's safetensors storage (its index is JSON; the default writer's ``.metadata`` is a pickle)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    if writing:
        return HuggingFaceStorageWriter(str(path), save_distributed=True)
    return HuggingFaceStorageReader(str(path))


def save_trainable(path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the trainable state of ``module`` and ``optimizer`` under ``path`` (a folder of safetensors files,
    one per rank, and a JSON index). Every rank calls it (a collective plan and a barrier). The base weights are
    never written."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_tensors(*trainable_state(module, optimizer)), storage_writer=_storage(path, writing=True))


def load_trainable(path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read what :func:`save_trainable` wrote (at any world size) into ``module`` and ``optimizer``, resharded to
    this run's layout. Every rank calls it. The optimizer must hold its state tensors already (an AdamW creates them
    at its first step: :func:`initialise_optimizer_state`); DCP fills tensors, it creates none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_state, optim_state = trainable_state(module, optimizer)
    with warnings.catch_warnings():  # one process (no group) is a layout of its own here, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(_tensors(model_state, optim_state), storage_reader=_storage(path, writing=False))
    # strict=False: the frozen base weights are not in the state (a trainable tensor missing from the files is
    # refused by dcp.load above)
    set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=_options(strict=False))


def initialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` its state tensors without changing a parameter: one step with zero gradients and a
    learning rate of zero (AdamW's moments stay zero, its decoupled decay is ``lr * wd = 0``), then the step
    counters back to zero. What DCP needs to load an optimizer state into (it fills tensors, it creates none)."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()


def full_trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``module`` as whole tensors on the CPU, by global name. Every rank calls it
    under FSDP (an all-gather per parameter); rank 0 receives them, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(module, options=_options(full_state_dict=True, cpu_offload=True))
    return {name: value.detach().clone() for name, value in state.items()}


def local_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s parameters this rank holds: its shard of each ``DTensor``, a plain parameter
    whole."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


# -- what ``wantrain run`` needs around a sharded model (model.parallel = "fsdp") -----------------------------------
def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter, gradient or optimizer state of a sharded module)."""
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "full_tensor")


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or the whole tensor of a ``DTensor`` (an all-gather: every rank calls it, in the same
    order)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


@torch.no_grad()
def whole_to_writer(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """For a save: ``tensor`` whole, on the CPU, in ``dtype`` (None: its own), on the rank that writes -- the first
    of a ``DTensor``'s device mesh (rank 0; with expert groups the group's leader) -- and an empty ``meta`` tensor
    of the whole shape on the mesh's other ranks (shapes only: what they compute from it is dropped). Every rank of
    the mesh calls it, in the same order.

    A ``DTensor`` sharded on one mesh dimension (FSDP2's ``Shard(0)``; HSDP's ``(Replicate, Shard(0))``) travels to
    the writer alone: the ranks of the writer's copy send their rows (padded to the largest shard) in one
    ``gather``, the other copies send nothing, and no rank but the writer ever holds more than its shard (the
    writer: its shards and one tensor whole on the device, the whole state on the host). Any other layout is
    all-gathered, then dropped off the writer. A plain tensor: on the CPU on every rank (each holds it whole)."""
    dtype = dtype or tensor.dtype
    if not is_sharded(tensor):
        return tensor.detach().to("cpu", dtype)
    import torch.distributed as dist

    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate()
    writer, absent = all(c == 0 for c in coordinate), torch.empty(tensor.shape, dtype=dtype, device="meta")
    split = [d for d, p in enumerate(placements) if not p.is_replicate()]
    if len(split) != 1 or not placements[split[0]].is_shard():
        full = tensor.full_tensor()
        return full.to("cpu", dtype) if writer else absent
    (dim,) = split
    if any(c != 0 for d, c in enumerate(coordinate) if d != dim):
        return absent  # another copy of the rows (HSDP): the writer's own copy sends them
    axis, ranks = placements[dim].dim, mesh.size(dim)
    rows = tensor.shape[axis]
    chunk = -(-rows // ranks)  # torch.chunk's sizes, as DTensor's Shard: the last ranks may hold fewer or none
    local = tensor.detach().to_local().contiguous()
    send = local
    if local.shape[axis] != chunk:
        send = local.new_zeros(*local.shape[:axis], chunk, *local.shape[axis + 1:])
        send.narrow(axis, 0, local.shape[axis]).copy_(local)
    group = mesh.get_group(dim)
    if coordinate[dim] != 0:
        dist.gather(send, None, group=group, group_dst=0)
        return absent
    pieces = [torch.empty_like(send) for _ in range(ranks)]
    dist.gather(send, pieces, group=group, group_dst=0)
    held = [min(chunk, max(0, rows - k * chunk)) for k in range(ranks)]
    return torch.cat([p.narrow(axis, 0, n).to("cpu", dtype) for p, n in zip(pieces, held, strict=True)], dim=axis)


def like(value: torch.Tensor, target: Any) -> torch.Tensor:
    """``value`` (a whole tensor every rank holds alike: read from a checkpoint) laid out as ``target``: this
    rank's shard of it when ``target`` is a ``DTensor`` (sliced locally, nothing travels), on the device of
    ``target``'s shard (the host for a block FSDP2 offloads), else ``value``."""
    if not is_sharded(target) or is_sharded(value) or value.shape != target.shape:
        return value
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    device = target.to_local().device  # a block held on the host (FSDP2's CPU offload): its state stays there too
    if out.to_local().device != device:
        out = DTensor.from_local(out.to_local().to(device), target.device_mesh, target.placements, run_check=False,
                                 shape=target.shape, stride=target.stride())
    return out


def shard_mesh(device_type: str, world_size: int, shard_degree: int | None = None) -> Any:
    """The device mesh of ``world_size`` ranks: one dimension (``shard``) when every rank shares one copy of the
    weights, else HSDP's two, ``(replicate, shard)``: groups of ``shard_degree`` consecutive ranks (a node) each
    hold one copy, sharded inside the group; the groups replicate it (FSDP2 all-reduces their gradients).

    With Ulysses (``model.sequence_degree``) the sequence groups are folded into this shard dimension, as
    torchtitan folds its context-parallel ranks: the sequence mesh (dp, ring, ulysses) of consecutive ranks and
    this one cover the same ranks in the same order, so a block's weights are sharded over dp x sequence ranks
    while the all-to-alls run inside each sequence group."""
    from torch.distributed.device_mesh import init_device_mesh

    degree = shard_degree or world_size
    if degree == world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world_size // degree, degree), mesh_dim_names=("replicate", "shard"))


def compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The ``param_dtype`` for :func:`shard_per_block`: None when every parameter of ``module`` has one dtype
    (each is gathered as it is: fp32 twins stay exact), else bfloat16 (a bf16 base with an fp32 LoRA: FSDP2
    all-gathers one dtype per block)."""
    dtypes = {p.dtype for p in module.parameters()}
    return None if len(dtypes) == 1 else torch.bfloat16


def summed_over_shards(value: torch.Tensor, sharded: Any) -> torch.Tensor:
    """``value`` (a 0-dim partial result over this rank's shards, such as a sum of squares) summed over the ranks
    that shard ``sharded`` (a ``DTensor``): over the mesh dimensions it is sharded on, not over HSDP's replicas.
    A device-side all-reduce, no host sync; every rank calls it."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    placements = [Partial() if p.is_shard() else Replicate() for p in sharded.placements]
    return DTensor.from_local(value, sharded.device_mesh, placements, run_check=False).full_tensor()
