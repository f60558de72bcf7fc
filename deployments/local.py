"""A Prefect server and a process worker on this machine, as subprocesses (`deployments.demo --served`).

`PrefectServer(home)` runs `prefect server start` on a free loopback port with its SQLite database under
`home` and the UI pointed at that port's API (`PREFECT_UI_API_URL`), and waits until the API answers;
`start_worker(pool, env)` runs `prefect worker start` for a process work pool. Both are plain processes a
user could start by hand: the README's set-up, automated.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PREFECT = [sys.executable, "-m", "prefect"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrefectServer:
    """`prefect server start` under `home` (SQLite); `env` points clients and workers at it."""

    def __init__(self, home: Path, port: int | None = None, startup_timeout_s: float = 120.0):
        self.home = Path(home)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.ui_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.log_path = self.home / "server.log"

    @property
    def env(self) -> dict:
        """The environment that points Prefect clients and workers at this server."""
        return {"PREFECT_API_URL": self.url, "PREFECT_UI_URL": self.ui_url, "PREFECT_HOME": str(self.home),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    def __enter__(self) -> PrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        # the UI a browser loads asks /ui-settings where its API is: without PREFECT_UI_API_URL it says
        # http://127.0.0.1:4200/api whatever port the server listens on, and the page cannot connect
        env = {**os.environ, **self.env, "PREFECT_UI_API_URL": self.url,
               "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.home / 'prefect.db'}"}
        env.pop("PREFECT_API_URL")
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port",
                                         str(self.port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.process.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"prefect server on port {self.port} not healthy after {self.startup_timeout_s:.0f}s; "
                           f"see {self.log_path}")

    def __exit__(self, *exc) -> None:
        stop(self.process)


def start_worker(pool: str, env: dict, log_path: Path, query_s: float = 2.0) -> subprocess.Popen:
    """`prefect worker start --pool POOL --type process`, polling every `query_s` seconds."""
    env = {**os.environ, **env, "PREFECT_WORKER_QUERY_SECONDS": str(query_s)}
    log = open(log_path, "ab")
    return subprocess.Popen([*PREFECT, "worker", "start", "--pool", pool, "--type", "process"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def stop(process: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=timeout)
