"""One expert per group of GPUs under torchrun (``model.expert_groups = 2``; docs/distributed.md): the model-free
plumbing.

A launch of ``W`` ranks splits into ``count`` groups of ``W / count`` consecutive ranks (:class:`ExpertGroups`):
group 0 (ranks ``0 .. W/count - 1``) trains the run's first expert, group 1 the next. Inside a group the ranks are
data parallel; between groups nothing but the decisions and the metrics travel. Each rank builds only its own
group's expert, so it trains that expert every step and never holds, waits for or swaps the other one.

:class:`ExpertGroupSync` is :class:`~wantrain.core.parallel.distributed.ProcessGroupSync` with these changes:

====================  =============================================  ===============================================
method                scope                                          why
====================  =============================================  ===============================================
``agree_step``,       every rank (unchanged)                         a stop or an out-of-memory error anywhere ends
``agree_requests``                                                   that step, or the run, on every rank
``reduce_metrics``    every rank (unchanged)                         ``train/loss/<expert>`` comes from its group;
                                                                     ``train/loss`` is the mean over the ranks
``average_gradients`` the rank's own group                           the groups train different LoRAs; a
                                                                     non-finite step skips in its group only;
                                                                     sharded (FSDP inside the group): the flag
                                                                     only (FSDP2 reduces the gradients)
``broadcast_parame…`` from each group's leader, inside the group     each group starts from its leader's LoRA
                                                                     (sharded: loaded from it, nothing to send)
``gather_state``      every rank's whole state to rank 0, over the   LoRA weights, optimizer and scheduler differ
                      host (gloo) group, point to point              between groups (the leaders' copies are kept;
                                                                     the other ranks keep their own streams only)
====================  =============================================  ===============================================

LoRA files: :class:`GroupSaver` on every rank; the group leaders' experts' files travel to rank 0, which writes
them (byte for byte what a one-process run of that expert writes: the file is made on rank 0 from the same
tensors and metadata). The transfers of whole states and files run point to point on the host-side gloo group
(no device memory, no all-gather padding), at saves only.

Random streams: every rank draws from the run seed, the draws of its group's global batch, and keeps its own
rows (its data shard is the group's: ``data.shard(rank in group, group size)``), so each group draws what a
one-process run of its expert with the group's global batch draws.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from wantrain.core.errors import UserError
from wantrain.core.parallel.distributed import (
    LEADER_KEY,
    PATIENT_TIMEOUT_S,
    PER_RANK_STATE,
    ProcessGroupSync,
    Topology,
    _decode_tree,
    _encode_tree,
)
from wantrain.core.parallel.expert_relay import ExpertRelay


@attrs.frozen
class ExpertGroups:
    """``count`` groups of consecutive ranks over ``topology``'s world (module docstring)."""

    count: int
    topology: Topology

    @property
    def size(self) -> int:
        """Ranks per group."""
        return self.topology.world_size // self.count

    @property
    def group(self) -> int:
        """This rank's group (0: the first expert)."""
        return self.topology.rank // self.size

    @property
    def rank_in_group(self) -> int:
        return self.topology.rank % self.size

    def leader(self, group: int) -> int:
        """The global rank of ``group``'s first rank."""
        return group * self.size

    @property
    def is_leader(self) -> bool:
        return self.rank_in_group == 0

    def members(self, group: int) -> list[int]:
        return list(range(group * self.size, (group + 1) * self.size))


def expert_groups_of(count: int, topology: Topology) -> ExpertGroups | None:
    """The groups of ``model.expert_groups = count`` on ``topology``: None for 1; refused (one line) when the
    launch cannot be split (one process, a world size that is not a multiple of ``count``)."""
    if count <= 1:
        return None
    world = topology.world_size
    if world < count or world % count:
        started = "one process" if world == 1 else f"{world} processes"
        raise UserError(f"model.expert_groups = {count} needs a torchrun launch of a multiple of {count} processes "
                        f"(one group of GPUs per expert), and this run has {started}; launch with torchrun "
                        f"--nproc_per_node {count} (or {2 * count}, ...) or set model.expert_groups = 1")
    return ExpertGroups(count, topology)


class ExpertGroupSync(ProcessGroupSync):
    """The trainer's link to the other ranks when each group of ranks trains its own expert (module docstring)."""

    def __init__(self, topology: Topology, device: torch.device, groups: ExpertGroups, own: Any = None,
                 patient: Any = None, experts: Sequence[str | None] = ()) -> None:
        super().__init__(topology, device, patient)
        self.groups = groups
        self.experts = tuple(experts)  # every group's expert, in group order: what the run trains (RunStarted)
        self._grads_group = own  # this rank's group (None: the default group, when the world is one group)
        self._grads_world = groups.size
        self._grads_source = groups.leader(groups.group)
        self._relays: dict[str | None, ExpertRelay] | None = None

    @classmethod
    def start(cls, topology: Topology, device: torch.device, *, groups: ExpertGroups,  # type: ignore[override]
              experts: Sequence[str | None] = (), timeout_s: float = 1800.0,
              patient_timeout_s: float = PATIENT_TIMEOUT_S) -> ExpertGroupSync:
        import torch.distributed as dist

        base = ProcessGroupSync.start(topology, device, timeout_s=timeout_s, patient_timeout_s=patient_timeout_s)
        own = None
        for g in range(groups.count):  # new_group is a collective of the default group: every rank, same order
            made = dist.new_group(groups.members(g), timeout=datetime.timedelta(seconds=timeout_s))
            if g == groups.group:
                own = made
        sync = cls(topology, device, groups, own, base._patient, experts)
        sync.watch = base.watch
        return sync

    @property
    def group_process_group(self) -> Any:
        """The process group of this rank's expert group (what its sharded expert loads over)."""
        return self._grads_group

    def average_gradients(self, params: Sequence[torch.nn.Parameter], nonfinite: torch.Tensor) -> None:
        """Unsharded: :meth:`ProcessGroupSync.average_gradients` over this rank's group. Sharded (FSDP inside the
        group, :meth:`shard`): FSDP2 has reduce-scattered the gradients over the group's mesh in the backward, so
        only the non-finite flag travels, over the group (a non-finite step skips in its group only, as unsharded).
        Device-side, no sync."""
        if not self.sharded:
            super().average_gradients(params, nonfinite)
            return
        import torch.distributed as dist

        bad = nonfinite.to(torch.float32).reshape(1)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self._grads_group)
        nonfinite.copy_(bad.reshape(()))

    # -- metrics: each group's figures, then the whole model's ---------------------------------------------------
    def reduce_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """:meth:`ProcessGroupSync.reduce_metrics` with the whole-model figures made from every group's: a rank
        sends its norms (:data:`WHOLE_MODEL_NORMS`) and non-finite counts (:data:`WORST_OF_EXPERTS`) under
        ``<name>/<its expert>`` (the mean over a group's ranks, which hold the same value, is that value), and the
        whole-model value is then ``sqrt(sum over experts of value^2)`` (as one process computes it over both
        experts' tensors) or the largest over the experts. docs/metrics.md, "One expert per group of GPUs"."""
        mine = self.experts[self.groups.group]
        renamed = {}
        for name, value in values.items():
            if name in WHOLE_MODEL_NORMS or name in WORST_OF_EXPERTS or name == FIRST_GROUP_LR:
                renamed[f"{name}/{mine}"] = value
            else:
                renamed[name] = value
        out = super().reduce_metrics(renamed)
        if f"{FIRST_GROUP_LR}/{self.experts[0]}" in out:  # as one process: the first parameter group's
            out[FIRST_GROUP_LR] = out[f"{FIRST_GROUP_LR}/{self.experts[0]}"]
        for name in (*WHOLE_MODEL_NORMS, *WORST_OF_EXPERTS):
            parts = [out[f"{name}/{e}"] for e in self.experts if f"{name}/{e}" in out]
            if not parts:
                continue
            out[name] = max(parts) if name in WORST_OF_EXPERTS else math.sqrt(sum(v * v for v in parts))
            if name in _PER_EXPERT_ELSEWHERE:  # the norms observer's train/param_norm/<expert> says it already
                for e in self.experts:
                    out.pop(f"{name}/{e}", None)
        return out

    # -- the other groups' experts, called from rank 0 (samples) ----------------------------------------------
    def relays(self) -> dict[str | None, ExpertRelay]:
        """Rank 0's link to each other group's expert, by expert (``core.parallel.expert_relay``): on rank 0 the
        callers, on those groups' leaders the servers, on every rank the same dict (the same objects serve both ends).
        Point to point on the host-side gloo group."""
        if self._relays is None:
            self._relays = {self.experts[g]: ExpertRelay(self._patient_group, self.topology.rank,
                                                         self.groups.leader(g), self.experts[g], self.device)
                            for g in range(1, self.groups.count)}
        return self._relays

    # -- state and files: to rank 0, point to point on the host group ------------------------------------------
    def _send_to_rank0(self, payload: bytes | None) -> list[bytes] | None:
        """Rank 0: every rank's ``payload`` in rank order (its own first). Others: send theirs, return None. On
        the gloo group (host memory only): a length, then the bytes."""
        import torch.distributed as dist

        group = self._patient_group()
        if not self.is_main:
            data = payload or b""
            dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=0, group=group)
            if data:
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=group)
            return None
        out = [payload or b""]
        for rank in range(1, self.topology.world_size):
            length = torch.zeros(1, dtype=torch.int64)
            dist.recv(length, src=rank, group=group)
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
            if len(buf):
                dist.recv(buf, src=rank, group=group)
            out.append(bytes(buf.numpy().tobytes()))
        return out

    def gather_state(self, tree: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0: ``tree`` plus ``ranks``: each group leader's whole state (its expert's LoRA, optimizer,
        scheduler, observers, streams), each other rank's own streams and its leader's index (:data:`LEADER_KEY`).
        Other ranks: None. Called by every rank at each save."""
        groups = self.groups
        if groups.is_leader:
            own = dict(tree)
        else:
            own = {k: tree[k] for k in PER_RANK_STATE if k in tree}
            own[LEADER_KEY] = groups.leader(groups.group)
        parts = self._send_to_rank0(_encode_tree(own) if not self.is_main else None)
        if parts is None:
            return None
        return {**tree, "ranks": [own if i == 0 else _decode_tree(p) for i, p in enumerate(parts)]}


WHOLE_MODEL_NORMS = ("train/grad_norm", "train/total_param_norm", "train/lora_norm", "train/lora_norm_start")
"""L2 norms over every expert's LoRA: with expert groups, ``sqrt`` of the sum of the groups' squares."""
WORST_OF_EXPERTS = ("train/nan_streak_max", "train/nan_skipped_steps")
"""Counts of non-finite steps: with expert groups, the largest over the experts (the guard stops the run when
one expert's streak reaches ``train.max_consecutive_nan``)."""
_PER_EXPERT_ELSEWHERE = ("train/total_param_norm",)
FIRST_GROUP_LR = "train/lr"
"""The first parameter group's LR (one process: the high-noise expert's): with expert groups, the first group's."""

LoraFile = tuple[str, dict[str, torch.Tensor], dict[str, str]]
"""A LoRA file to write: its name in the run directory, its tensors and its safetensors metadata."""


class GroupSaver:
    """Every rank's saver under expert groups. ``files(step, final)`` gives this rank's expert's LoRA files (group
    leaders; None elsewhere), ``write(name, tensors, metadata)`` writes one and returns its path (rank 0). Each
    leader's files travel to rank 0, which writes them in group order and returns every path; the others return
    ``[]``. Every rank calls :meth:`save` at each LoRA save (the trainer does). Sharded (FSDP inside the groups):
    every rank calls ``files`` (the all-gathers of its group's shards; only the leader's returns files)."""

    def __init__(self, sync: ExpertGroupSync, files: Callable[[int, bool], Sequence[LoraFile]] | None,
                 write: Callable[[str, dict[str, torch.Tensor], dict[str, str]], str] | None) -> None:
        self.sync, self.files, self.write = sync, files, write

    def save(self, step: int, final: bool) -> list[str]:
        gathers = self.sync.groups.is_leader or self.sync.sharded  # sharded: the whole group gathers
        mine = list(self.files(step, final)) if self.files is not None and gathers else []
        mine = mine if self.sync.groups.is_leader else []
        payload = _encode_files(mine) if mine and not self.sync.is_main else None
        parts = self.sync._send_to_rank0(payload)
        if parts is None:
            return []
        assert self.write is not None
        written = [self.write(*f) for f in mine]
        for part in parts[1:]:
            written += [self.write(*f) for f in _decode_files(part)] if part else []
        return written


def _encode_files(files: Sequence[LoraFile]) -> bytes:
    """LoRA files as bytes without pickle (``_encode_tree``: JSON plus safetensors)."""
    return _encode_tree({"files": [{"name": n, "metadata": m, "tensors": t} for n, t, m in files]})


def _decode_files(payload: bytes) -> list[LoraFile]:
    return [(f["name"], f["tensors"], f["metadata"]) for f in _decode_tree(payload)["files"]]


__all__ = ["ExpertGroupSync", "ExpertGroups", "GroupSaver", "expert_groups_of"]
