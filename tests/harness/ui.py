"""What a person sees of a run in the Prefect UI: the served set-up, one good and one failing run, the page
read by a headless Chromium (Debian's `chromium` package: nothing is downloaded) and the API's view.

`look(work, shots)` runs `python -m deployments.demo --served` (the README's command: server, deployments,
automations, worker, a good run), then a run with a typo in the model path, and returns what it found:
the UI's settings, state messages, names, tags, artifacts, events, and the rendered pages' text, with
screenshots under `shots`. tests/integration/test_ui.py asserts on it; benchmarks/ui_check.py prints it and
refreshes the README's screenshots.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str:
    """The headless browser's path; RuntimeError saying how to install it when there is none."""
    for name in CHROMIUM:
        if path := shutil.which(name):
            return path
    raise RuntimeError("no Chromium on PATH: `apt-get install chromium` (scripts/setup.sh does it when run as root)")


def render(url: str, png: Path | None = None, size: tuple[int, int] = (1600, 1000), budget_ms: int = 12000,
           timeout: float = 120.0) -> str:
    """The page's DOM after its scripts ran for `budget_ms` of virtual time, and its screenshot in `png`."""
    with tempfile.TemporaryDirectory(prefix="hsx-chromium-") as profile:
        args = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--hide-scrollbars", "--no-first-run", f"--user-data-dir={profile}",
                f"--window-size={size[0]},{size[1]}", f"--virtual-time-budget={budget_ms}"]
        dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL).stdout
        if png is not None:
            png.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([*args, f"--screenshot={png}", url], capture_output=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, check=True)
    return dom


def text_of(dom: str) -> str:
    """The visible text of a DOM dump (scripts and styles dropped, tags removed, whitespace collapsed)."""
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", dom)).split())


def get_json(url: str) -> object:
    """GET `url`; the parsed JSON answer."""
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


class Served:
    """`python -m deployments.demo --served` in `work`: the UI address it printed and the processes it left."""

    def __init__(self, work: Path, samples: int = 48):
        self.work = work
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "deployments.demo", "--served", "--workdir", str(work),
                               "--samples", str(samples)], capture_output=True, text=True, env=env,
                              timeout=900, stdin=subprocess.DEVNULL)
        self.demo_s = time.monotonic() - started
        self.output = proc.stdout + proc.stderr
        pids = re.search(r"kill ([\d ]+)\s*$", proc.stdout.strip())
        self.pids = [int(p) for p in pids.group(1).split()] if pids else []
        if proc.returncode != 0 or not pids:
            self.stop()
            raise RuntimeError(f"deployments.demo --served failed (rc {proc.returncode}):\n{self.output[-4000:]}")
        self.ui = re.search(r"^UI: (\S+)", proc.stdout, re.M).group(1)
        self.api = self.ui + "/api"
        self.env = {**env, "PREFECT_API_URL": self.api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    def prefect(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """`prefect ARGS` against this server."""
        return subprocess.run([sys.executable, "-m", "prefect", *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout, stdin=subprocess.DEVNULL)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the worker and the server the demo left running (the worker first, while its server answers),
        each process group SIGTERMed, then SIGKILLed if it is still there after `timeout` seconds."""
        for pid in reversed(self.pids):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and group_alive(pid):
                    time.sleep(0.1)
                if not group_alive(pid):
                    break


def group_alive(pgid: int) -> bool:
    """Some process of group `pgid` runs (a zombie does not count: it has ended)."""
    from harness.worker import proc_stat

    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = proc_stat(int(proc.name))
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def api_view(api: str, run_name: str) -> dict:
    """Through the API: the run's flow runs (tagged `run:<run_name>`; name, state, tags, message), its status,
    shard table and failure artifacts (latest version, and how many versions), and its shard events."""
    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from harness.prefect import run_events

    seen: dict = {}
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run_name}"])))
        seen["runs"] = [{"name": r.name, "state": r.state.type.value, "tags": r.tags, "message": r.state.message,
                         "id": str(r.id)} for r in sorted(runs, key=lambda r: r.created)]
        for kind in ("status", "shards", "failure"):
            key = f"{kind}-{run_name}"
            latest = Artifact.get(key)
            versions = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            seen[kind] = None if latest is None else {"data": latest.data, "versions": len(versions),
                                                      "description": latest.description, "id": str(latest.id)}
        seen["events"] = [{"event": e.event, "resource": dict(e.resource),
                           "related": [dict(r) for r in e.related]}
                          for e in run_events(client, "extract.shard.", run_name)]
    return seen


def look(work: Path, shots: Path) -> dict:
    """Serve, run a good and a failing run, and report what a person would see (see the module doc)."""
    served = Served(work)
    found: dict = {"ui": served.ui, "demo_s": round(served.demo_s, 1), "demo_output": served.output[-1500:]}
    try:
        found["ui_settings"] = get_json(f"{served.ui}/ui-settings")
        found["api_health"] = get_json(f"{found['ui_settings']['api_url']}/health")
        started = time.monotonic()
        typo = served.prefect("deployment", "run", "extract/qwen", "--watch", "--param", "run_name=typo",
                              "--param", f"model={work / 'modle'}", "--param", f"output=file://{work / 'out-typo'}")
        found["typo_s"] = round(time.monotonic() - started, 1)
        found["typo_rc"], found["typo_watch"] = typo.returncode, (typo.stdout + typo.stderr)[-20000:]
        time.sleep(5)  # an automated re-run, if one were asked for, would exist by now
        for name in ("demo", "typo"):
            found[name] = api_view(served.api, name)
            attempts = work / ("out" if name == "demo" else "out-typo") / "_runs" / name / "attempts.json"
            found[name]["attempts"] = json.loads(attempts.read_text()) if attempts.is_file() else {}
        pages = {"good-run": f"{served.ui}/runs/flow-run/{found['demo']['runs'][-1]['id']}",
                 "failed-run": f"{served.ui}/runs/flow-run/{found['typo']['runs'][-1]['id']}",
                 "status": f"{served.ui}/artifacts/artifact/{found['demo']['status']['id']}",
                 "failed-status": f"{served.ui}/artifacts/artifact/{found['typo']['status']['id']}",
                 "failure": f"{served.ui}/artifacts/artifact/{found['typo']['failure']['id']}",
                 "table": f"{served.ui}/artifacts/artifact/{found['demo']['shards']['id']}"}
        found["pages"] = {}
        for name, url in pages.items():
            started = time.monotonic()
            size = (1600, 1400) if name.endswith("run") else (1600, 1000)  # a run page: down to its first errors
            dom = render(url, shots / f"{name}.png", size)
            found["pages"][name] = {"url": url, "text": text_of(dom), "seconds": round(time.monotonic() - started, 1)}
    finally:
        served.stop()
    return found
