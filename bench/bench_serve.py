"""wantrain serve: page load of a 100k-step run, what a live poll costs the server, what the inbox check costs a step.

Not a test (timing belongs here). A synthetic run directory as a run with ``log_every = 1`` writes it after 100k
optimizer steps: ``metrics.jsonl`` with one row per step (two experts: loss, LR, norms, memory), the event log with
the four per-step events of every step plus its ``MetricsLogged`` (500k lines), a ``RunStarted``, the expert
switches; the event log plain (``events.jsonl``) and gzip (``events.jsonl.gz``, written as the recorder writes it:
one member, a sync flush every 1000 lines). For each:

* in process, against a fresh server each round (Starlette's in-process client: the HTTP handling included, no
  network): ``page_load_s`` / ``page_load_cpu_s`` -- what opening the run page asks: the run's details, every series
  downsampled, the first poll (the timeline); ``page_load_warm_s`` -- the same when the server has read the run
  before; ``runs_list_s``; ``live_poll_s`` -- after the load, one metrics row and one event appended, the poll that
  returns them;
* ``poll_server_cpu_ms`` -- the CPU time of a real ``wantrain serve`` process (its ``/proc`` utime + stime) per
  poll, over ``--polls`` polls, each after one metrics row and one event were appended (the gzip one through an
  open ``GzipFile`` with a sync flush, as the recorder does): the cost of a poll however long the run; with
  ``poll_read_bytes`` what the server read per poll is not what the run wrote before;
* ``inbox_idle_ns`` / ``inbox_stat_ns`` -- ``Inbox.poll()`` per call on steps between checks (a clock read) and on
  a due step with nothing new (one ``stat``); every step pays the first, one step per 0.2 s the second.

    python bench/bench_serve.py                 # JSON on stdout: medians over --rounds
    python bench/bench_serve.py --steps 100000 --rounds 3 --polls 200
    git archive a47007a wantrain | tar -x -C /tmp/old && python bench/bench_serve.py --server-code /tmp/old --polls 20
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import httpx
import orjson
from starlette.testclient import TestClient

from wantrain.app.serve.server import Site, build_app
from wantrain.core.events import (
    ExpertSwitched,
    GradsReady,
    LossComputed,
    MetricsLogged,
    OptimizerStepped,
    RunStarted,
    StepStarted,
    to_record,
)
from wantrain.core.inbox import Inbox

EXPERTS = ("high_noise", "low_noise")
TIMED = ("page_load_s", "page_load_cpu_s", "page_load_warm_s", "page_load_warm_cpu_s", "runs_list_s", "live_poll_s")
TOKEN = "bench-token-0123456789"


def write_run(run: Path, steps: int) -> None:
    run.mkdir(parents=True)
    (run / "config.toml").write_text('[run]\nname = "bench"\n')
    seq = 0

    def rec(event) -> bytes:
        nonlocal seq
        seq += 1
        return orjson.dumps(to_record(event, seq, 1.0e9 + seq))

    events = [rec(RunStarted(step=0, run_dir=str(run), total_steps=steps, grad_accum=1, experts=EXPERTS,
                             log_every=1))]
    metrics = []
    for step in range(1, steps + 1):
        expert = EXPERTS[(step - 1) // 100 % 2]
        if step > 1 and (step - 1) % 100 == 0:
            events.append(rec(ExpertSwitched(step=step, previous=EXPERTS[(step - 2) // 100 % 2], expert=expert)))
        common = dict(step=step, micro_step=step, accumulation_index=1, ends_optimizer_step=True, is_log_step=True,
                      expert=expert)
        events.append(rec(StepStarted(**common)))
        events.append(rec(LossComputed(**common)))
        events.append(rec(GradsReady(step=step, is_log_step=True, expert=expert)))
        events.append(rec(OptimizerStepped(step=step, expert=expert, skipped=False, skip_reason=None, lrs=(1e-4,),
                                           group_names=("lora",), is_log_step=True)))
        values = {"train/loss": 1.0 / step ** 0.1, f"train/loss/{expert}": 1.0 / step ** 0.1, "train/lr": 1e-4,
                  f"train/lr/{expert}": 1e-4, "train/grad_norm": 0.05, f"train/grad_norm/{expert}": 0.05,
                  "train/param_norm/high_noise": 7.0, "train/param_norm/low_noise": 7.0,
                  "train/total_param_norm": 10.0, "memory/ram_main_process_gb": 0.56, "memory/ram_total_gb": 0.56,
                  "train/step_time_s": 0.5, "train/skipped_steps": 0.0, "train/nan_skipped_steps": 0.0,
                  "train/nan_streak_max": 0.0}
        events.append(rec(MetricsLogged(step=step, expert=expert, values=values, elapsed_s=step * 0.5,
                                        total_steps=steps)))
        metrics.append(orjson.dumps({"step": step, "time": 1.0e9 + step, "elapsed_s": step * 0.5, "expert": expert,
                                     **values}))
    (run / "events.jsonl").write_bytes(b"\n".join(events) + b"\n")
    (run / "metrics.jsonl").write_bytes(b"\n".join(metrics) + b"\n")


def to_gzip(run: Path) -> None:
    """``events.jsonl`` -> ``events.jsonl.gz`` as the recorder writes it: one member, a sync flush per 1000 lines."""
    lines = (run / "events.jsonl").read_bytes().splitlines(keepends=True)
    with gzip.open(run / "events.jsonl.gz", "wb", compresslevel=6) as fh:
        for start in range(0, len(lines), 1000):
            fh.write(b"".join(lines[start:start + 1000]))
            fh.flush()
    (run / "events.jsonl").unlink()


def event_log(run: Path) -> Path:
    return run / "events.jsonl.gz" if (run / "events.jsonl.gz").exists() else run / "events.jsonl"


def append_event(run: Path, line: bytes) -> None:
    log = event_log(run)
    if log.suffix == ".gz":
        with log.open("ab") as fh:
            fh.write(gzip.compress(line))
    else:
        with log.open("ab") as fh:
            fh.write(line)


def one_round(root: Path, name: str, steps: int) -> dict[str, float]:
    site = Site(root, token=TOKEN)
    client = TestClient(build_app(site), base_url="http://127.0.0.1:8765", cookies={site.cookie: TOKEN})
    client.get("/static/app.css").raise_for_status()  # the client's own start-up, not the page's
    started, cpu = time.perf_counter(), time.process_time()
    client.get(f"/api/runs/{name}").raise_for_status()
    series = client.get(f"/api/runs/{name}/series").json()
    first = client.get(f"/api/runs/{name}/poll?m={series['rows']}&e=0").json()
    page_load, page_load_cpu = time.perf_counter() - started, time.process_time() - cpu
    started = time.perf_counter()
    client.get("/api/runs").raise_for_status()
    runs_list = time.perf_counter() - started
    started, cpu = time.perf_counter(), time.process_time()  # the page opened again: the server has read the run
    client.get(f"/api/runs/{name}").raise_for_status()
    client.get(f"/api/runs/{name}/series").raise_for_status()
    client.get(f"/api/runs/{name}/poll?m={series['rows']}&e=0").raise_for_status()
    warm, warm_cpu = time.perf_counter() - started, time.process_time() - cpu
    run = root / name
    with (run / "metrics.jsonl").open("ab") as fh:
        fh.write(orjson.dumps({"step": steps + 1, "train/loss": 0.5}) + b"\n")
    append_event(run, orjson.dumps(to_record(ExpertSwitched(step=steps + 1, previous="high_noise", expert="low_noise"),
                                             10**7, 2.0e9)) + b"\n")
    started = time.perf_counter()
    live = client.get(f"/api/runs/{name}/poll?m={first['rows']}&e={first['event_count']}").json()
    live_poll = time.perf_counter() - started
    assert live["points"]["train/loss"]["x"] == [steps + 1.0] and len(live["events"]) == 1
    assert max(len(s["x"]) for s in series["series"].values()) <= 2000
    return {"page_load_s": page_load, "page_load_cpu_s": page_load_cpu, "page_load_warm_s": warm,
            "page_load_warm_cpu_s": warm_cpu, "runs_list_s": runs_list,
            "live_poll_s": live_poll, "timeline_items": first["event_count"],
            "points_per_series_max": max(len(s["x"]) for s in series["series"].values())}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def server_polls(root: Path, name: str, steps: int, polls: int, code: Path | None = None) -> dict[str, float]:
    """A real ``wantrain serve`` process: its CPU time per poll, each poll after one row and one event. ``code``:
    the wantrain to run it from (a checkout or an export of another commit), else this one."""
    env = {**os.environ, "WANTRAIN_SERVE_TOKEN": TOKEN}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    server = subprocess.Popen([sys.executable, "-m", "wantrain", "serve", str(root), "--port", "0"], env=env,
                              stdout=subprocess.PIPE, text=True, cwd=root)  # not the work tree: -m puts it first
    try:
        url = next(line.split("open ", 1)[1].strip().split("?", 1)[0] for line in server.stdout if "open http" in line)
        client = httpx.Client(base_url=url, headers={"X-Wantrain-Token": TOKEN}, timeout=600)
        for _ in range(600):  # the URL is printed just before it serves
            try:
                client.get("/static/app.css")
                break
            except httpx.TransportError:
                time.sleep(0.05)
        first = client.get(f"/api/runs/{name}/poll?m=0&e=0").json()  # waits for the first read
        rows, events = first["rows"], first["event_count"]
        run = root / name
        gz = event_log(run).suffix == ".gz"
        cpu, seq = cpu_seconds(server.pid), 10**7
        with gzip.open(event_log(run), "ab") if gz else event_log(run).open("ab") as writer:  # as the recorder
            for i in range(polls):
                with (run / "metrics.jsonl").open("ab") as fh:
                    fh.write(orjson.dumps({"step": steps + 2 + i, "train/loss": 0.5}) + b"\n")
                seq += 1
                writer.write(orjson.dumps(to_record(ExpertSwitched(step=steps + 2 + i, previous="high_noise",
                                                                   expert="low_noise"), seq, 2.0e9)) + b"\n")
                writer.flush()
                poll = client.get(f"/api/runs/{name}/poll?m={rows}&e={events}").json()
                assert len(poll["points"]["train/loss"]["x"]) == 1 and len(poll["events"]) == 1, poll
                rows, events = poll["rows"], poll["event_count"]
        used = cpu_seconds(server.pid) - cpu
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"poll_server_cpu_ms": used / polls * 1e3}


def measure(root: Path, run: Path, args: argparse.Namespace) -> dict[str, object]:
    sizes = {p.name: p.stat().st_size for p in run.glob("*.jsonl*")}
    rounds = []
    for _ in range(args.rounds):
        rounds.append(one_round(root, run.name, args.steps))
        for name, size in sizes.items():  # drop the appended lines so every round reads the same run
            with (run / name).open("r+b") as fh:
                fh.truncate(size)
    polled = server_polls(root, run.name, args.steps, args.polls, args.server_code)
    for name, size in sizes.items():
        with (run / name).open("r+b") as fh:
            fh.truncate(size)
    return {"file_bytes": sizes, **{key: statistics.median(r[key] for r in rounds) for key in TIMED},
            "page_load_s_all": [round(r["page_load_s"], 3) for r in rounds], **polled,
            "timeline_items": rounds[0]["timeline_items"], "points_per_series_max": rounds[0]["points_per_series_max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--polls", type=int, default=200, help="polls of the real server, for its CPU per poll")
    parser.add_argument("--server-code", type=Path, default=None,
                        help="run the polled server from this copy of wantrain (PYTHONPATH), for a before/after")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = root / "20260101_000000"
        started = time.perf_counter()
        write_run(run, args.steps)
        written = time.perf_counter() - started
        plain = measure(root, run, args)
        inbox = Inbox(run, every_s=3600.0)
        idle = min(timeit.repeat(inbox.poll, number=100_000, repeat=5)) / 100_000
        inbox_due = Inbox(run, every_s=0.0)
        due = min(timeit.repeat(inbox_due.poll, number=20_000, repeat=5)) / 20_000
        to_gzip(run)
        compressed = measure(root, run, args)
    result = {
        "steps": args.steps, "write_s": round(written, 2), "plain": plain, "gzip": compressed,
        "inbox_idle_ns": round(idle * 1e9, 1), "inbox_stat_ns": round(due * 1e9, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
