"""Data parallelism across processes started by ``torchrun``: the model-free plumbing (docs/distributed.md).

Every process (rank) trains the same LoRA on its own share of each global batch. The trainer talks to the other
ranks through one object, a :class:`SingleProcess` (one process: every method is the identity, nothing is
exchanged) or a :class:`ProcessGroupSync` (``torch.distributed``: gloo on the CPU, NCCL on CUDA). Its methods are
called at fixed points of ``Trainer.run``, by every rank in the same order, so the collectives always match:

====================  =============================================  ===============================================
when                  method                                         what travels
====================  =============================================  ===============================================
after the micro-steps :meth:`~ProcessGroupSync.agree_step`           two host flags (stopped, out of memory), MAX;
                                                                     where the forward exchanges (fsdp, Ulysses) an
                                                                     out-of-memory error fails every rank instead
                                                                     (``core.parallel.failures``)
before GradsReady     :meth:`~ProcessGroupSync.average_gradients`    the active expert's LoRA gradients and the
                                                                     non-finite-loss flag, one flat buffer per dtype
at log steps only     :meth:`~ProcessGroupSync.reduce_metrics`       the names (JSON) and values of
                                                                     ``MetricsLogged``; rank 0's result is broadcast
before the saves      :meth:`~ProcessGroupSync.agree_requests`       two host flags (stop, save requested), MAX
at saves              :meth:`~ProcessGroupSync.gather_state`         each rank's own state (RNG, data position,
                                                                     counters) to rank 0, which writes
====================  =============================================  ===============================================

Decisions are therefore made once: an out-of-memory error or a stop on any rank ends that step (or the run) on
every rank; the gradients are identical after the all-reduce, so the non-finite guard, clipping and the optimizer
step agree without another exchange; observers deciding from ``MetricsLogged.values`` (the alpha controller, the
guard) see rank 0's reduced values on every rank and decide identically. No pickle travels: text goes as UTF-8
bytes, state as JSON plus safetensors bytes.

Each ``agree_*`` call is one small all-reduce of host values (a device->host sync on NCCL): two per optimizer step,
negligible beside a video-diffusion step and the gradient all-reduce itself.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from wantrain.core.errors import UserError
from wantrain.core.parallel.failures import RankFailed, failure_line, first_line, watch_default_group

PATIENT_TIMEOUT_S = 7 * 24 * 3600.0
"""How long ranks wait for rank 0's own work (:meth:`ProcessGroupSync.wait_for_rank0`: filling the cache, a round
of samples): far beyond any such job, so in practice no timeout, while a rank 0 that died still ends the wait
(torchrun also ends the others)."""

PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What a collective raises when a peer process is gone (gloo's TCP transport): :meth:`ProcessGroupSync.fail`
reports it as the peer's end, not as this rank's bug."""

PER_RANK_STATE = ("train_state", "generator", "rng", "data", "metrics", "interval")
"""Keys of ``Trainer.state_dict()`` that differ between ranks (each rank's random streams, data position, micro-step
counter, pending metric sums and the log interval's losses); everything else (LoRA weights, optimizer, scheduler,
observers) is identical on every rank and saved once."""


LEADER_KEY = "expert_group_leader"
"""In a checkpoint written by expert groups (``core.parallel.expert_groups``), the per-rank entry of a rank that is not
its group's leader holds only its own :data:`PER_RANK_STATE` and this key: the rank of the leader whose LoRA, optimizer
and scheduler it shares (:func:`rank_view` reads it)."""


@attrs.frozen
class Topology:
    """Where this process stands: ``rank`` of ``world_size``, ``local_rank`` on its machine."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect_topology(environ: Mapping[str, str] | None = None) -> Topology:
    """The topology torchrun describes in ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; one process without them."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Topology()
    return Topology(rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", env["RANK"])))


def rank_view(tree: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """The state tree rank ``rank`` restores: the shared parts of a checkpoint plus its own :data:`PER_RANK_STATE`
    (a one-process checkpoint has no ``ranks`` entry and is returned as it is). A rank the checkpoint never had
    (a sharded run resumed on more ranks) gets rank 0's: the same counters, data position and random streams (every
    rank draws the global batch's timesteps and noise from the same stream and keeps its own rows)."""
    out = {k: v for k, v in tree.items() if k != "ranks"}
    ranks = tree.get("ranks")
    if ranks:
        own = dict(ranks[rank] if rank < len(ranks) else ranks[0])
        leader = own.pop(LEADER_KEY, None)  # core.parallel.expert_groups: the group leader's LoRA, optimizer, scheduler
        if leader is not None:
            out.update(ranks[leader])
        out.update(own)
    return out


def checkpoint_world_size(tree: Mapping[str, Any]) -> int:
    """How many ranks wrote the checkpoint ``tree`` (1 when it has no per-rank state)."""
    return len(tree.get("ranks") or ()) or 1


class SingleProcess:
    """One process: nothing to agree on, nothing to exchange."""

    topology = Topology()
    is_main = True
    exchanges_gradients = False  # the trainer skips average_gradients (and its flag bookkeeping) altogether
    sharded = False  # no FSDP2 in one process
    forward_exchanges = False

    def mirrored_calls(self) -> Any:
        return None

    def agree_step(self, ended: str | None, control: Any, step: int = 0) -> str | None:
        return ended

    def fail(self, exc: BaseException) -> Any:
        return None

    def watch_checkpoints(self, directory: Any) -> None:
        return None

    def writing(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def average_gradients(self, params: Sequence[torch.nn.Parameter], nonfinite: torch.Tensor) -> None:
        return None

    def reduce_metrics(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def agree_requests(self, control: Any) -> None:
        return None

    def should_stop(self, control: Any) -> bool:
        return control.stop_requested

    def gather_state(self, tree: dict[str, Any]) -> dict[str, Any] | None:
        return tree

    def broadcast_text(self, text: str | None) -> str:
        assert text is not None
        return text

    def barrier(self) -> None:
        return None

    def wait_for_rank0(self) -> None:
        return None

    def sum_values(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]
        return None

    def broadcast_parameters(self, params: Sequence[torch.Tensor]) -> None:
        return None

    def close(self) -> None:
        return None


class ProcessGroupSync:
    """The trainer's link to the other ranks over the default ``torch.distributed`` process group.

    :meth:`start` initialises the group from torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``): NCCL when ``device`` is CUDA, gloo otherwise. Collectives run on ``device`` (NCCL needs CUDA
    tensors); host values are copied there and back.
    """

    def __init__(self, topology: Topology, device: torch.device, patient: Any = None) -> None:
        self.topology = topology
        self.is_main = topology.is_main
        self.device = device
        self._stop_agreed = False
        # whom the gradients are averaged over and the LoRA's start comes from: every rank, from rank 0 (an
        # ExpertGroupSync narrows them to its expert's group and that group's leader)
        self._grads_group: Any = None
        self._grads_world = topology.world_size
        self._grads_source = 0
        self._patient = patient  # a gloo group with a long timeout, for wait_for_rank0 (created lazily if None)
        self.sharded = False  # model.parallel = "fsdp": FSDP2 reduces the gradients and each rank holds its shard
        self._sequence_degree = 1
        self._mirror: Any = None  # mirrored_calls()
        self.watch: Any = None  # core.parallel.failures.FailureWatch: the side channel of failures (start())

    @property
    def forward_exchanges(self) -> bool:
        """Whether a rank's forward and backward exchange with the other ranks (FSDP2's all-gathers and
        reduce-scatters, Ulysses' all-to-alls): one rank that fails inside them leaves the others waiting there,
        so such a step cannot be skipped together (:meth:`agree_step` fails the run instead)."""
        return self.sharded or self._sequence_degree > 1

    def mirrored_calls(self) -> Any:
        """Under a layout whose forward exchanges (:attr:`forward_exchanges`), the link through which every rank
        repeats rank 0's calls of the trained experts during a round of samples (``core.parallel.mirror``); else
        None (rank 0 samples alone)."""
        from wantrain.core.parallel.mirror import MirroredCalls

        if not self.forward_exchanges:
            return None
        if self._mirror is None:
            self._mirror = MirroredCalls(self._patient_group, self.topology.rank, self.device)
        return self._mirror

    def shard(self) -> None:
        """The model is sharded with FSDP2 (``core.parallel.sharding``): :meth:`average_gradients` then exchanges only
        the non-finite flag (FSDP2 has reduce-scattered the gradients in the backward pass) and
        :meth:`broadcast_parameters` nothing (each rank's shard is its own, cut from the same seeded LoRA)."""
        self.sharded = True

    def split_sequences(self, degree: int) -> None:
        """The model splits each clip's tokens over ``degree`` consecutive ranks (Ulysses, ``model.sequence_degree``):
        each rank's gradients are its tokens' share, so :meth:`average_gradients` sums over every rank and divides
        by the data-parallel size (the sum over each sequence group, the mean over the groups)."""
        self._grads_world = self.topology.world_size // degree
        self._sequence_degree = degree

    @classmethod
    def start(cls, topology: Topology, device: torch.device, *, timeout_s: float = 1800.0,
              patient_timeout_s: float = PATIENT_TIMEOUT_S) -> ProcessGroupSync:
        import torch.distributed as dist

        init_default_group(topology, device, timeout_s=timeout_s)  # no-op when the caller initialised it
        # Every rank creates it, in the same order: a host-side group whose barrier may wait for hours.
        patient = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=patient_timeout_s))
        sync = cls(topology, device, patient)
        sync.watch = watch_default_group(topology.rank)
        return sync

    def close(self) -> None:
        import torch.distributed as dist

        if self.watch is not None:
            self.watch.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- decisions ---------------------------------------------------------------------------------------------
    def _any(self, flags: Sequence[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over the ranks (one all-reduce; a sync point)."""
        import torch.distributed as dist

        t = torch.tensor([float(f) for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [v > 0 for v in t.tolist()]

    def agree_step(self, ended: str | None, control: Any, step: int = 0) -> str | None:
        """The end of this step's micro-steps as every rank sees it: ``"stopped"`` when any rank was stopped
        between micro-steps, else ``"out of memory"`` when any rank ran out of memory, else None.

        Where the forward exchanges (:attr:`forward_exchanges`) a rank that ran out of memory does not come here
        with the others (they wait in the forward's collective for it): it announces the failure
        (:meth:`fail`) and raises :class:`~wantrain.core.parallel.failures.RankFailed`; the others' watches end
        them."""
        if ended == "out of memory" and self.forward_exchanges:
            layout = "model.parallel = \"fsdp\"" if self.sharded else "model.sequence_degree > 1"
            raise self._announce(f"out of memory at step {step} ({layout}: every forward exchanges with the "
                                 "other ranks, so one rank cannot skip a step alone)")
        stopped, oom = self._any([ended == "stopped", ended == "out of memory"])
        if stopped:
            control.request_stop("stop requested on another rank")
            self._stop_agreed = True
            return "stopped"
        return "out of memory" if oom else None

    def agree_requests(self, control: Any) -> None:
        """Spread a stop or save request (an observer's, a signal's) raised on any rank to every rank."""
        stop, save = self._any([control.stop_requested, control.has_save_request])
        if stop:
            control.request_stop("stop requested on another rank")
        if save:
            control.request_save("save requested on another rank")
        self._stop_agreed = stop

    def _announce(self, cause: str) -> RankFailed:
        """Tell every rank this one failed (the side channel, ``core.parallel.failures``); the error to raise."""
        if self.watch is None:
            return RankFailed(failure_line(self.topology.rank, cause, None))
        return self.watch.announce(cause)

    def fail(self, exc: BaseException) -> RankFailed | None:
        """This rank leaves the run with ``exc``. When another rank failed first (this rank's collective failed
        because that one left), that rank's failure as this rank's error; else every other rank learns of
        ``exc`` and ends within seconds, and None (raise ``exc``). Not for Ctrl-C, which every rank receives."""
        if isinstance(exc, KeyboardInterrupt) or self.watch is None:
            return None
        other = None if isinstance(exc, UserError) else self.watch.other_failure()  # a refusal keeps its line
        if other is not None:
            return other
        if not isinstance(exc, UserError) and any(words in str(exc) for words in PEER_LOST):
            return self.watch.announce("its collective lost a peer rank that ended without a word (killed, out of "
                                       f"host memory, or its machine lost): {first_line(exc)}")
        if not isinstance(exc, RankFailed) and not self.watch.announced:
            self.watch.announce(first_line(exc))
        return None

    def watch_checkpoints(self, directory: Any) -> None:
        """Where the run's checkpoints are, for the line a failure prints (the one to resume from)."""
        if self.watch is not None:
            self.watch.checkpoints = directory

    def writing(self) -> contextlib.AbstractContextManager[Any]:
        """Held around a save (LoRA files, the gathered checkpoint): a failure announced meanwhile names the
        checkpoint to resume from only once it is written, and no watch ends this process halfway through it
        (``core.parallel.failures.FailureWatch.writing``)."""
        return self.watch.writing if self.watch is not None else contextlib.nullcontext()

    def should_stop(self, control: Any) -> bool:
        """The loop's stop test: the stop agreed at the last :meth:`agree_requests` (or :meth:`agree_step`), never
        a request raised since on one rank alone (that one is agreed at the next step's exchange)."""
        return self._stop_agreed

    # -- gradients ---------------------------------------------------------------------------------------------
    exchanges_gradients = True

    def average_gradients(self, params: Sequence[torch.nn.Parameter], nonfinite: torch.Tensor) -> None:
        """Average the gradients of ``params`` over the ranks, in place (a missing gradient counts as zero), with
        one all-reduce per dtype; ``nonfinite`` (a 0-dim float flag, 1.0 where this rank's losses were not finite)
        becomes 1.0 on every rank where it was on any (device-side, no sync).

        A flat buffer instead of DistributedDataParallel: only the LoRA parameters travel, once per optimizer step
        (after the accumulation, so no ``no_sync`` bookkeeping), and the inactive expert may sit on another device.
        """
        import torch.distributed as dist

        if self.sharded:
            bad = nonfinite.to(torch.float32).reshape(1)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            nonfinite.copy_(bad.reshape(()))
            return
        world, pg = self._grads_world, self._grads_group
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        bad = nonfinite.to(torch.float32).reshape(1)
        for dtype, group in by_dtype.items():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            parts = [g.reshape(-1) for g in grads]
            carries_flag = dtype == torch.float32
            if carries_flag:
                parts.append(bad.to(dtype))
            flat = torch.cat(parts)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)
            if carries_flag:
                bad, flat = flat[-1:], flat[:-1]
            flat.div_(world)
            offset = 0
            for p, g in zip(group, grads, strict=True):
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                p.grad = g
                offset += n
        if not any(dtype == torch.float32 for dtype in by_dtype):
            dist.all_reduce(bad, op=dist.ReduceOp.SUM, group=pg)
        nonfinite.copy_((bad > 0).reshape(()))

    def broadcast_parameters(self, params: Sequence[torch.Tensor]) -> None:
        """Copy rank 0's values of ``params`` to every rank (the LoRA's start, as DistributedDataParallel does).

        Collectives run on the group's device only (an NCCL group has no CPU backend): tensors elsewhere (the
        offloaded expert's LoRA, on the host) travel through one flat buffer per dtype on the device and are
        copied back."""
        import torch.distributed as dist

        if self.sharded:
            return
        src, pg = self._grads_source, self._grads_group
        with torch.no_grad():
            away: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in params:
                if _same_device(p.device, self.device):
                    dist.broadcast(p.data, src=src, group=pg)
                else:
                    away.setdefault(p.dtype, []).append(p)
            for group in away.values():
                flat = torch.cat([p.data.reshape(-1).to(self.device) for p in group])
                dist.broadcast(flat, src=src, group=pg)
                offset = 0
                for p in group:
                    n = p.numel()
                    p.data.copy_(flat[offset:offset + n].view_as(p))
                    offset += n

    # -- metrics -----------------------------------------------------------------------------------------------
    def reduce_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """Rank 0's reduction of every rank's log-step values, identical on every rank: the mean over the ranks
        that have the value, and the maximum for ``memory/*`` (the fullest rank is what runs out). Log steps
        only: names travel as JSON, values in one float64 all-reduce."""
        import torch.distributed as dist

        names = sorted(set().union(*(json.loads(t) for t in self._all_texts(json.dumps(sorted(values))))))
        peak = [n.startswith("memory/") for n in names]
        sums = torch.zeros(len(names), dtype=torch.float64)
        counts = torch.zeros(len(names), dtype=torch.float64)
        maxima = torch.full((len(names),), -torch.inf, dtype=torch.float64)
        for i, name in enumerate(names):
            if name in values:
                sums[i], counts[i], maxima[i] = values[name], 1.0, values[name]
        packed = torch.cat([sums, counts]).to(self.device)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        maxima = maxima.to(self.device)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        reduced = torch.cat([packed, maxima])
        dist.broadcast(reduced, src=0)  # rank 0 decides: every rank holds exactly rank 0's numbers
        host = reduced.tolist()
        n = len(names)
        out = {}
        for i, name in enumerate(names):
            total, count, top = host[i], host[n + i], host[2 * n + i]
            if count > 0:
                out[name] = top if peak[i] else total / count
        return out

    # -- text and state ----------------------------------------------------------------------------------------
    def _all_bytes(self, payload: bytes) -> list[bytes]:
        import torch.distributed as dist

        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        lengths = [torch.zeros_like(length) for _ in range(self.topology.world_size)]
        dist.all_gather(lengths, length)
        sizes = [int(t.item()) for t in lengths]
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buf[:0]
        buf = buf.to(self.device)
        bufs = [torch.zeros_like(buf) for _ in sizes]
        dist.all_gather(bufs, buf)
        return [bytes(b[:s].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]

    def _all_texts(self, text: str) -> list[str]:
        return [b.decode("utf-8") for b in self._all_bytes(text.encode("utf-8"))]

    def broadcast_text(self, text: str | None) -> str:
        """Rank 0's ``text`` on every rank (the run directory's path, a refusal)."""
        import torch.distributed as dist

        if self.is_main:
            assert text is not None
            payload = text.encode("utf-8")
        else:
            payload = b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=0)
        buf = torch.zeros(int(length.item()), dtype=torch.uint8)
        if self.is_main and payload:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        buf = buf.to(self.device)
        dist.broadcast(buf, src=0)
        return bytes(buf.cpu().numpy().tobytes()).decode("utf-8")

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def _patient_group(self) -> Any:
        """The gloo group of every rank with a :data:`PATIENT_TIMEOUT_S` timeout. :meth:`start` creates it (every
        rank passes there at the same point); a sync built without one creates it at its first wait
        (``new_group`` is a collective of the default group, which every rank reaches at the same call). Gloo also
        for NCCL runs: a barrier of host processes needs no GPU and keeps NCCL's watchdog out."""
        import torch.distributed as dist

        if self._patient is None:
            self._patient = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PATIENT_TIMEOUT_S))
        return self._patient

    def wait_for_rank0(self) -> None:
        """A barrier without the collective timeout: rank 0 calls it when it has finished a long job alone
        (filling the cache: hours for a large uncached dataset; a round of samples: minutes on A14B), the others
        call it to wait for that. On the patient group (:meth:`_patient_group`), so the default group's timeout
        (``timeout_s``; an NCCL group's 30-minute watchdog) never fires while rank 0 works."""
        import torch.distributed as dist

        dist.barrier(group=self._patient_group())

    def sum_values(self, values: Sequence[float]) -> list[float]:
        """The element-wise sum of every rank's ``values`` (same length on every rank), in float64, identical on
        every rank (rank 0's result is broadcast): one all-reduce and one broadcast."""
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        dist.broadcast(t, src=0)
        return t.tolist()

    def gather_state(self, tree: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0: ``tree`` plus ``ranks``, every rank's :data:`PER_RANK_STATE` in rank order. Other ranks: None.
        Called by every rank at each save."""
        own = {k: tree[k] for k in PER_RANK_STATE if k in tree}
        parts = self._all_bytes(_encode_tree(own))
        if not self.is_main:
            return None
        return {**tree, "ranks": [_decode_tree(p) for p in parts]}


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when the current device is 0."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def _encode_tree(tree: Any) -> bytes:
    """A state tree as bytes without pickle: 8-byte length, JSON, safetensors."""
    from safetensors.torch import save

    from wantrain.core.checkpoint import split_tree

    data, tensors = split_tree(tree)
    text = json.dumps(data).encode("utf-8")
    return struct.pack("<Q", len(text)) + text + (save(tensors) if tensors else b"")


def _decode_tree(payload: bytes) -> Any:
    from safetensors.torch import load

    from wantrain.core.checkpoint import join_tree

    (length,) = struct.unpack("<Q", payload[:8])
    data = json.loads(payload[8:8 + length].decode("utf-8"))
    rest = payload[8 + length:]
    return join_tree(data, load(rest) if rest else {})


def init_default_group(topology: Topology, device: torch.device, *, timeout_s: float = 1800.0,
                       host_collectives: bool = False) -> None:
    """Initialise the default process group of ``topology`` (once; a no-op when it exists): NCCL on CUDA, gloo on
    the CPU. ``host_collectives`` on CUDA: gloo beside NCCL for tensors on the host ("cuda:nccl,cpu:gloo", as
    torchtitan does for FSDP2's CPU offload), which the shards FSDP2 keeps on the host need (``model.blocks_to_swap``
    under ``model.parallel = "fsdp"``: their saves and norms gather host tensors); every group made from the
    default one, device meshes included, gets both backends."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if host_collectives and device.type == "cuda":
        backend = "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend, rank=topology.rank, world_size=topology.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
