"""The web server of ``wantrain serve`` (Starlette on uvicorn): the page, its JSON API and the run's files.

Safety (docs/serve.md):

* it binds to 127.0.0.1 unless told another address; requests must then name a local host (``Host:``), which
  stops a web page from reaching the server through a DNS name it controls (DNS rebinding);
* bound to another address, every request needs the token it prints (``?token=`` once, then a cookie, or the
  ``X-Wantrain-Token`` header), as Jupyter does;
* a control (save / sample / validate / stop) always needs the token in the ``X-Wantrain-Token`` header -- the page
  served to this machine embeds it, another site cannot read it -- and a request whose ``Origin`` is not the
  server's own is refused; ``read_only`` refuses every control;
* only run directories directly under the output directory and files inside them are read: a name with ``..``, an
  absolute path, or a link that leads outside is refused (404).

Every error is a JSON ``{"error": "..."}`` with its status; the server stays up.
"""

from __future__ import annotations

import secrets
import threading
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from wantrain.app.serve.rundata import RunData, RunGone, ask, list_runs, resolve_file, resolve_run
from wantrain.core.inbox import ACTIONS

STATIC = Path(__file__).parent / "static"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
TOKEN_HEADER = "x-wantrain-token"
COOKIE = "wantrain_token"
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
    """The state of one server: the output directory, the token, the runs read so far."""

    def __init__(self, root: Path, *, token: str | None = None, local_only: bool = True,
                 read_only: bool = False) -> None:
        self.root = Path(root).resolve()
        self.token = token or secrets.token_urlsafe(24)
        self.local_only, self.read_only = local_only, read_only
        self._runs: dict[str, RunData] = {}
        self._lock = threading.Lock()

    def run(self, name: str) -> RunData:
        """The run ``name`` refreshed; :class:`RunGone` when it is not (or no longer) a run of the root."""
        path = resolve_run(self.root, name)
        with self._lock:
            data = self._runs.get(name)
            if data is None:
                data = self._runs[name] = RunData(path)
            try:
                data.refresh()
            except RunGone:
                self._runs.pop(name, None)
                raise
        return data

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for fresh in list_runs(self.root):
            try:
                out.append(self.run(fresh.name).summary())
            except RunGone:
                continue  # deleted between the listing and the read
        return out

    def prefetch(self) -> None:
        """Read every run once, newest first (a background thread of the server): the first read of a large run
        parses all its JSONL (seconds for 100k steps), every later one only what was appended."""
        for fresh in list_runs(self.root):
            try:
                self.run(fresh.name)
            except RunGone:
                continue

    def has_token(self, request: Request, *, header_only: bool = False) -> bool:
        given = request.headers.get(TOKEN_HEADER)
        if given is None and not header_only:
            given = request.query_params.get("token") or request.cookies.get(COOKIE)
        return given is not None and secrets.compare_digest(given.encode(), self.token.encode())


def build_app(site: Site) -> Starlette:
    async def index(request: Request) -> Response:
        if "token" in request.query_params:  # the printed URL: keep the token in a cookie, drop it from the URL
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(COOKIE, site.token, httponly=True, samesite="strict")
            return response
        html = (STATIC / "index.html").read_text(encoding="utf-8")
        meta = (f'<meta name="wantrain-token" content="{site.token}">'
                f'<meta name="wantrain-read-only" content="{str(site.read_only).lower()}">')
        return HTMLResponse(html.replace("<!--wantrain-meta-->", meta), headers={"Cache-Control": "no-store"})

    async def runs(request: Request) -> Response:
        return json_response({"root": str(site.root), "read_only": site.read_only, "runs": site.runs()})

    async def run_info(request: Request) -> Response:
        data = site.run(request.path_params["run"])
        return json_response({"summary": data.summary(), **data.details(), "samples": data.samples(),
                              "checkpoints": data.checkpoints()})

    async def series(request: Request) -> Response:
        data = site.run(request.path_params["run"])
        q = request.query_params
        try:
            max_points = max(4, min(int(q.get("max", MAX_POINTS)), 100_000))
            lo = float(q["lo"]) if "lo" in q else None
            hi = float(q["hi"]) if "hi" in q else None
        except ValueError:
            return error("max, lo and hi must be numbers", 400)
        switches = data.switches[::max(1, len(data.switches) // max_points)]  # denser than pixels: thinned
        return json_response({"rows": data.rows, "series": data.downsampled(max_points, lo, hi),
                              "switches": switches})

    async def poll(request: Request) -> Response:
        """What was written since the page's last look: metric points from row ``m`` on, timeline items from
        ``e`` on (at most the latest :data:`MAX_EVENTS`), and the small lists (samples, checkpoints) whole."""
        data = site.run(request.path_params["run"])
        try:
            rows, events = int(request.query_params.get("m", 0)), int(request.query_params.get("e", 0))
        except ValueError:
            return error("m and e must be integers", 400)
        return json_response({
            "summary": data.summary(), "rows": data.rows, "points": data.points_since(rows),
            "events": data.timeline[max(events, len(data.timeline) - MAX_EVENTS):],
            "event_count": len(data.timeline),
            "samples": data.samples(), "checkpoints": data.checkpoints(),
        })

    async def run_file(request: Request) -> Response:
        data = site.run(request.path_params["run"])
        path = resolve_file(data.run_dir, request.path_params["path"])
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    async def control(request: Request) -> Response:
        if not site.has_token(request, header_only=True):
            return error("a control needs the server's token in the X-Wantrain-Token header", 403)
        if site.read_only:
            return error("the server is read-only (--read-only): controls are off", 403)
        try:
            body = orjson.loads(await request.body())
            action = body["action"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return error('the body must be JSON {"action": ...}', 400)
        if action not in ACTIONS:
            return error(f"unknown action {action!r}: use one of {', '.join(ACTIONS)}", 400)
        data = site.run(request.path_params["run"])
        try:
            request_id = ask(data.run_dir, action, "web")
        except ValueError as exc:
            return error(str(exc), 409)
        except OSError as exc:
            return error(f"cannot write the run's inbox: {exc.strerror}", 500)
        return json_response({"request_id": request_id, "action": action})

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
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={RunGone: gone})
    return Guard(app, site)


class Guard:
    """ASGI middleware: the host check, the token check for remote binds, the origin check for controls."""

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
        if site.local_only and hostname not in LOCAL_HOSTS:
            return f"host {host!r} refused: this server answers 127.0.0.1 and localhost only"
        if not site.local_only and not site.has_token(request):
            return "this server needs its token: open the URL it printed (with ?token=...)"
        origin = request.headers.get("origin")
        if request.method != "GET" and origin is not None and origin not in (f"http://{host}", f"https://{host}"):
            return f"a request from another origin ({origin}) is refused"
        return None
