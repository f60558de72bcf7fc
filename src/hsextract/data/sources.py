"""Inputs that are not yet on a host: their manifests (what each file of a source is).

A source is a dataset or model where its user keeps it: `s3://bucket/key` (one object) or `s3://bucket/prefix/`
(every object under it), or a file or directory on the orchestrator. Its **manifest** lists each file: path
relative to the source, size, sha256 (and for S3 the ETag it was read at). It is written once, next to the
source (`<source>.hsextract-manifest.json`), and staging checks every byte against it.

The content-addressed cache they are staged into on a host is `hsextract.data.inputcache`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hsextract.errors import HsExtractError, Retry
from hsextract.store.local import sha256_file
from hsextract.store.s3 import error_code, split_uri

MANIFEST_SUFFIX = ".hsextract-manifest.json"
MANIFEST_VERSION = 1


class StageError(HsExtractError):
    """A source or a staged file is not what its manifest says, or cannot be read (names the file). `retry`:
    NOW when the store did not answer, NEVER (the default) when the source is wrong."""

    def __init__(self, message: str, retry: Retry = Retry.NEVER):
        super().__init__(message)
        self.retry = retry


@dataclass(frozen=True)
class SourceFile:
    """One file of a source: its path under the source, size, digest (None until known) and S3 ETag."""
    path: str
    size: int
    sha256: str | None = None
    etag: str | None = None


@dataclass(frozen=True)
class Manifest:
    """Every file of a source. `kind`: "file" (the source is one file, `files[0]`) or "dir"."""
    source: str
    kind: str
    files: tuple[SourceFile, ...]

    @property
    def complete(self) -> bool:
        """Every digest known."""
        return all(e.sha256 for e in self.files)

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files)

    @property
    def id(self) -> str:
        """The view's name: the same for the same bytes under the same names, wherever they come from."""
        body = json.dumps([self.kind, [(e.path, e.size, e.sha256) for e in self.files]], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:20]

    def to_json(self) -> str:
        return json.dumps({"version": MANIFEST_VERSION, "source": self.source, "kind": self.kind,
                           "files": [asdict(e) for e in self.files]}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> Manifest:
        try:
            obj = json.loads(text)
            files = tuple(SourceFile(str(f["path"]), int(f["size"]), f.get("sha256"), f.get("etag"))
                          for f in obj["files"])
            kind = obj["kind"]
        except (ValueError, KeyError, TypeError) as exc:
            raise StageError(f"{where}: not a manifest ({type(exc).__name__}: {exc})") from None
        if kind not in ("file", "dir") or (kind == "file" and len(files) != 1):
            raise StageError(f"{where}: kind {kind!r} with {len(files)} file(s)")
        for e in files:
            if e.path.startswith("/") or ".." in e.path.split("/") or not e.path:
                raise StageError(f"{where}: file path {e.path!r} leaves the source")
            if e.sha256 is not None and (len(e.sha256) != 64 or e.sha256.strip("0123456789abcdef")):
                raise StageError(f"{where}: {e.path}: {e.sha256!r} is not a sha256")
        return cls(str(obj.get("source", "")), kind, files)

    def with_digests(self, digests: dict[str, str]) -> Manifest:
        """This manifest with the digests of `digests` (path -> sha256) filled in."""
        return replace(self, files=tuple(replace(e, sha256=e.sha256 or digests.get(e.path)) for e in self.files))

    def target(self, view: Path) -> Path:
        """What a worker is given for this source staged into `view`: the file itself, or the directory."""
        return view / self.files[0].path if self.kind == "file" else view


def manifest_uri(source: str) -> str:
    """Where a source's manifest lives: next to it."""
    return source.rstrip("/") + MANIFEST_SUFFIX


# ---------------------------------------------------------------------------------------------- local sources


def local_manifest(path: Path, write: bool = True) -> Manifest:
    """The manifest of a file or directory on this machine. Kept next to it and reused while every file's size
    and mtime still match what it recorded; recomputed (and rewritten where the directory is writable) else."""
    path = Path(path)
    if not path.exists():
        raise StageError(f"{path}: no such file or directory")
    if path.is_file():
        kind, files = "file", [(path.name, path)]
    else:
        kind = "dir"
        files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*")
                       if p.is_file() and not p.name.endswith(MANIFEST_SUFFIX))
        if not files:
            raise StageError(f"{path}: an empty directory")
    stamp = {rel: [p.stat().st_size, p.stat().st_mtime_ns] for rel, p in files}
    kept = Path(str(path).rstrip("/") + MANIFEST_SUFFIX)
    try:
        old = json.loads(kept.read_text())
        if old.get("stamp") == stamp:
            return Manifest.from_json(kept.read_text(), str(kept))
    except (OSError, ValueError):
        pass
    manifest = Manifest(str(path), kind, tuple(SourceFile(rel, stamp[rel][0], sha256_file(p))
                                               for rel, p in files))
    if write:
        try:
            body = json.loads(manifest.to_json())
            body["stamp"] = stamp
            tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body, indent=1))
            os.replace(tmp, kept)
        except OSError:  # a read-only source: computed again next time
            pass
    return manifest


# ------------------------------------------------------------------------------------------------- S3 sources


def split_source(uri: str) -> tuple[str, str]:
    """(bucket, key or prefix) of an s3:// source; a trailing slash is kept (it says: a prefix)."""
    try:
        bucket, key = split_uri(uri)  # the store's parser: one reading of an S3 URI
    except ValueError as exc:
        raise StageError(f"{exc} (a source is s3://bucket/key or s3://bucket/prefix/)") from None
    return bucket, (key + "/" if key and uri.endswith("/") else key)


def list_s3(client, uri: str) -> Manifest:
    """The files of an S3 source as they are now (sizes and ETags, no digests): the object itself, else every
    object under the prefix (the manifests beside them left out)."""
    bucket, key = split_source(uri)
    if key and not key.endswith("/"):
        try:
            head = client.head_object(Bucket=bucket, Key=key)
            return Manifest(uri, "file", (SourceFile(key.rsplit("/", 1)[-1], head["ContentLength"], None,
                                                head.get("ETag", "").strip('"')),))
        except Exception as exc:
            if error_code(exc) not in ("404", "NoSuchKey", "NotFound"):
                raise StageError(f"{uri}: {type(exc).__name__}: {exc}") from None
    prefix = key.rstrip("/") + "/" if key else ""
    files = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                if rel and not rel.endswith("/") and not rel.endswith(MANIFEST_SUFFIX):
                    files.append(SourceFile(rel, obj["Size"], None, obj.get("ETag", "").strip('"')))
    except Exception as exc:
        raise StageError(f"{uri}: cannot list it: {type(exc).__name__}: {exc}") from None
    if not files:
        raise StageError(f"{uri}: no such object, and no object under {prefix or 'the bucket'}")
    return Manifest(uri, "dir", tuple(sorted(files, key=lambda e: e.path)))


def read_s3_manifest(client, uri: str) -> Manifest | None:
    """The manifest next to an S3 source, or None when there is none yet."""
    bucket, key = split_source(manifest_uri(uri))
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise StageError(f"{manifest_uri(uri)}: {type(exc).__name__}: {exc}") from None
    return Manifest.from_json(body.decode(errors="replace"), manifest_uri(uri))


def write_s3_manifest(client, manifest: Manifest) -> str:
    """Write `manifest` next to its source; returns its URI."""
    bucket, key = split_source(manifest_uri(manifest.source))
    client.put_object(Bucket=bucket, Key=key, Body=manifest.to_json().encode(), ContentType="application/json")
    return manifest_uri(manifest.source)


def s3_manifest(client, uri: str) -> Manifest:
    """The source's manifest checked against its listing now: the kept one (ETags refreshed) where it exists,
    else the listing with no digests (the first staging computes them). A file listed but not in the kept
    manifest, or one whose size changed, is a StageError naming it."""
    now = list_s3(client, uri)
    kept = read_s3_manifest(client, uri)
    if kept is None:
        return now
    listed = {e.path: e for e in now.files}
    for e in kept.files:
        got = listed.pop(e.path, None)
        if got is None:
            raise StageError(f"{uri}: {e.path} is in its manifest ({manifest_uri(uri)}) but not in S3: deleted? "
                             f"Put it back, or delete the manifest to stage what is there now")
        if got.size != e.size:
            raise StageError(f"{uri}: {e.path} is {got.size:,} bytes in S3, {e.size:,} in its manifest "
                             f"({manifest_uri(uri)}): the object changed; delete the manifest to stage it as it is now")
    if listed:
        raise StageError(f"{uri}: {sorted(listed)[0]} (and {len(listed) - 1} more) not in its manifest "
                         f"({manifest_uri(uri)}): delete the manifest to stage the source as it is now")
    return replace(kept, source=uri, kind=now.kind, files=tuple(
        replace(e, etag=next(g.etag for g in now.files if g.path == e.path)) for e in kept.files))
