"""``wantrain serve``: a live page for the runs of an output directory (docs/serve.md).

``rundata`` reads a run directory (incrementally, the run directory alone), ``server`` is the web app (Starlette)
with its safety checks, ``static/`` the page (plain JavaScript and the vendored uPlot). :class:`PageServer` binds
and runs it (uvicorn) in this process: in the foreground for ``wantrain serve``, in a thread for tests.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from pathlib import Path

import attrs
import uvicorn

from wantrain.app.serve.server import LOCAL_HOSTS, Site, build_app

TOKEN_ENV = "WANTRAIN_SERVE_TOKEN"
"""An environment variable that sets the server's token (a fixed one, for a bookmark or a script); a random one
otherwise."""


def is_loopback(host: str) -> bool:
    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@attrs.define
class PageServer:
    """The page of ``root`` on ``host:port`` (port 0: any free port). Bound when built, so :attr:`url` is known
    before it serves. Every request for the page or a run needs the token (:attr:`token_url` carries it); its
    value is random unless ``$WANTRAIN_SERVE_TOKEN`` sets it."""

    root: Path
    host: str = "127.0.0.1"
    port: int = 8765
    read_only: bool = False
    data: tuple[Path, ...] = ()  # prepared folders whose clips and captions the page shows (--data)
    site: Site = attrs.field(init=False)
    sock: socket.socket = attrs.field(init=False)
    server: uvicorn.Server = attrs.field(init=False)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.site = Site(self.root, local_only=is_loopback(self.host), read_only=self.read_only,
                         hosts={self.host, f"[{self.host}]"} if ":" in self.host else {self.host},
                         token=os.environ.get(TOKEN_ENV) or None, data=tuple(self.data))
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((self.host, self.port))
        except OSError:
            self.sock.close()
            raise
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.site), log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def token_url(self) -> str:
        return f"{self.url}?token={self.site.token}"

    def serve_forever(self) -> None:
        threading.Thread(target=self.site.prefetch, name="wantrain-serve-prefetch", daemon=True).start()
        self.server.run(sockets=[self.sock])

    def start(self) -> PageServer:
        """Serve in a daemon thread; returns when it accepts connections."""
        self._thread = threading.Thread(target=self.serve_forever, name="wantrain-serve", daemon=True)
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            threading.Event().wait(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()
