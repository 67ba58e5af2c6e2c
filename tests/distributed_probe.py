"""A test observer for the torchrun tests (``[observers] extra = ["distributed_probe:RankProbe"]``), attached on
every rank. With ``WANTRAIN_PROBE_DIR`` set it writes, outside the run directory, what its rank saw:
``rank<R>.json`` (each optimizer step's skip decision, each log step's loss, the metric names of every
``MetricsLogged``, the run's status) and ``rank<R>.safetensors`` (the rank's final LoRA weights; under
``model.parallel = "fsdp"`` its shard of them), and ``rank<R>_start.safetensors``, the same at ``RunStarted`` (a
resumed run's LoRA as restored). On ranks other than 0 it records, through an audit hook, every
write, directory creation, rename or removal under ``WANTRAIN_PROBE_WATCH`` (the run's output folder).
``WANTRAIN_PROBE_STOP_AT`` / ``WANTRAIN_PROBE_STOP_RANK``: request a stop after that step on that rank only;
``WANTRAIN_PROBE_KILL_AT``: SIGKILL that rank after that step instead (a peer that dies without a word).
The record also holds ``block_numel``: the elements of the trained experts' block parameters this rank holds
(its shards under fsdp) and their whole count; ``on_host``: per trained expert, the run-order indices of the blocks
whose shards FSDP2 keeps on the host (``model.blocks_to_swap`` under fsdp: every parameter's ``offload_to_cpu``).
``rank<R>_grads.safetensors``: the first optimizer step's gradients as ``GradsReady`` sees them (averaged over the
ranks; under fsdp the rank's shard), by LoRA parameter name.
The record's ``whole``: [how many ``DTensor``\\ s this rank made whole with ``full_tensor`` (an all-gather), the most
elements of one] over the run (saves included: under fsdp only the writing rank may hold a whole LoRA tensor).
``WANTRAIN_PROBE_COMPILE_BACKEND``: the backend ``model.compile`` uses in this process (``aot_eager`` or
``eager``: the cheap ones the tests use), set when this module is imported (before the adapter compiles its
blocks); the record then holds dynamo's counts (``compile``)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from safetensors.torch import save_file

from wantrain.core.events import GradsReady, MetricsLogged, OptimizerStepped, RunEnded, RunStarted
from wantrain.models.wan22 import compile as wan_compile
from wantrain.observers import Observer, on

if os.environ.get("WANTRAIN_PROBE_COMPILE_BACKEND"):
    wan_compile.BACKEND = os.environ["WANTRAIN_PROBE_COMPILE_BACKEND"]
if os.environ.get("WANTRAIN_PROBE_FP8_ON_CPU"):  # fp8 storage, refused on a CPU for its cost only, allowed here
    from wantrain.models.wan22 import adapter as wan_adapter

    wan_adapter.FP8_DEVICE_TYPES = ("cuda", "cpu")

_WHOLE = [0, 0]  # full_tensor calls of this process, the most elements one returned


def _count_full_tensor() -> None:
    from torch.distributed.tensor import DTensor

    plain = DTensor.full_tensor

    def counted(self, *args, **kwargs):
        out = plain(self, *args, **kwargs)
        _WHOLE[0], _WHOLE[1] = _WHOLE[0] + 1, max(_WHOLE[1], out.numel())
        return out

    DTensor.full_tensor = counted


_count_full_tensor()
def _on_host(transformer) -> list[int]:
    from wantrain.models.wan22.swap import run_order

    out = []
    for k, block in enumerate(run_order(transformer)):
        state = getattr(block, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        flags = {p.offload_to_cpu for p in group.fsdp_params} if group is not None else {False}
        assert len(flags) == 1, "a block half on the host"
        if flags.pop():
            out.append(k)
    return out


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class RankProbe(Observer):
    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        directory = os.environ.get("WANTRAIN_PROBE_DIR")
        self.directory = Path(directory) if directory else None
        self.stop_at = int(os.environ.get("WANTRAIN_PROBE_STOP_AT", "0"))
        self.stop_rank = int(os.environ.get("WANTRAIN_PROBE_STOP_RANK", "-1"))
        self.kill_at = int(os.environ.get("WANTRAIN_PROBE_KILL_AT", "0"))
        self.record: dict = {"rank": self.rank, "steps": [], "losses": {}, "keys": [], "writes": []}
        watch = os.environ.get("WANTRAIN_PROBE_WATCH")
        if watch and self.rank != 0:
            self._install_hook(str(Path(watch).resolve()))

    def _install_hook(self, watch: str) -> None:
        writes = self.record["writes"]

        def hook(event: str, args: tuple) -> None:
            if event == "open":
                path, mode, flags = args
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                    (isinstance(flags, int) and flags & _WRITE_FLAGS)
            elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree"):
                path, writing = args[0], True
            else:
                return
            if writing and isinstance(path, str | bytes | os.PathLike):
                text = os.fsdecode(path)
                full = os.path.abspath(text)
                if full == watch or full.startswith(watch + os.sep):
                    writes.append(f"{event} {text}")

        sys.addaudithook(hook)

    @on(GradsReady)
    def grads_ready(self, event: GradsReady, ctx) -> None:
        if self.directory is None or event.step != 1:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        grads = {}
        for expert in ctx.adapter.experts:
            for name, param in ctx.adapter.transformer_for(expert).named_parameters():
                if param.requires_grad and param.grad is not None:
                    grad = getattr(param.grad, "to_local", lambda g=param.grad: g)()
                    grads[f"{expert}.{name}"] = grad.detach().cpu().contiguous()
        save_file(grads, str(self.directory / f"rank{self.rank}_grads.safetensors"))

    @on(OptimizerStepped)
    def stepped(self, event: OptimizerStepped, ctx) -> None:
        self.record["steps"].append([event.step, event.skipped, event.skip_reason])
        if event.step == self.stop_at and self.rank == self.stop_rank:
            ctx.control.request_stop(f"probe on rank {self.rank}")
        if event.step == self.kill_at and self.rank == self.stop_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    @on(MetricsLogged)
    def logged(self, event: MetricsLogged, ctx) -> None:
        self.record["losses"][str(event.step)] = event.values.get("train/loss")
        self.record["keys"].append([event.step, sorted(event.values)])

    @on(RunStarted)
    def started(self, event: RunStarted, ctx) -> None:
        if self.directory is not None:  # the LoRA the run starts from (a resumed one: as restored)
            self._save_weights(ctx, "start")

    @on(RunEnded)
    def ended(self, event: RunEnded, ctx) -> None:
        if self.directory is None:
            return
        self.record["status"] = event.status
        self.record["compile"] = wan_compile.compile_counts()
        self.record["whole"] = list(_WHOLE)
        # the block parameters' elements this rank holds (under fsdp its shards) and their whole count
        blocks = [p for e in ctx.adapter.experts for p in ctx.adapter.transformer_for(e).blocks.parameters()]
        self.record["block_numel"] = [sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in blocks),
                                      sum(p.numel() for p in blocks)]
        # model.blocks_to_swap under fsdp: the run-order indices of the blocks whose shards FSDP2 holds on the host
        # (each of their parameters flagged offload_to_cpu), per trained expert
        self.record["on_host"] = [_on_host(ctx.adapter.transformer_for(e)) for e in ctx.adapter.experts]
        self._save_weights(ctx, "")
        (self.directory / f"rank{self.rank}.json").write_text(json.dumps(self.record))

    def _save_weights(self, ctx, suffix: str) -> None:
        weights = ctx.adapter.state_dict()["weights"]
        self.directory.mkdir(parents=True, exist_ok=True)
        # model.parallel = "fsdp": the rank's own shard of each tensor (its rows)
        save_file({k: getattr(v, "to_local", lambda v=v: v)().detach().cpu().contiguous() for k, v in weights.items()},
                  str(self.directory / f"rank{self.rank}{'_' + suffix if suffix else ''}.safetensors"))
