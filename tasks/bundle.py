"""The code bundle pushed to the remote hosts: the repository minus what `.prefectignore` excludes.

The tarball is deterministic: the same file contents (and owner-exec bits) give the same bytes, and so the same
sha256, whatever the mtimes, owners, umask, permission bits other than owner-exec, file-system order or checkout
location. A host can therefore compare the hash with what it already has and skip the upload.

Pure standard library plus `pathspec`; never imports torch.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

IGNORE_FILE = ".prefectignore"


@dataclass(frozen=True)
class Bundle:
    """The code bundle: a deterministic tar.gz, its sha256 (what a host proves it holds), and its files."""
    data: bytes  # a .tar.gz
    sha256: str  # hex of `data`
    files: list[str]  # posix relative paths, sorted


def _spec(root: Path) -> pathspec.GitIgnoreSpec:
    ignore = root / IGNORE_FILE
    lines = ignore.read_text(encoding="utf-8").splitlines() if ignore.is_file() else []
    return pathspec.GitIgnoreSpec.from_lines(lines)


def bundle_files(root: Path) -> list[str]:
    """Every regular file under `root` that `root/.prefectignore` (gitignore syntax) does not exclude; sorted.

    `.git` (directory, or the file a worktree/submodule has) is always excluded, at any depth. As in git, a file
    inside an excluded directory cannot be re-included by a later `!pattern` (the directory is never entered).
    Symlinks are skipped entirely, to files and to directories alike: following one could pull in files from
    outside `root`, and a tarball of regular files extracts the same everywhere.
    """
    root = Path(root)
    spec = _spec(root)
    out: list[str] = []
    # os.walk(followlinks=False) never descends into symlinked directories; they show up in `dirs` and are
    # dropped below with the other symlinks.
    for dirpath, dirs, names in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        keep = []
        for d in dirs:
            full = os.path.join(dirpath, d)
            if d == ".git" or os.path.islink(full):
                continue
            if spec.match_file(prefix + d + "/"):  # trailing slash: directory-only patterns ("tests/") match
                continue
            keep.append(d)
        dirs[:] = sorted(keep)
        for n in names:
            full = os.path.join(dirpath, n)
            if n == ".git":
                continue
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):  # symlinks (skipped, see above), fifos, sockets, devices
                continue
            rel = prefix + n
            if not spec.match_file(rel):
                out.append(rel)
    return sorted(out)


def _tar_bytes(root: Path, files: list[str]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in files:
            path = root / rel
            content = path.read_bytes()
            executable = bool(os.stat(path).st_mode & stat.S_IXUSR)
            info = tarfile.TarInfo(rel)
            info.type = tarfile.REGTYPE
            info.size = len(content)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if executable else 0o644
            tar.addfile(info, io.BytesIO(content))
    return raw.getvalue()


def build_bundle(root: Path) -> Bundle:
    """A deterministic tar.gz of `bundle_files(root)`: sorted entries, regular files only (no directory entries),
    mtime 0, uid/gid 0, empty uname/gname, mode 0o755 if owner-executable else 0o644; gzip header with mtime 0
    and no file name. (Same bytes for the same inputs with the same zlib; a different zlib build could compress
    differently, which only costs one extra upload.)"""
    root = Path(root)
    files = bundle_files(root)
    tar = _tar_bytes(root, files)
    gz = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=gz, compresslevel=9, mtime=0) as f:
        f.write(tar)
    data = gz.getvalue()
    return Bundle(data=data, sha256=hashlib.sha256(data).hexdigest(), files=files)
