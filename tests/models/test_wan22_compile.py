"""model.compile (regional torch.compile of the blocks) and model.attention (the kernel), on the CPU.

Most tests compile with the ``aot_eager`` backend (dynamo and AOTAutograd, no code generation: the same graphs,
guards and breaks as inductor at a fraction of the cost); the compile cache test runs inductor itself."""

from __future__ import annotations

import json
import os
import textwrap

import prewarmed
import pytest
import torch
import torch._dynamo
from wan22_helpers import make_adapter, raw_batch

from wantrain.core.errors import ConfigError, UserError
from wantrain.models.wan22 import ModelConfig, attention
from wantrain.models.wan22 import compile as wan_compile
from wantrain.models.wan22.compile import compile_counts, is_compiled


@pytest.fixture
def aot_eager(monkeypatch):
    """The cheap backend, and dynamo's caches emptied: each test counts the graphs it compiles itself (the
    compiled graphs of a block's code are shared process-wide)."""
    monkeypatch.setattr(wan_compile, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _losses(adapter, batches, *, alpha_after: int | None = None, graphs: list[int] | None = None) -> list[float]:
    """One AdamW step per batch on the adapter's first expert; with ``alpha_after`` = k, alpha goes from the rank to
    twice it (output preserved, optimizer state rescaled) after step k, as the alpha controller does. ``graphs``:
    dynamo's graph count is appended after each step."""
    expert = adapter.experts[0]
    optimizer = torch.optim.AdamW(adapter.param_groups(), lr=1e-2, weight_decay=0.0)
    adapter.activate(expert, optimizer)
    generator = torch.Generator().manual_seed(1)
    out = []
    for step, batch in enumerate(batches, start=1):
        loss = adapter.loss(batch, expert, generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(loss.item())
        if step == alpha_after:
            adapter.change_lora_alpha(2.0 * adapter.lora_alpha(expert), expert, optimizer)
        if graphs is not None:
            graphs.append(compile_counts()["graphs"])
    return out


def _encoded(adapter, sizes=(32,)):
    return [adapter.encode_batch(raw_batch(size=s, seed=i)) for i, s in enumerate(sizes)]


@pytest.mark.slow  # compiles
def test_compiled_blocks_train_as_eager_with_block_swap_offload_and_an_alpha_change(aot_eager):
    memory = dict(blocks_to_swap=1, offload_activations=True, pin_host_copies=False)
    eager = make_adapter(**memory)
    batches = _encoded(eager, sizes=(32, 32, 32))
    expected = _losses(eager, batches, alpha_after=2)
    compiled = make_adapter(**memory, compile="default")
    blocks = compiled.transformer_for("high_noise").blocks
    assert all(is_compiled(b) for b in blocks) and not is_compiled(compiled.transformer_for("high_noise"))
    before, graphs = compile_counts(), []
    got = _losses(compiled, batches, alpha_after=2, graphs=graphs)
    end = compile_counts()
    assert got == pytest.approx(expected, rel=1e-5)
    assert end["graph_breaks"] == before["graph_breaks"]  # 0 graph breaks inside a block
    # one graph for block 0 (its input needs no grad) and one shared by the others; the second step (the swapped
    # block's fresh parameters) and the third (after the alpha change) add none
    assert 1 <= graphs[0] - before["graphs"] <= 2 and graphs[2] == graphs[1] == graphs[0]
    assert float(blocks[0].attn1.to_q.scaling["wantrain"]) == 2.0


# (lora.type, model.base_dtype): every type and every quantised storage, paired to keep it cheap (DoRA on fp8: its
# row norms read the float8 weight between forwards; DoRA on nf4: its row norms and every Linear's forward dequantise
# through lowbit's one opaque operator, where dynamo broke the graph 42 times in bitsandbytes' Python before; DoRA on
# fp8_scaled and LoRA on int8 passed too, 7-11 s each). Measured: the compiled losses equal eager's bit for bit in all
# four; 1e-5 relative leaves rounding room.
TYPES_AND_STORAGE = [("dora", "fp8"), ("lokr", "fp8_scaled"), ("loha", "auto"), ("dora", "nf4")]


@pytest.mark.slow  # compiles
@pytest.mark.parametrize(("kind", "storage"), TYPES_AND_STORAGE)
def test_every_adapter_type_and_quantised_storage_compile_without_graph_breaks_and_train_as_eager(
        aot_eager, monkeypatch, kind, storage):
    """fp8 (diffusers' layerwise casting) failed before its Linears cast in the graph (``compile._cast_in_graph``):
    gradient checkpointing's recompute saved float8 weights where the forward had saved bf16 ones."""
    from wantrain.models.wan22 import adapter as adapter_module

    monkeypatch.setattr(adapter_module, "FP8_DEVICE_TYPES", ("cuda", "cpu"))  # fp8 storage works on a CPU too
    eager = make_adapter(lora={"type": kind}, base_dtype=storage)
    batches = _encoded(eager, sizes=(32, 32))
    expected = _losses(eager, batches, alpha_after=1)
    before = compile_counts()
    got = _losses(make_adapter(lora={"type": kind}, base_dtype=storage, compile="default"), batches, alpha_after=1)
    after = compile_counts()
    assert got == pytest.approx(expected, rel=1e-5)
    assert after["graph_breaks"] == before["graph_breaks"] and 1 <= after["graphs"] - before["graphs"] <= 2


@pytest.mark.slow  # compiles
def test_bucket_shapes_compile_a_bounded_number_of_times(aot_eager):
    """Forward passes only (validation's no-grad form: the same guards on shapes as training, a third of the
    tracing): the first shape compiles static graphs, the second one dynamic graph per form, later shapes none."""
    adapter = make_adapter(compile="default")
    batches = _encoded(adapter, sizes=(32, 48, 64, 80))
    start = compile_counts()["graphs"]
    counts = []
    with adapter.evaluating():
        for batch in batches:
            adapter.validation_loss(batch, 0.5, torch.randn(batch["latents"].shape))
            counts.append(compile_counts()["graphs"] - start)
    assert counts[0] >= 1 and counts[1] <= 2 * counts[0] and counts[3] == counts[2] == counts[1]


def test_a_compiler_failure_is_one_line_naming_the_key(monkeypatch):
    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler for this target\nlong inductor traceback")

    monkeypatch.setattr(wan_compile, "BACKEND", broken)
    adapter = make_adapter(compile="default")
    with pytest.raises(UserError) as info:
        adapter.loss(_encoded(adapter)[0], "high_noise", torch.Generator().manual_seed(0)).backward()
    message = str(info.value)
    assert message.startswith("model.compile = 'default': torch.compile failed") and "\n" not in message
    assert "no C++ compiler for this target" in message and "model.compile = 'off'" in message


def test_the_attention_kernel_is_set_through_diffusers_dispatcher_and_checked(monkeypatch):
    adapter = make_adapter(attention="sdpa")
    assert attention.kernel_in_use(adapter.transformer_for("high_noise")) == "native"
    with pytest.raises(ConfigError, match=r"model.attention = 'sage' cannot train: SageAttention has no backward"):
        ModelConfig(attention="sage")
    with pytest.raises(ConfigError, match=r"model.compile_dynamic applies to a compiled model"):
        ModelConfig(compile_dynamic=True)
    monkeypatch.setattr(attention, "_importable", lambda module: True)  # installed or not: the device refuses
    with pytest.raises(UserError, match=r"model.attention = 'flash' runs on CUDA only \(training device is cpu\)"):
        make_adapter(attention="flash")


def test_a_missing_kernel_package_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(attention, "_importable", lambda module: False)
    with pytest.raises(UserError, match=r"model.attention = 'xformers' needs the 'xformers' package, which is not "
                                        r"installed; pip install xformers"):
        make_adapter(attention="xformers")


@pytest.mark.slow  # compiles
def test_a_second_process_of_the_same_shapes_compiles_from_the_cache(tmp_path):
    """Inductor itself (a C++ compiler is on this machine): the second process finds every graph in the cache
    folder the first one filled (``use_cache_dir``) and compiles none. The time this saves: bench/bench_compile.py."""
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from pathlib import Path
        from torch._dynamo.utils import counters
        from wan22_helpers import make_adapter, raw_batch
        from wantrain.models.wan22.compile import use_cache_dir
        use_cache_dir(Path({str(tmp_path / 'cache')!r}))
        adapter = make_adapter(compile="default", gradient_checkpointing=False)
        batch = adapter.encode_batch(raw_batch(size=16, frames=1))
        with adapter.evaluating():
            adapter.validation_loss(batch, 0.5, torch.zeros(batch["latents"].shape))
        print(json.dumps(dict(counters["inductor"])))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}

    def run() -> dict:  # a fork of the prewarmed server (tests/prewarmed.py): no import of the stack per process
        done = prewarmed.run(["-c", script], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    assert second.get("fxgraph_cache_miss", 0) == 0 and second.get("fxgraph_cache_hit", 0) >= 1
    assert any((tmp_path / "cache").rglob("*"))
