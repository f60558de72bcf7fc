"""Send journaled batch files to S3 and prove each landed intact before the local copy is freed.

`upload_verified` is the unit the host-side uploader runs per file:
1. read the local file once, computing its sha256 and the per-part sha256s of the multipart layout;
   a file whose sha256 differs from the journal's (written when the file was made) is corrupt on disk
   and is never uploaded (`CorruptFile`);
2. upload with boto3's transfer manager (multipart over `part_size`, parallel parts, SHA256 checksum per
   part, the journal's sha256 as object metadata); a failed multipart upload is aborted by the manager;
3. HEAD the object with checksums on and compare size and the full (or composite, for multipart) SHA256
   with what the local bytes give; only then delete the local file.
Transient S3 errors (5xx, throttling, timeouts, resets) are retried by botocore's standard mode with
backoff up to `attempts`; after that the error is raised with the S3 code and the key.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path


class CorruptFile(Exception):
    """The local file does not match its journal entry: uploading it would ship bad data."""


class UploadMismatch(Exception):
    """S3 holds something other than what was sent (size or checksum differ)."""


@dataclass(frozen=True)
class Uploaded:
    key: str
    bytes: int
    sha256: str
    parts: int
    checksum: str   # what S3 reported (base64, '-N' suffix for multipart)


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise ValueError(f"{uri!r}: expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


def s3_client(endpoint_url: str | None = None, attempts: int = 8, **kwargs):
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                    request_checksum_calculation="when_supported", response_checksum_validation="when_supported")
    return boto3.client("s3", endpoint_url=endpoint_url, config=config, **kwargs)


def local_digests(path: Path, part_size: int) -> tuple[str, list[bytes], int]:
    """(hex sha256 of the file, raw sha256 of each `part_size` part, size), reading the file once."""
    whole, parts, size = hashlib.sha256(), [], 0
    with path.open("rb") as handle:
        while chunk := handle.read(part_size):
            whole.update(chunk)
            parts.append(hashlib.sha256(chunk).digest())
            size += len(chunk)
    return whole.hexdigest(), parts, size


def expected_checksum(full_hex: str, parts: list[bytes], multipart: bool) -> str:
    if not multipart:
        return base64.b64encode(bytes.fromhex(full_hex)).decode()
    composite = hashlib.sha256(b"".join(parts)).digest()
    return f"{base64.b64encode(composite).decode()}-{len(parts)}"


def same_checksum(stored: str, want: str) -> bool:
    """S3 reports a multipart SHA256 as `<composite>-<parts>`; some compatible stores drop the suffix."""
    if not stored:
        return True  # a store that keeps no checksum: size and the metadata sha256 still had to match
    value, _, count = stored.partition("-")
    want_value, _, want_count = want.partition("-")
    return value == want_value and (not count or count == want_count)


def upload_verified(client, path: Path, bucket: str, key: str, journal_sha256: str, journal_bytes: int,
                    part_size: int = 64 << 20, concurrency: int = 8, delete: bool = True) -> Uploaded:
    from boto3.s3.transfer import TransferConfig

    full, parts, size = local_digests(path, part_size)
    if full != journal_sha256 or size != journal_bytes:
        raise CorruptFile(f"{path}: on disk sha256 {full} / {size} bytes, but the journal wrote {journal_sha256} / "
                          f"{journal_bytes}: not uploaded")
    multipart = size >= part_size
    config = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                            max_concurrency=concurrency, use_threads=concurrency > 1)
    client.upload_file(str(path), bucket, key, Config=config,
                       ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": full}})
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    stored = head.get("ChecksumSHA256", "")
    want = expected_checksum(full, parts, multipart)
    if head["ContentLength"] != size or head.get("Metadata", {}).get("sha256") != full or not same_checksum(stored, want):
        raise UploadMismatch(f"s3://{bucket}/{key}: stored {head['ContentLength']} bytes, checksum {stored or '-'}, "
                             f"metadata sha256 {head.get('Metadata', {}).get('sha256')}; sent {size} bytes, "
                             f"checksum {want}, sha256 {full}")
    if delete:
        path.unlink()
    return Uploaded(key, size, full, max(1, len(parts)) if multipart else 1, stored)
