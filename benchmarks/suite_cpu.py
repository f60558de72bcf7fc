"""Where the test suite's CPU goes: every process it starts (workers under sshd included), by kind and by test.

On a 2-core machine the suite is CPU-bound, so its wall time is its CPU time over the cores: this says which
processes and which tests spend it. Needs root and the kernel's process accounting (Debian's `acct`:
`apt-get install acct`). It turns accounting on into a file of its own, puts a `sitecustomize.py` into the
venv's site-packages for the run (each Python process records its pid, argv and `PYTEST_CURRENT_TEST` as it
starts; removed afterwards), runs the suite's pytest run as `scripts/test.sh` does (no set-up, no lint),
then joins the two: CPU seconds per kind of process (an extraction worker, the Prefect servers, the xdist
workers, ...) and per test (a process is the test's whose temp directory its argv names, or whose
`PYTEST_CURRENT_TEST` it inherited).

    .venv/bin/python benchmarks/suite_cpu.py [--top 30] [-- extra pytest args]
    .venv/bin/python benchmarks/suite_cpu.py --analyze DIR   # a run's records again
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDER = '''import os, sys, time
try:
    with open(os.path.join({where!r}, "%d-%.3f" % (os.getpid(), time.time())), "w") as _f:
        _f.write("\\x00".join(list(getattr(sys, "orig_argv", sys.argv))[:40]) + "\\x01"
                 + os.environ.get("PYTEST_CURRENT_TEST", ""))
except Exception:
    pass
'''
SUBCOMMANDS = ("extract", "check", "fsck", "export", "stage", "make-tiny", "inspect", "--version")


def suite_args(workers: int | None = None) -> list[str]:
    """The pytest arguments of scripts/test.sh's run: `workers` processes (default HSX_TEST_WORKERS or 3), a
    file's tests in one process, the longest files first."""
    workers = workers or int(os.environ.get("HSX_TEST_WORKERS", "3"))
    return ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"]


def kind_of(argv: list[str]) -> str:
    """A process's kind, from its argv."""
    text = " ".join(argv)
    if "exec(eval(sys.stdin.readline()))" in text:
        return "pytest-xdist worker"
    if "uvicorn" in text:
        return "Prefect server (uvicorn)"
    if "torch, transformers, safetensors; print(" in text:
        return "deploy's environment check (imports torch, transformers)"
    if "-m" in argv:
        module = argv[argv.index("-m") + 1] if argv.index("-m") + 1 < len(argv) else ""
        if module in ("hsextract", "harness.faulty"):
            sub = next((a for a in argv if a in SUBCOMMANDS), "?")
            return f"{module} {sub}"
        return f"-m {module}"
    return "python " + " ".join(a[:40] for a in argv[1:3]).replace("\n", " ")


def test_of(argv: list[str], current: str) -> str:
    """The test a process served: its inherited PYTEST_CURRENT_TEST, else the pytest temp directory its argv names."""
    if current:
        return current.split(" ")[0].split("::", 1)[-1].split("[")[0]
    for arg in argv:
        if m := re.search(r"pytest-\d+/(?:popen-gw\d+/)?([^/]+)", arg):
            name = m.group(1)
            if not name.startswith(("model", "data")):  # session fixtures' directories name no test
                return re.sub(r"\d+$", "", name) + " (dir)"
    return "(none: servers, fixtures)"


def analyze(records: Path, top: int) -> None:
    accounting = subprocess.run(["dump-acct", str(records / "pacct")], capture_output=True, text=True,
                                check=True).stdout
    cpu: dict[int, list[float]] = collections.defaultdict(list)
    total = 0.0
    for line in accounting.splitlines():
        f = [x.strip() for x in line.split("|")]
        try:
            seconds = (float(f[2]) + float(f[3])) / 100  # ticks of AHZ=100
            cpu[int(f[9])].append(seconds)
            total += seconds
        except (ValueError, IndexError):
            continue
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    tests: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    python, latest = 0.0, {}
    for path in records.glob("starts/*"):  # a process that exec'd another Python: its last program's
        pid, started = path.name.split("-", 1)
        if float(started) >= latest.get(int(pid), (0.0, None))[0]:
            latest[int(pid)] = (float(started), path)
    for pid, (_, path) in latest.items():
        if not cpu.get(pid):
            continue
        seconds = cpu[pid][-1]
        argv_text, _, current = path.read_text().partition("\x01")
        argv = argv_text.split("\x00")
        for table, key in ((kinds, kind_of(argv)), (tests, test_of(argv, current))):
            table[key][0] += 1
            table[key][1] += seconds
        python += seconds
    print(f"CPU of every process the suite started: {total:.0f} s (Python processes {python:.0f} s, the rest: "
          f"sshd, shells, Chromium, tools {total - python:.0f} s)")
    for title, table in (("kind of process", kinds), ("test", tests)):
        print(f"\n| {title} | processes | CPU s | share |\n|---|---|---|---|")
        for key, (n, seconds) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"| {key} | {n:.0f} | {seconds:.0f} | {seconds / total:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--analyze", type=Path, help="a directory a run left (kept when --keep)")
    parser.add_argument("--keep", type=Path, help="keep the run's records in this directory")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    if args.analyze:
        analyze(args.analyze, args.top)
        return
    if os.geteuid() != 0 or not shutil.which("accton") or not shutil.which("dump-acct"):
        sys.exit("needs root and process accounting: apt-get install acct")
    records = Path(args.keep or tempfile.mkdtemp(prefix="hsx-suite-cpu-"))
    (records / "starts").mkdir(parents=True, exist_ok=True)
    site = Path(sysconfig.get_paths()["purelib"]) / "sitecustomize.py"
    if site.exists():
        sys.exit(f"{site} exists: not overwriting it")
    site.write_text(RECORDER.format(where=str(records / "starts")))
    (records / "pacct").touch()
    subprocess.run(["accton", str(records / "pacct")], check=True, capture_output=True)
    began = time.time()
    try:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suite_args(),
                        *args.pytest_args], cwd=ROOT)
    finally:
        subprocess.run(["accton", "off"], capture_output=True)
        site.unlink()
    print(f"\nthe suite: {time.time() - began:.0f} s wall on {os.cpu_count()} cores")
    analyze(records, args.top)


if __name__ == "__main__":
    main()
