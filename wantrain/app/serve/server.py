"""The web server of ``wantrain serve`` (Starlette on uvicorn): the page, its JSON API and the run's files.

Safety (docs/serve.md):

* every request for the page, its data or the run's files needs the token the server prints, on every address,
  loopback included (``?token=`` in the printed URL once, then a cookie of this server's own, or the
  ``X-Wantrain-Token`` header), as Jupyter does: on a shared machine another user or process can reach 127.0.0.1
  too; only the page's code and styles (``/static``, nothing of a run) are served without it;
* bound to a loopback address (127.0.0.1 unless told another), requests must also name a local host (``Host:``,
  the bound address included), which stops a web page from reaching the server through a DNS name it controls
  (DNS rebinding);
* a control (save / sample / validate / stop) always needs the token in the ``X-Wantrain-Token`` header -- the page
  carries it, another site cannot read it -- and a request whose ``Origin`` is not the server's own is refused;
  ``read_only`` refuses every control; the inbox is written with the server's user's permissions, so the run
  folder's permissions decide whose server (or ``wantrain ctl``) may ask the run anything;
* only run directories directly under the output directory and files inside them are read: a name with ``..``, an
  absolute path, or a link that leads outside is refused (404);
* the data view (``/api/data``, :mod:`.clips`) reads the clips of a run's data folders (its ``config.toml``) or of
  the folders given with ``--data``, and nothing else; saving a caption is a change like a control (token header,
  same origin, refused when ``read_only``).

Handlers are plain functions, which Starlette runs in its thread pool: reading and parsing a run's files never
blocks the event loop, and each run has its own lock, so the first read of a large run delays only the requests
for that run (the runs list shows its last summary meanwhile). Every error is a JSON ``{"error": "..."}`` with its
status; the server stays up.
"""

from __future__ import annotations

import errno
import hashlib
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from wantrain.app.serve.clips import ClipGone, frame_strip, list_clips, resolve_clip, run_folders, save_caption
from wantrain.app.serve.rundata import RunData, RunGone, ask, list_runs, resolve_file, resolve_run
from wantrain.core.inbox import ACTIONS
from wantrain.data.media import MediaError

STATIC = Path(__file__).parent / "static"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
TOKEN_HEADER = "x-wantrain-token"
MAX_POINTS = 2000
"""Points per metric on a page load (the downsampling of :func:`rundata.downsample`)."""
MAX_EVENTS = 5000
"""Timeline items per poll: the latest ones (the page shows the latest 2000 that pass its filter)."""


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers={"Cache-Control": "no-store"})


def error(message: str, status: int) -> Response:
    return json_response({"error": message}, status)


class Site:
    """The state of one server: the output directory, the token, the runs read so far. ``hosts``: the names a
    request's ``Host:`` may give when ``local_only`` (the bound address is added by :class:`PageServer`)."""

    def __init__(self, root: Path, *, token: str | None = None, local_only: bool = True,
                 read_only: bool = False, hosts: frozenset[str] | set[str] = frozenset(),
                 data: tuple[Path, ...] = ()) -> None:
        self.root = Path(root).resolve()
        self.data = tuple(Path(p).resolve() for p in data)  # prepared folders shown with --data
        self.token = token or secrets.token_urlsafe(24)
        self.local_only, self.read_only = local_only, read_only
        self.hosts = frozenset(LOCAL_HOSTS | set(hosts))
        # this server's cookie (browsers share cookies across the ports of one host: two servers must not mix)
        self.cookie = "wantrain_token_" + hashlib.sha256(self.token.encode()).hexdigest()[:12]
        self._runs: dict[str, RunData] = {}
        self._lock = threading.Lock()  # guards the dict; each run has its own lock for reading it

    def _data(self, name: str) -> RunData:
        path = resolve_run(self.root, name)
        with self._lock:
            data = self._runs.get(name)
            if data is None:
                data = self._runs[name] = RunData(path)
        return data

    def _refresh(self, name: str, data: RunData) -> None:
        try:
            data.refresh()
        except RunGone:
            with self._lock:
                self._runs.pop(name, None)
            raise

    def view(self, name: str, read: Callable[[RunData], Any]) -> Any:
        """``read(data)`` of the run ``name`` refreshed, under the run's lock (another thread may refresh it);
        :class:`RunGone` when it is not (or no longer) a run of the root."""
        data = self._data(name)
        with data.lock:
            self._refresh(name, data)
            return read(data)

    def run(self, name: str) -> RunData:
        """The run ``name`` refreshed (for one thread: tests, benchmarks)."""
        return self.view(name, lambda data: data)

    def runs(self) -> list[dict[str, Any]]:
        """The summary of every run; a run another thread is reading (the first read of a large run) shows its
        last summary, or ``reading``, rather than holding up the list."""
        out = []
        for fresh in list_runs(self.root):
            try:
                data = self._data(fresh.name)
            except RunGone:
                continue  # deleted between the listing and the read
            if not data.lock.acquire(blocking=False):
                out.append(data.last_summary or reading_summary(data))
                continue
            try:
                self._refresh(fresh.name, data)
                data.last_summary = data.summary()
                out.append(data.last_summary)
            except RunGone:
                continue
            finally:
                data.lock.release()
        return out

    def prefetch(self) -> None:
        """Read every run once, newest first (a background thread of the server): the first read of a large run
        parses all its JSONL (seconds for 100k steps), every later one only what was appended."""
        for fresh in list_runs(self.root):
            try:
                self.run(fresh.name)
            except RunGone:
                continue

    def data_folders(self, params: Any) -> list[tuple[Path, str]]:
        """``(folder, caption extension)`` of the data view's source: ``run`` (its config's data folders) or
        ``folder`` (the index of a ``--data`` folder). :class:`ClipGone` for anything else."""
        if params.get("run") is not None:
            try:
                return run_folders(resolve_run(self.root, str(params["run"])))
            except RunGone as exc:
                raise ClipGone(str(exc)) from None
        try:
            return [(self.data[int(params.get("folder"))], ".txt")]
        except (TypeError, ValueError, IndexError):
            raise ClipGone("name a run (run=...) or a --data folder (folder=0, 1, ...)") from None

    def data_folder(self, params: Any) -> tuple[Path, str]:
        """The one folder ``f`` (its index) of :meth:`data_folders`."""
        folders = self.data_folders(params)
        try:
            return folders[int(params.get("f", 0))]
        except (TypeError, ValueError, IndexError):
            raise ClipGone(f"f must be a folder index 0 to {len(folders) - 1}") from None

    def has_token(self, request: Request, *, header_only: bool = False) -> bool:
        given = request.headers.get(TOKEN_HEADER)
        if given is None and not header_only:
            given = request.query_params.get("token") or request.cookies.get(self.cookie)
        return given is not None and secrets.compare_digest(given.encode(), self.token.encode())


def reading_summary(data: RunData) -> dict[str, Any]:
    """The runs list's line for a run whose first read is under way."""
    return {"id": data.name, "name": None, "status": "reading", "step": 0, "total_steps": None, "last_loss": None,
            "eta_s": None, "age_s": None, "kind": "train", "experts": None, "reason": None, "problems": []}


def build_app(site: Site) -> Starlette:
    # plain functions: Starlette runs them in its thread pool, off the event loop (see the module docstring)
    def index(request: Request) -> Response:
        if "token" in request.query_params:  # the printed URL: keep the token in a cookie, drop it from the URL
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(site.cookie, site.token, httponly=True, samesite="strict")
            return response
        html = (STATIC / "index.html").read_text(encoding="utf-8")
        meta = (f'<meta name="wantrain-token" content="{site.token}">'
                f'<meta name="wantrain-read-only" content="{str(site.read_only).lower()}">')
        return HTMLResponse(html.replace("<!--wantrain-meta-->", meta), headers={"Cache-Control": "no-store"})

    def runs(request: Request) -> Response:
        return json_response({"root": str(site.root), "read_only": site.read_only, "runs": site.runs(),
                              "data": [str(p) for p in site.data]})

    def run_info(request: Request) -> Response:
        return json_response(site.view(request.path_params["run"], lambda data: {
            "summary": data.summary(), **data.details(), "samples": data.samples(),
            "checkpoints": data.checkpoints(), "generation": data.generation}))

    def series(request: Request) -> Response:
        q = request.query_params
        try:
            max_points = max(4, min(int(q.get("max", MAX_POINTS)), 100_000))
            lo = float(q["lo"]) if "lo" in q else None
            hi = float(q["hi"]) if "hi" in q else None
        except ValueError:
            return error("max, lo and hi must be numbers", 400)

        def read(data: RunData) -> dict[str, Any]:
            switches = data.switches[::max(1, len(data.switches) // max_points)]  # denser than pixels: thinned
            return {"rows": data.rows, "series": data.downsampled(max_points, lo, hi), "switches": switches,
                    "generation": data.generation}

        return json_response(site.view(request.path_params["run"], read))

    def poll(request: Request) -> Response:
        """What was written since the page's last look: metric points from row ``m`` on, timeline items from
        ``e`` on (at most the latest :data:`MAX_EVENTS`), and the small lists (samples, checkpoints) whole.
        ``generation`` changes when a resume rewrote the logs: the page then loads the run again."""
        try:
            rows, events = int(request.query_params.get("m", 0)), int(request.query_params.get("e", 0))
        except ValueError:
            return error("m and e must be integers", 400)
        return json_response(site.view(request.path_params["run"], lambda data: {
            "summary": data.summary(), "rows": data.rows, "points": data.points_since(rows),
            "events": data.timeline[max(events, len(data.timeline) - MAX_EVENTS):],
            "event_count": len(data.timeline), "generation": data.generation,
            "samples": data.samples(), "checkpoints": data.checkpoints(),
        }))

    def run_file(request: Request) -> Response:
        run_dir = site.view(request.path_params["run"], lambda data: data.run_dir)
        path = resolve_file(run_dir, request.path_params["path"])
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    def change_refused(request: Request, what: str, off: str) -> Response | None:
        """The refusal of a request that changes something (a control, a caption), or None."""
        if not site.has_token(request, header_only=True):
            return error(f"{what} needs the server's token in the X-Wantrain-Token header", 403)
        if site.read_only:
            return error(f"the server is read-only (--read-only): {off}", 403)
        return None

    async def change_body(request: Request, what: str, off: str, keys: tuple[str, ...],
                          shape: str) -> dict[str, Any] | Response:
        """The JSON object a request that changes something sends, holding ``keys``; else the response refusing it
        (:func:`change_refused`, or 400 naming the ``shape`` expected)."""
        refused = change_refused(request, what, off)
        if refused is not None:
            return refused
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) or any(key not in body for key in keys):
            return error(f"the body must be JSON {shape}", 400)
        return body

    async def control(request: Request) -> Response:
        body = await change_body(request, "a control", "controls are off", ("action",), '{"action": ...}')
        if isinstance(body, Response):
            return body
        action = body["action"]
        if not isinstance(action, str) or action not in ACTIONS:
            return error(f"unknown action {action!r}: use one of {', '.join(ACTIONS)}", 400)
        return await run_in_threadpool(ask_run, request.path_params["run"], action)

    def ask_run(name: str, action: str) -> Response:
        run_dir, ended = site.view(name, lambda data: (data.run_dir, data.ended))  # the cached state
        try:
            request_id = ask(run_dir, action, "web", ended=ended)
        except ValueError as exc:
            return error(str(exc), 409)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return error(f"this server may not write the run's inbox ({exc.strerror}): the run folder's "
                             "permissions decide who may ask the run; run wantrain serve as the run's owner", 403)
            return error(f"cannot write the run's inbox: {exc.strerror}", 500)
        return json_response({"request_id": request_id, "action": action})

    def data_list(request: Request) -> Response:
        folders = site.data_folders(request.query_params)
        return json_response({"folders": [{"index": k, "path": str(p), "extension": ext, "clips": list_clips(p, ext)}
                                          for k, (p, ext) in enumerate(folders)]})

    def data_strip(request: Request) -> Response:
        folder, _ = site.data_folder(request.query_params)
        clip = resolve_clip(folder, request.query_params.get("clip", ""))
        try:
            jpeg = frame_strip(clip)
        except MediaError as exc:
            return error(f"{clip.name}: {exc}", 422)
        return Response(jpeg, media_type="image/jpeg", headers={"Cache-Control": "no-cache"})

    async def data_caption(request: Request) -> Response:
        body = await change_body(request, "saving a caption", "captions cannot be saved", ("clip", "text"),
                                 '{"run" or "folder", "f", "clip", "text"}')
        if isinstance(body, Response):
            return body
        clip, text = str(body["clip"]), body["text"]
        if not isinstance(text, str):
            return error("text must be a string", 400)
        return await run_in_threadpool(write_caption, body, clip, text)

    def write_caption(params: dict[str, Any], clip: str, text: str) -> Response:
        folder, ext = site.data_folder(params)
        try:
            written = save_caption(folder, clip, text, ext)
        except ValueError as exc:
            return error(str(exc), 400)
        except OSError as exc:
            return error(f"cannot write the caption: {exc.strerror or exc}", 403 if exc.errno in (
                errno.EACCES, errno.EPERM, errno.EROFS) else 500)
        return json_response({"clip": clip, "caption_file": str(written)})

    async def gone(request: Request, exc: Exception) -> Response:
        return error(str(exc), 404)

    routes = [
        Route("/", index),
        Route("/api/runs", runs),
        Route("/api/runs/{run}", run_info),
        Route("/api/runs/{run}/series", series),
        Route("/api/runs/{run}/poll", poll),
        Route("/api/runs/{run}/control", control, methods=["POST"]),
        Route("/files/{run}/{path:path}", run_file),
        Route("/api/data", data_list),
        Route("/api/data/strip", data_strip),
        Route("/api/data/caption", data_caption, methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={RunGone: gone, ClipGone: gone})
    return Guard(app, site)


class Guard:
    """ASGI middleware: the host check on loopback, the token check on every address, the origin check for
    requests that change something."""

    def __init__(self, app: Any, site: Site) -> None:
        self.app, self.site = app, site

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self.refusal(request)
        if refusal is not None:
            await error(refusal, 403)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, request: Request) -> str | None:
        site = self.site
        host = request.headers.get("host", "")
        hostname = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        if site.local_only and hostname not in site.hosts:
            return f"host {host!r} refused: this server answers {', '.join(sorted(site.hosts))} only"
        if not request.url.path.startswith("/static/") and not site.has_token(request):
            return "this server needs its token: open the URL it printed (with ?token=...)"
        origin = request.headers.get("origin")
        if request.method != "GET" and origin is not None and origin not in (f"http://{host}", f"https://{host}"):
            return f"a request from another origin ({origin}) is refused"
        return None
