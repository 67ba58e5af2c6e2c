"""``python`` processes of the suite forked from one that has already imported the stack.

A fresh ``python -m wantrain run`` spends ~13 s of CPU importing torch, diffusers, transformers and peft before it
reads its config, and ~3 s more tearing them down at exit (the 2-core CI machine): most of a tiny run. The tests that
need a process of their own (it is killed, signalled, or holds a lock another process must see) but are not about
what a fresh process prints start it here: :class:`Popen` and :func:`run` take a ``python`` command line without the
interpreter (``["-m", "wantrain", "run", ...]``, ``["-c", code, ...]`` or ``[script, ...]``) and behave like
:class:`subprocess.Popen` and :func:`subprocess.run` for it, but the process is a fork of a server that imported
the stack once and then waits, single-threaded, for requests on a Unix socket.

- One server per test process, started on first use and forked away from it (no child of the test process, so the
  tests of a process tree's memory do not count it); it exits when the pipe on its stdin closes with the test
  process.
- A request carries the command, its working directory, its environment and its stdin, stdout and stderr. The fork
  takes them and runs the command as ``python`` would (``__main__``, ``sys.argv``, ``sys.path[0]``); it ends as
  the interpreter would (a ``SystemExit``'s code, 1 after a traceback, death by SIGINT after an uncaught
  ``KeyboardInterrupt``, non-daemon threads joined, ``atexit`` functions run, streams flushed) but skips the
  teardown of every module. The server reaps it and sends its exit code (``-N`` for signal N, as in
  :mod:`subprocess`); its pid is the one the test signals.
- What differs from a fresh process: every module of :data:`PRELOAD` is imported before the command runs. A command
  that patches the stack must patch the name where it is looked up (``from x import y`` bindings are made), and
  warnings those imports print went to the server's log (:func:`server_log`). The tests that check what a fresh
  process prints (no warning, no traceback: tests/test_newcomer_path.py's first run, tests/data/
  test_media_accounting.py, the import checks) and the torchrun launches keep :mod:`subprocess`;
  tests/test_newcomer_path.py's later commands fork here and check the server's log too."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
PRELOAD = (
    "torch", "torch._dynamo",  # an optimizer's constructor imports torch._dynamo (~2 s)
    "wantrain.cli.main", "wantrain.app.train", "wantrain.app.lr_finder", "wantrain.app.replay",
    "diffusers.models.autoencoders.autoencoder_kl_wan", "diffusers.models.transformers.transformer_wan",
    "diffusers.pipelines.wan", "transformers.models.umt5.modeling_umt5", "transformers.models.auto.tokenization_auto",
    "peft", "tensorboardX", "safetensors.torch", "av",
    "torch.distributed.fsdp", "torch.distributed.checkpoint",  # ~1.3 s of CPU in each rank of an FSDP launch
)
_HEADER = struct.Struct("!I")


# ---------------------------------------------------------------------------------------------------- the server

def _serve(path: str) -> dict:
    """Import :data:`PRELOAD`, say ``ready`` on stdout and serve requests until stdin (the test process's end of a
    pipe) closes. Returns only in a fork: the request it is to run, with its three descriptors on 0, 1 and 2."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, f"the server must not fork with threads: {threading.enumerate()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the wakeup fd
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(0, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.fileobj == 0 and not os.read(0, 4096):
                os._exit(0)  # the test process has gone; its forks end on their own
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _reap(running)
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request, fds = _receive(conn)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for sock in [listener, conn, *running.values()]:
                        sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                    for fd in set(fds) - {0, 1, 2}:
                        os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                running[pid] = conn
                _send(conn, {"pid": pid})


def _reap(running: dict[int, socket.socket]) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid)
        with contextlib.suppress(OSError):  # the test process may have stopped listening
            _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        chunk = conn.recv(1 << 16)
        assert chunk, "the request ended early"
        data += chunk
    return json.loads(data[_HEADER.size:]), fds


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _execute(request: dict) -> None:
    """Run the request's command in this fork as ``python`` would, and end as it would: the exit code of a
    ``SystemExit``, 1 after an exception's traceback, death by SIGINT after an uncaught ``KeyboardInterrupt``; then
    the non-daemon threads are joined, the ``atexit`` functions run and the streams flushed. The teardown of every
    module that a fresh interpreter does after that (~3 s of CPU with this stack, touching every page the fork
    shares with the server) is skipped: ``os._exit``."""
    try:
        _command(request)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _command(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv, sys.path[0] = list(argv), str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------------------------------------------- the client

class _Server:
    """The server of this test process, started on first use and stopped when the process ends."""

    _lock = threading.Lock()
    _path: str | None = os.environ.get("PREWARMED_SERVER")  # a relay's: its test process's server
    _log: Path | None = None

    @classmethod
    def path(cls) -> str:
        with cls._lock:
            if cls._path is None:
                folder = tempfile.mkdtemp(prefix="wantrain-prewarmed-")
                path = os.path.join(folder, "server.sock")
                log = Path(folder, "server.log")
                with log.open("wb") as errors:
                    server = subprocess.Popen([sys.executable, __file__, path], stdin=PIPE, stdout=PIPE,
                                              stderr=errors)
                ready = server.stdout.readline()
                assert ready == b"ready\n", f"the prewarmed server did not start:\n{log.read_text()}"
                server.wait()  # the launcher that forked the server away
                atexit.register(cls._stop, server.stdin, folder)
                cls._path, cls._log = path, log
            return cls._path

    @staticmethod
    def _stop(lifeline, folder: str) -> None:
        lifeline.close()  # the server sees its stdin end and exits
        shutil.rmtree(folder, ignore_errors=True)


def server() -> str:
    """The socket of this test process's server (started if need be), for a relay's ``PREWARMED_SERVER``."""
    return _Server.path()


def server_log() -> str:
    """What the server printed while importing :data:`PRELOAD` (the warnings a fresh process would print at those
    imports), for the tests that check a command prints none; empty before the server started."""
    log = _Server._log
    return log.read_text(errors="replace") if log is not None and log.exists() else ""


class Popen:
    """A :class:`subprocess.Popen` of ``python *argv`` forked from the prewarmed server: ``pid``, ``stdout``,
    ``stderr``, ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate`` and ``kill``
    behave as there (``stdout``/``stderr``: ``PIPE``, ``DEVNULL``, an open file, ``None`` to share this process's,
    and ``STDOUT`` for stderr)."""

    def __init__(self, argv, *, stdout=None, stderr=None, text: bool = False, cwd=None, env=None):
        self.args = [str(a) for a in argv]
        self.returncode: int | None = None
        self.stdout = self.stderr = None
        devnull = os.open(os.devnull, os.O_RDWR)
        child = [devnull, 1, 2]
        ours = []
        for index, how in ((1, stdout), (2, stderr)):
            if how == PIPE:
                read, write = os.pipe()
                child[index] = write
                ours.append(write)
                handle = open(read, "r" if text else "rb", encoding="utf-8" if text else None)  # noqa: SIM115
                setattr(self, ("stdout", "stderr")[index - 1], handle)
            elif how == DEVNULL:
                child[index] = devnull
            elif how == STDOUT and index == 2:
                child[2] = child[1]
            elif how is not None:
                child[index] = how.fileno()  # an open file
        request = json.dumps({"argv": self.args, "cwd": str(cwd or os.getcwd()),
                              "env": dict(os.environ if env is None else env)}).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_Server.path())
        socket.send_fds(self._conn, [_HEADER.pack(len(request)) + request], child)
        for fd in [devnull, *ours]:
            os.close(fd)
        self._buffer = b""
        self.pid = self._message(None)["pid"]

    def _message(self, timeout: float | None) -> dict | None:
        """The server's next line, or None if it has not come within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            assert chunk, "the prewarmed server closed the connection"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            message = self._message(timeout)
            if message is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = message["returncode"]
            self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple:
        deadline = None if timeout is None else time.monotonic() + timeout
        outputs: list = [None, None]
        readers = []
        for index, handle in enumerate((self.stdout, self.stderr)):
            if handle is not None:
                reader = threading.Thread(target=lambda i=index, h=handle: outputs.__setitem__(i, h.read()),
                                          daemon=True)
                reader.start()
                readers.append(reader)
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for handle in (self.stdout, self.stderr):
            if handle is not None:
                handle.close()
        return outputs[0], outputs[1]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(argv, *, capture_output: bool = False, text: bool = False, timeout: float | None = None, cwd=None,
        env=None) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` of ``python *argv`` forked from the prewarmed server."""
    how = PIPE if capture_output else None
    proc = Popen(argv, stdout=how, stderr=how, text=text, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


if __name__ == "__main__":
    if os.fork():
        os._exit(0)  # the server is no child of the test process: tests of its process tree's memory see none
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout, as for the test process
    _execute(_serve(sys.argv[1]))
