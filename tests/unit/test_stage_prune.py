"""`hsextract stage prune`: what no staging used for a while leaves a host's input cache; what a view still links
to, what a staging just placed and the sources named stay. On a real cache, staged through `place`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hsextract.data.inputcache import Cache
from hsextract.data.sources import local_manifest

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400


def staged(cache: Cache, src: Path, files: dict[str, bytes]):
    """`files` written under `src`, sent into the cache's partial files and placed, as staging does; the view."""
    src.mkdir(parents=True)
    for name, body in files.items():
        (src / name).write_bytes(body)
    manifest = local_manifest(src)
    for e in manifest.files:
        part = cache.partial(e, manifest.source)
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes((src / e.path).read_bytes())
    cache.follow([manifest], stall_s=0)
    return manifest, cache.view(manifest)


def age(path: Path, days: float) -> None:
    then = time.time() - days * DAY
    os.utime(path, (then, then), follow_symlinks=False)


def prune(cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsextract", "stage", "prune", "--cache", str(cache), *extra],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def test_prune_removes_what_no_recent_staging_used(tmp_path):
    cache = Cache(tmp_path / "inputs")
    old, old_view = staged(cache, tmp_path / "old", {"config.json": b"{}", "w.bin": b"old weights" * 1000})
    shared, shared_view = staged(cache, tmp_path / "new", {"config.json": b"{}", "w.bin": b"new weights" * 1000})
    gone_part = cache.root / "partial" / "abandoned.part"
    gone_part.write_bytes(b"x" * 4096)
    fresh_part = cache.root / "partial" / "arriving.part"
    fresh_part.write_bytes(b"y" * 10)
    for path in (old_view, gone_part, *cache.root.glob("blobs/*/*")):
        age(path, 30)

    assert cache.view(shared) == shared_view  # used again today: the view's age starts over
    before = sorted(p for p in cache.root.rglob("*"))
    dry = prune(cache.root, "--older-than-days", "14", "--dry-run")
    assert dry.returncode == 0 and sorted(p for p in cache.root.rglob("*")) == before, "a dry run removes nothing"
    got = prune(cache.root, "--older-than-days", "14")
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout.removeprefix("STAGE "))
    assert json.loads(dry.stdout.removeprefix("STAGE ")) == out, "a dry run says what the prune then does"
    old_weights = next(e for e in old.files if e.path == "w.bin")
    assert out["views"] == 1 and out["blobs"] == 1 and out["partial"] == 1
    assert out["bytes"] == old_weights.size + 4096
    assert not old_view.exists() and not cache.blob(old_weights.sha256).exists() and not gone_part.exists()
    # the newer view and every blob it links to (config.json is shared with the old source) are whole
    assert (shared_view / "w.bin").read_bytes() == b"new weights" * 1000
    assert (shared_view / "config.json").read_bytes() == b"{}" and fresh_part.exists()
    # staging the old source again sends what was pruned, not the rest
    assert cache.status(old)["missing_bytes"] == old_weights.size


def test_prune_keeps_the_sources_named_and_blobs_just_placed(tmp_path):
    cache = Cache(tmp_path / "inputs")
    kept, kept_view = staged(cache, tmp_path / "a", {"data.jsonl": b'{"id": 1}\n'})
    other, other_view = staged(cache, tmp_path / "b", {"data.jsonl": b'{"id": 2}\n'})
    age(kept_view, 30)
    age(other_view, 30)  # blobs written just now: a staging under way may be about to link them
    manifest = tmp_path / "a.json"
    manifest.write_text(kept.to_json())
    got = prune(cache.root, "--older-than-days", "7", "--manifest", str(manifest))
    out = json.loads(got.stdout.removeprefix("STAGE "))
    assert got.returncode == 0 and out["views"] == 1 and out["blobs"] == 0, got
    assert kept_view.is_dir() and not other_view.exists()
    assert cache.blob(other.files[0].sha256).exists(), "written today: kept"


def test_prune_refuses_a_negative_age_and_other_actions_need_a_manifest(tmp_path):
    got = prune(tmp_path / "inputs", "--older-than-days", "-1")
    assert got.returncode == 2 and "--older-than-days -1.0: expected 0 or more" in got.stderr
    status = subprocess.run([sys.executable, "-m", "hsextract", "stage", "status", "--cache", str(tmp_path)],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert status.returncode == 2 and "stage status needs --manifest" in status.stderr
