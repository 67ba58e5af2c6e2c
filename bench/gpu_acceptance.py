"""The GPU acceptance check (issues 23 and 33): what only a CUDA device shows, in one run, with a threshold for every
figure. No download: tiny twins and random weights at real shapes. Budget: <= 8 minutes on one H200 from a cold
start, the install from the carried wheels included (bench/README.md, "GPU acceptance run").

Sections (each in its own try/except: one failure is reported and the others still run):

a. ``tiny_t2v_resume``: tiny-t2v on CUDA with the default fused AdamW, both experts, a switch every 3 steps:
   train 8 steps with a checkpoint at 4, resume from it through the switches to 8; the resumed LoRA against the
   uninterrupted one (max abs difference; CUDA attention backward is not bit-reproducible) and, after every
   optimizer step of the resumed run, every optimizer state tensor that follows its parameter
   (``placement.follows_parameter``) on its parameter's device.
b. ``expert_switch_memory``: two experts of A14B width (d=5120) with a few blocks in bf16, placed as a run places
   them (``ExpertPlacement``): ``torch.cuda.max_memory_allocated`` across a switch in each direction against one
   expert's bytes; it must stay below two experts.
c. ``block_activations``: one real-width block at 8192 video tokens: bytes per token per width it keeps for
   backward, for fp32 LoRA on bf16, bf16 LoRA on bf16, fp8 storage with and without gradient checkpointing, next
   to the planner's "one recomputed block" per token per width.
d. ``gpu_step`` (only with ``--only d``: not in the 8-minute run): ``bench/gpu_step.py --settings bf16,fp8``.
f. ``vram_plan``: the setting ``model.vram_budget_gb = 24`` plans for T2V-A14B at 832x480x81, rank 32, run by
   ``bench/gpu_step.py`` (built straight into its swapped placement) under
   ``torch.cuda.set_per_process_memory_fraction`` for a 24 GiB card, next to ``bf16`` with nothing swapped (no
   cap): ``max_memory_allocated`` against the planner's allocated peak, reserved memory against the budget, and the
   s/step ratio.
e. ``sync_debug``: ``torch.cuda.set_sync_debug_mode("warn")`` over three non-log steps of a tiny run: the list of
   synchronising calls (file:line of the innermost wantrain frame) — the loop promises none.

Thresholds (``THRESHOLDS``; the report's ``thresholds`` lists each with its figure): planner within 10 % of
``max_memory_allocated``; reserved <= 24 GiB; s/step of the 24 GB plan <= 1.15x that of bf16 with no swap; no
optimizer state off its parameter's device after a resume; no host sync on a non-log step; and every section ran.
The script exits 1 naming each missed threshold on stderr (``missed: ...``), 0 when all hold. A figure only CUDA
measures is ``null`` on a CPU and is not judged (``--smoke``).

    python bench/gpu_acceptance.py                 # sections a, b, c, f, e on cuda:0 (JSON on stdout)
    python bench/gpu_acceptance.py --only a,e      # some sections
    python bench/gpu_acceptance.py --smoke         # every section on the CPU, tiny shapes: the script runs (CI)

Written without a GPU: ``--smoke`` runs in the test suite (tests/test_gpu_acceptance_smoke.py); the CUDA paths
have never run. Results go into docs/benchmarks.md with the date and the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def _run_tiny(device: str, out: Path, steps: int, resume: str | None = None, extra: list[str] | None = None,
              save_every: int | None = None):
    import wantrain

    overrides = [f"run.output_dir={out}", f"train.device={device}", f"train.max_steps={steps}",
                 "model.switch_every=3", "validation.enabled=false", "sample.enabled=false",
                 "observers.progress=false", "train.log_every=10", f"train.save_every={save_every or steps}",
                 "checkpoint.every=4", *(extra or [])]
    return wantrain.train(ROOT / "examples" / "quickstart.toml", overrides=overrides, resume=resume,
                          allow_code=True)  # section e attaches its own observer (sync_watch.py)


def _lora_file(outcome) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [Path(p) for p in outcome.saved if str(p).endswith(".safetensors")]
    return {f"{f.name}/{k}": v for f in files for k, v in load_file(str(f)).items()}


def section_a(device: str, smoke: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        full = _run_tiny(device, Path(tmp) / "runs", 8)
        uninterrupted = _lora_file(full)
        step4 = full.run_dir / "checkpoints" / "step_000004"
        (Path(tmp) / "state_watch.py").write_text(_STATE_OBSERVER.replace("OUT", repr(str(Path(tmp) / "state.json"))))
        sys.path.insert(0, tmp)
        try:  # steps 5-8 again, switching at 7; the observer checks the optimizer state after every step
            resumed = _run_tiny(device, Path(tmp) / "runs", 8, resume=str(step4),
                                extra=['observers.extra=["state_watch:StateWatch"]'])
        finally:
            sys.path.remove(tmp)
        again = _lora_file(resumed)
        common = sorted(set(uninterrupted) & set(again))
        diff = max(float((uninterrupted[k].float() - again[k].float()).abs().max()) for k in common)
        watched = json.loads((Path(tmp) / "state.json").read_text())
        return {"status_full": full.status, "status_resumed": resumed.status, "tensors": len(uninterrupted),
                "compared": len(common), "max_abs_diff_lora": diff, "state_checked": watched["checked"],
                "state_off_device": watched["off_device"]}


# Put in a temporary folder and named in [observers] extra by section a: after every optimizer step, every optimizer
# state tensor that follows its parameter must be on the parameter's device (device comparisons only: no sync).
_STATE_OBSERVER = '''
import json
from wantrain.core.events import OptimizerStepped, RunEnded
from wantrain.models.wan22.placement import follows_parameter
from wantrain.observers import Observer, on


class StateWatch(Observer):
    name = "state_watch"

    def __init__(self):
        self.checked, self.off = 0, []

    @on(OptimizerStepped)
    def stepped(self, event, ctx):
        groups = {id(p): g for g in ctx.optimizer.param_groups for p in g["params"]}
        for param, state in ctx.optimizer.state.items():
            for key, value in state.items():
                if follows_parameter(key, value, groups.get(id(param))):
                    self.checked += 1
                    if value.device != param.device:
                        self.off.append(f"step {event.step}: {key} on {value.device}, parameter on {param.device}")

    @on(RunEnded)
    def ended(self, event, ctx):
        with open(OUT, "w") as f:
            json.dump({"checked": self.checked, "off_device": self.off}, f)
'''


def _few_block_experts(device: torch.device, blocks: int, width: int, heads: int, ffn: int):
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, transformer_kwargs
    from wantrain.models.wan22.export import ADAPTER_NAME, LORA_TARGET_REGEX
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = dict(transformer_kwargs(VARIANTS["t2v-a14b"]), num_layers=blocks, num_attention_heads=heads,
                  attention_head_dim=width // heads, ffn_dim=ffn)
    experts = {}
    for name in ("high_noise", "low_noise"):
        model = cast_keeping_fp32_modules(WanTransformer3DModel(**kwargs), torch.bfloat16).requires_grad_(False)
        model.add_adapter(LoraConfig(r=32, lora_alpha=32, target_modules=LORA_TARGET_REGEX), adapter_name=ADAPTER_NAME)
        for pname, p in model.named_parameters():
            if f".{ADAPTER_NAME}." in pname:
                p.data = p.data.float()
                p.requires_grad_(True)
        experts[name] = model
    return experts


def section_b(device: str, smoke: bool) -> dict:
    from wantrain.models.wan22.placement import ExpertPlacement

    dev = torch.device(device)
    shape = dict(blocks=1, width=256, heads=2, ffn=512) if smoke else dict(blocks=4, width=5120, heads=40, ffn=13824)
    experts = _few_block_experts(dev, **shape)
    expert_bytes = sum(t.numel() * t.element_size() for t in [*experts["high_noise"].parameters(),
                                                              *experts["high_noise"].buffers()])
    placement = ExpertPlacement(dev, torch.device("cpu"))
    placement.add(experts, first="high_noise")
    params = [p for m in experts.values() for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=dev.type in ("cuda", "cpu"))
    for p in params:  # state for both experts, as after training each
        p.grad = torch.zeros_like(p)
    for name in ("high_noise", "low_noise"):
        placement.activate(name, optimizer)
        optimizer.step()
    out = {"shape": shape, "expert_gib": round(expert_bytes / 2**30, 3), "pinned": placement.pinned}
    for direction, target in (("high_to_low", "low_noise"), ("low_to_high", "high_noise")):
        placement.activate("high_noise" if target == "low_noise" else "low_noise", optimizer)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        started = time.perf_counter()
        placement.activate(target, optimizer)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev)
            out[direction] = {"peak_gib": round(peak / 2**30, 3), "peak_over_expert": round(peak / expert_bytes, 3),
                              "seconds": round(time.perf_counter() - started, 3)}
        else:
            out[direction] = {"resident": placement.resident(), "seconds": round(time.perf_counter() - started, 3)}
    if placement.device != placement.offload_device:  # on a CPU (--smoke) both are the host: nothing moves
        out["one_expert_on_device"] = placement.resident() == ["high_noise"]
    return out


def _block_bytes(dev: torch.device, name: str, checkpointing: bool, tokens_frames: int, size: int, smoke: bool):
    import measure_block_activations as mba

    base_dtype, lora_dtype, fp8 = mba.CONFIGURATIONS[name]
    shape = mba.NARROW if smoke else mba.A14B
    model = mba.build(shape["width"], shape["heads"], shape["ffn"], 1, base_dtype, lora_dtype, fp8,
                      checkpointing=checkpointing).to(dev)
    compute = mba._COMPUTE[base_dtype]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, 16, tokens_frames, size, size, generator=g, device=dev).to(compute)
    text = torch.randn(1, 512, 4096, generator=g, device=dev).to(compute)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    out = model(hidden_states=x, timestep=torch.tensor([500.0], device=dev), encoder_hidden_states=text,
                return_dict=False)[0]
    tokens = mba.tokens_of(tokens_frames, size)
    row = {"configuration": name, "gradient_checkpointing": checkpointing, "tokens": tokens, "width": shape["width"]}
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        kept = torch.cuda.memory_allocated(dev) - before - out.numel() * out.element_size()
        peak = torch.cuda.max_memory_allocated(dev) - before
        row.update(kept_bytes_per_token_per_width=round(kept / tokens / shape["width"], 2),
                   peak_bytes_per_token_per_width=round(peak / tokens / shape["width"], 2))
        out.float().mean().backward()
        torch.cuda.synchronize(dev)
        row["backward_peak_bytes_per_token_per_width"] = round(
            (torch.cuda.max_memory_allocated(dev) - before) / tokens / shape["width"], 2)
    del out, model
    return row


def _planned_bytes_per_token_per_width(name: str, shape: dict, tokens: int) -> float:
    """The planner's "one recomputed block" (wantrain.models.wan22.memory) per video token per unit of width."""
    from wantrain.models.wan22.memory import recompute_block_bytes

    width, ffn = shape["width"], shape["ffn"]
    out = recompute_block_bytes(tokens, width, ffn, 512)
    if name.startswith("fp8"):  # the bf16 copies of the block's 10 Linears
        out += 2 * (8 * width * width + 2 * width * ffn)
    return round(out / tokens / width, 2)


def section_c(device: str, smoke: bool) -> dict:
    import measure_block_activations as mba

    dev = torch.device(device)
    frames, size = (1, 16) if smoke else (8, 64)  # 8 x 32 x 32 = 8192 tokens
    rows = []
    for name, checkpointing in (("bf16 base, fp32 LoRA", False), ("bf16 base, bf16 LoRA", False),
                                ("fp8 base, fp32 LoRA", False), ("fp8 base, fp32 LoRA", True)):
        try:
            row = _block_bytes(dev, name, checkpointing, frames, size, smoke)
            row["estimate_bytes_per_token_per_width"] = _planned_bytes_per_token_per_width(
                name, mba.NARROW if smoke else mba.A14B, row["tokens"])
        except Exception as exc:  # noqa: BLE001 -- one configuration failing must not hide the others
            row = {"configuration": name, "gradient_checkpointing": checkpointing, "error": _short(exc)}
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


def section_d(device: str, smoke: bool) -> dict:
    import gpu_step

    argv = ["--smoke"] if smoke else ["--device", device, "--settings", "bf16,fp8"]  # smoke: every CPU setting
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        gpu_step.main(argv)
    return json.loads(buffer.getvalue())


def section_f(device: str, smoke: bool) -> dict:
    import contextlib
    import io

    import gpu_step

    from wantrain.models.wan22.memory import plan

    chosen, _ = plan("t2v-a14b", 24.0, base_dtype="auto", width=832, height=480, frames=81, rank=32)
    s = chosen.settings
    name = f"{s.base_dtype}" + (f"-swap{s.blocks_to_swap}" if s.blocks_to_swap else "") + (
        "-offload" if s.offload_activations else "")
    out = {"plan": name, "planned_allocated_gib": round(chosen.allocated / 2**30, 2),
           "planned_card_gib": round(chosen.device_gib, 2)}
    # smoke: the tiny twin (two blocks) with one swapped and offload on, the CPU path of the same machinery
    run = "bf16-swap1-offload" if smoke else name
    argv = ["--smoke"] if smoke else ["--device", device, "--cap-gib", str(CARD_GIB)]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        gpu_step.main([*argv, "--settings", f"bf16,{run}"])
    base, planned = json.loads(buffer.getvalue())["results"]
    out.update(ran=run, memory_cap_gib=planned["memory_cap_gib"], s_per_step=planned["s_per_step"],
               s_per_step_vs_bf16=planned["s_per_step_vs_bf16"],
               link_bytes_per_step=planned["link_bytes_per_step"], copy_s_per_step=planned.get("copy_s_per_step"),
               bf16_s_per_step=base["s_per_step"])
    if "peak_vram_gib" in planned:
        out.update(peak_allocated_gib=planned["peak_vram_gib"], peak_reserved_gib=planned["peak_vram_reserved_gib"],
                   # the planner's training peak: the tensors and attention's float32 backward buffer (memory.py)
                   planner_error_pct=round(100 * (chosen.training_peak / 2**30 / planned["peak_vram_gib"] - 1), 1))
    return out


SYNC_STEPS = (2, 3, 4)  # non-log steps of the run below (log_every = 10)


def section_e(device: str, smoke: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sync_watch.py").write_text(_SYNC_OBSERVER)
        sys.path.insert(0, tmp)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outcome = _run_tiny(device, Path(tmp) / "sync", 6, extra=[
                    'observers.extra=["sync_watch:SyncWatch"]', "checkpoint.enabled=false"])
        finally:
            sys.path.remove(tmp)
        syncs = []
        for w in caught:
            if "synchroniz" in str(w.message).lower():
                syncs.append(f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:120]}")
        return {"status": outcome.status, "steps_watched": list(SYNC_STEPS), "syncs": syncs,
                "cuda": torch.device(device).type == "cuda"}


# Put in a temporary folder and named in [observers] extra: sync debug mode "warn" from the start of step 2 to the
# end of step 4 (CUDA only; on the CPU it only records which steps it watched).
_SYNC_OBSERVER = '''
import torch
from wantrain.core.events import OptimizerStepped, StepStarted
from wantrain.observers import Observer, on

WATCH = (2, 3, 4)


class SyncWatch(Observer):
    name = "sync_watch"

    @on(StepStarted)
    def started(self, event, ctx):
        if event.step == WATCH[0] and event.accumulation_index == 1 and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")

    @on(OptimizerStepped)
    def stepped(self, event, ctx):
        if event.step == WATCH[-1] and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
'''


SECTIONS = {"a": ("tiny_t2v_resume", section_a), "b": ("expert_switch_memory", section_b),
            "c": ("block_activations", section_c), "d": ("gpu_step", section_d), "e": ("sync_debug", section_e),
            "f": ("vram_plan", section_f)}
DEFAULT_SECTIONS = "abcfe"  # d (every gpu_step setting) does not fit the 8-minute budget
CARD_GIB = 24.0


# name -> (section, figure, test, what the threshold is); a figure that is None (not measured: CPU, or the section
# was not run) is not judged
THRESHOLDS = {
    "planner_within_10_percent": ("vram_plan", "planner_error_pct", lambda v: abs(v) <= 10.0,
                                  "the planner within 10 % of max_memory_allocated"),
    "reserved_within_budget": ("vram_plan", "peak_reserved_gib", lambda v: v <= CARD_GIB,
                               f"max_memory_reserved <= {CARD_GIB:g} GiB"),
    "swap_plan_speed": ("vram_plan", "s_per_step_vs_bf16", lambda v: v <= 1.15,
                        "s/step of the 24 GB plan <= 1.15x bf16 with no swap"),
    "optimizer_state_on_device": ("tiny_t2v_resume", "state_off_device", lambda v: v == [],
                                  "every optimizer state on its parameter's device after a resume"),
    "no_sync_on_non_log_steps": ("sync_debug", "syncs", lambda v: v == [], "no host sync on a non-log step"),
}


def judge(report: dict, smoke: bool) -> dict:
    """Each threshold with its figure and whether it holds (None: not judged). On a CPU only the figures a CPU
    measures are judged (the timing ratio is CUDA's only)."""
    out = {}
    for name, (section, key, test, what) in THRESHOLDS.items():
        value = report.get(section, {}).get(key)
        cuda_only = name not in ("optimizer_state_on_device",)  # a CPU has no VRAM, link or sync debug mode
        held = None if value is None or (smoke and cuda_only) else bool(test(value))
        out[name] = {"threshold": what, "figure": value, "holds": held}
    for section, result in report.items():
        if isinstance(result, dict) and "error" in result:
            out[f"section_{section}_ran"] = {"threshold": f"section {section} runs", "figure": result["error"],
                                            "holds": False}
    return out


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", help="comma-separated sections (a-f)")
    parser.add_argument("--smoke", action="store_true", help="on the CPU with tiny shapes (the suite runs this)")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else args.device
    report: dict = {"device": device, "torch": torch.__version__, "smoke": args.smoke,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if torch.device(device).type == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps({**report, "error": "CUDA is not available (use --smoke on a CPU)"}))
            return 2
        report["gpu"] = torch.cuda.get_device_name(torch.device(device))
    wanted = args.only.split(",") if args.only else list(SECTIONS if args.smoke else DEFAULT_SECTIONS)
    for key in wanted:
        name, fn = SECTIONS[key]
        started = time.perf_counter()
        try:
            result = fn(device, args.smoke)
        except Exception as exc:  # noqa: BLE001 -- report and go on: a failing section must not lose the others
            result = {"error": _short(exc), "traceback": traceback.format_exc(limit=6).splitlines()[-6:]}
        result["seconds"] = round(time.perf_counter() - started, 1)
        report[name] = result
        print(json.dumps({name: result}), file=sys.stderr, flush=True)  # progress, in case the run is cut short
    report["thresholds"] = judge(report, args.smoke)
    print(json.dumps(report, indent=1))
    missed = [f"{name} ({t['threshold']}; figure: {t['figure']})" for name, t in report["thresholds"].items()
              if t["holds"] is False]
    for line in missed:
        print(f"missed: {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
