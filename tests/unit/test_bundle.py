"""tasks.bundle: which files go to the hosts, and a tarball whose bytes depend on the file contents only."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tasks.bundle import Bundle, build_bundle, bundle_files

REPO = Path(__file__).resolve().parents[2]

IGNORE = """\
# comment
.venv/
**/__pycache__/
tests/
*.safetensors
*.jsonl
!keep.jsonl
/build
"""


def write(root: Path, rel: str, content: str | bytes = "x", mode: int | None = None) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    if mode is not None:
        os.chmod(p, mode)
    return p


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write(root, ".prefectignore", IGNORE)
    write(root, "pyproject.toml", "[project]\nname='x'\n")
    write(root, "src/pkg/__init__.py", "")
    write(root, "src/pkg/mod.py", "print('hi')\n")
    write(root, "src/pkg/__pycache__/mod.cpython-311.pyc", b"\x00pyc")
    write(root, "__pycache__/top.pyc", b"\x00pyc")
    write(root, "scripts/run.sh", "#!/bin/sh\necho run\n", mode=0o755)
    write(root, "tests/test_a.py", "def test(): pass\n")
    write(root, "src/tests/helper.py", "")  # "tests/" (no leading slash) matches at any depth, as in git
    write(root, "model.safetensors", b"\x01" * 64)
    write(root, "weights/deep/x.safetensors", b"\x02")
    write(root, ".venv/lib/site.py", "")
    write(root, "data.jsonl", "{}\n")
    write(root, "sub/keep.jsonl", "{}\n")  # re-included by "!keep.jsonl"
    write(root, "build", "a file named build at the root")  # "/build" is anchored
    write(root, "src/build", "not at the root: kept")
    write(root, ".git/HEAD", "ref: refs/heads/main\n")
    write(root, ".git/objects/ab/cdef", b"\x00")
    write(root, "vendored/.git", "gitdir: ../.git/modules/vendored\n")  # a submodule's .git *file*
    write(root, "vendored/lib.py", "")
    return root


EXPECTED = [
    ".prefectignore",
    "pyproject.toml",
    "scripts/run.sh",
    "src/build",
    "src/pkg/__init__.py",
    "src/pkg/mod.py",
    "sub/keep.jsonl",
    "vendored/lib.py",
]


def test_bundle_files_respects_prefectignore(tree: Path):
    assert bundle_files(tree) == EXPECTED


def test_git_excluded_without_any_pattern(tmp_path: Path):
    write(tmp_path, ".git/config", "[core]\n")
    write(tmp_path, "a/.git/HEAD", "x")
    write(tmp_path, "a.py", "")
    assert bundle_files(tmp_path) == ["a.py"]  # no .prefectignore at all: everything but .git


def test_negation_and_excluded_directory(tmp_path: Path):
    write(tmp_path, ".prefectignore", "*.log\n!important.log\nout/\n!out/keep.txt\n")
    for rel in ("a.log", "important.log", "x/important.log", "out/keep.txt", "out/b.txt", "c.txt"):
        write(tmp_path, rel)
    # As in git: a file inside an excluded directory cannot be re-included ("!out/keep.txt" has no effect).
    assert bundle_files(tmp_path) == [".prefectignore", "c.txt", "important.log", "x/important.log"]


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_same_selection_as_git(tree: Path, tmp_path: Path):
    """git itself, told to use .prefectignore as its exclude file, picks the same files (the oracle)."""
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    shutil.rmtree(tree / ".git")
    (tree / "vendored/.git").unlink()
    subprocess.run(["git", "init", "-q", str(tree)], check=True, env=env)
    out = subprocess.run(["git", "-C", str(tree), "ls-files", "--others", f"--exclude-from={tree / '.prefectignore'}"],
                         check=True, capture_output=True, text=True, env=env).stdout
    assert sorted(out.splitlines()) == bundle_files(tree)


def test_symlinks_skipped(tree: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    write(outside, "secret.txt", "do not ship")
    os.symlink(outside, tree / "linkdir")
    os.symlink(outside / "secret.txt", tree / "link.txt")
    os.symlink(tree / "pyproject.toml", tree / "inside_link.toml")
    assert bundle_files(tree) == EXPECTED


def extract(bundle: Bundle, dest: Path) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(bundle.data), mode="r:gz") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == bundle.files
        assert all(m.isfile() for m in members)
        tar.extractall(dest, filter="data")
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def test_tarball_extracts_to_exactly_files(tree: Path, tmp_path: Path):
    b = build_bundle(tree)
    assert b.files == EXPECTED
    got = extract(b, tmp_path / "out")
    assert sorted(got) == b.files
    for rel, content in got.items():
        assert content == (tree / rel).read_bytes(), rel


def test_headers_are_normalised(tree: Path):
    b = build_bundle(tree)
    assert b.data[:2] == b"\x1f\x8b"
    assert b.data[3] & 0x08 == 0  # no FNAME in the gzip header
    assert int.from_bytes(b.data[4:8], "little") == 0  # gzip mtime 0
    with tarfile.open(fileobj=io.BytesIO(b.data), mode="r:gz") as tar:
        for m in tar.getmembers():
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", ""), m.name
            assert m.mode == (0o755 if m.name == "scripts/run.sh" else 0o644), m.name


@pytest.mark.skipif(shutil.which("tar") is None, reason="no tar")
def test_system_tar_extracts_it(tree: Path, tmp_path: Path):
    """The hosts unpack with `tar -xzf` (tasks/commands.py): same files, contents and exec bits."""
    b = build_bundle(tree)
    (tmp_path / "b.tar.gz").write_bytes(b.data)
    (tmp_path / "out").mkdir()
    proc = subprocess.run(["tar", "-xzf", str(tmp_path / "b.tar.gz"), "-C", str(tmp_path / "out")],
                          capture_output=True, text=True, check=True)
    assert proc.stderr == ""
    got = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert got == b.files
    assert all((tmp_path / "out" / f).read_bytes() == (tree / f).read_bytes() for f in got)
    assert os.stat(tmp_path / "out/scripts/run.sh").st_mode & stat.S_IXUSR
    assert not os.stat(tmp_path / "out/pyproject.toml").st_mode & stat.S_IXUSR


def test_executable_keeps_exec_bit(tree: Path, tmp_path: Path):
    extract(build_bundle(tree), tmp_path / "out")
    assert os.stat(tmp_path / "out/scripts/run.sh").st_mode & stat.S_IXUSR
    assert not os.stat(tmp_path / "out/src/pkg/mod.py").st_mode & stat.S_IXUSR


def test_sha256_is_of_the_bytes(tree: Path):
    import hashlib

    b = build_bundle(tree)
    assert b.sha256 == hashlib.sha256(b.data).hexdigest()
    assert gzip.decompress(b.data)  # a valid gzip stream


def test_hash_stable_under_mtime_mode_and_location(tree: Path, tmp_path: Path):
    before = build_bundle(tree)
    for p in tree.rglob("*"):
        if p.is_file():
            os.utime(p, (1_234_567, 1_234_567))
    os.chmod(tree / "src/pkg/mod.py", 0o600)  # non-exec bits: irrelevant
    os.chmod(tree / "scripts/run.sh", 0o700)  # still owner-executable
    assert build_bundle(tree).sha256 == before.sha256
    # Copied elsewhere, under another umask, created in another order (reverse): same bytes.
    old = os.umask(0o077)
    try:
        copy = tmp_path / "elsewhere" / "copy"
        for rel in reversed(before.files):
            src = tree / rel
            dst = write(copy, rel, src.read_bytes())
            if os.stat(src).st_mode & stat.S_IXUSR:
                os.chmod(dst, 0o744)
    finally:
        os.umask(old)
    again = build_bundle(copy)
    assert again.data == before.data and again.sha256 == before.sha256


def test_hash_changes_with_content(tree: Path):
    base = build_bundle(tree).sha256
    p = tree / "src/pkg/mod.py"
    original = p.read_bytes()
    p.write_bytes(original[:-2] + bytes([original[-2] ^ 1]) + original[-1:])  # one byte flipped
    flipped = build_bundle(tree).sha256
    assert flipped != base
    p.write_bytes(original)
    assert build_bundle(tree).sha256 == base
    write(tree, "src/pkg/new.py", "")
    assert build_bundle(tree).sha256 not in (base, flipped)
    (tree / "src/pkg/new.py").unlink()
    os.chmod(tree / "src/pkg/mod.py", 0o755)  # gaining the exec bit is a change
    assert build_bundle(tree).sha256 != base


def test_ignored_changes_do_not_change_hash(tree: Path):
    base = build_bundle(tree).sha256
    write(tree, "tests/test_b.py", "new")
    write(tree, "other.safetensors", b"\x00")
    write(tree, ".git/index", b"\x00")
    assert build_bundle(tree).sha256 == base


def test_real_repository():
    b = build_bundle(REPO)
    assert "src/hsextract/cli.py" in b.files and "pyproject.toml" in b.files
    bad = [f for f in b.files if f.startswith(("tests/", ".venv/", ".git/")) or "__pycache__" in f
           or f.split("/")[0] in (".ruff_cache", ".mypy_cache", ".hypothesis")]
    assert not bad
    assert b.files == sorted(b.files) == bundle_files(REPO)
    # every module of the worker and the orchestrator goes: a pattern meant for the checkout's top (`/data/`)
    # must not drop a package directory of the same name (src/hsextract/data/)
    shipped = subprocess.run(["git", "ls-files", "src", "tasks", "flows", "deployments"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    assert shipped and not set(shipped) - set(b.files), sorted(set(shipped) - set(b.files))


def test_no_torch_import():
    code = ("import sys, tasks.bundle, tasks.transient; "
            "assert not {'torch', 'transformers', 'safetensors'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
