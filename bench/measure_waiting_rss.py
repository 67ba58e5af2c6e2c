"""The host RSS of a two-expert run with the waiting expert resident and on disk (``model.waiting_expert``,
models/wan22/waiting.py), on a widened tiny twin whose experts are large enough for the difference to stand out of
the process's noise, against what the host plan (``memory.host_estimate``) says the waiting expert holds.

Each mode runs in a process of its own (a fresh heap): build the adapter on the CPU, train three steps with an
expert switch at every step (high, low, high), collect garbage, read the resident set (psutil). The twin: the tiny
T2V twin with 8 heads of 96 (width 768), FFN 3072 and 8 blocks (about 300 MB of float32 base per expert). JSON on
stdout:

    python bench/measure_waiting_rss.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

WIDE = dict(num_attention_heads=8, attention_head_dim=96, ffn_dim=3072, num_layers=8)


def one(mode: str) -> dict:
    import gc

    import psutil
    import torch

    from wantrain.models.wan22 import LoraConfig, ModelConfig, architecture, build_adapter

    architecture._TINY_TRANSFORMER.update(WIDE)
    from tests.models.wan22_helpers import raw_batch, train_steps

    model = ModelConfig(variant="tiny-t2v", switch_every=1, waiting_expert=mode)
    with tempfile.TemporaryDirectory() as folder:
        adapter = build_adapter(model, LoraConfig(rank=4), seed=0, device=torch.device("cpu"), base_lr=1e-3,
                                waiting_folder=folder)
        train_steps(adapter, adapter.encode_batch(raw_batch()), steps=3)
        gc.collect()
        rss = psutil.Process().memory_info().rss
        expert = sum(t.numel() * t.element_size() for t in [*adapter.transformer_for("high_noise").parameters(),
                                                             *adapter.transformer_for("high_noise").buffers()]
                     if not t.requires_grad)
    return {"mode": mode, "rss_bytes": rss, "expert_frozen_bytes": expert}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("resident", "disk"):
        print(json.dumps(one(sys.argv[1])))
        return
    out = {}
    for mode in ("resident", "disk"):
        done = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, check=True)
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    saved = out["resident"]["rss_bytes"] - out["disk"]["rss_bytes"]
    expert = out["resident"]["expert_frozen_bytes"]
    print(json.dumps({**out, "rss_saved_bytes": saved, "expert_bytes": expert,
                      "saved_over_expert": round(saved / expert, 3)}, indent=1))


if __name__ == "__main__":
    main()
