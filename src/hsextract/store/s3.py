"""An S3 prefix as a store (any S3-compatible endpoint), the parsing of `s3://bucket/prefix`, and the client."""

from __future__ import annotations

import builtins
import os
import re

from hsextract.store.base import NoSuchBucket, Store, StoredObject

#: what would give S3 keys from the environment instead of a credentials file a worker is handed
KEY_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SECURITY_TOKEN")

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CHUNK = 8 << 20  # read_into's step


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of `s3://bucket/prefix`. Refuses what could put a key
    outside the prefix or be read two ways: `.` or `..` segments, empty segments, control characters."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise ValueError(f"{uri!r}: expected s3://bucket/prefix")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"{uri!r}: bucket {bucket!r} is not a valid S3 bucket name (3-63 of a-z 0-9 . -)")
    prefix = prefix.strip("/")
    bad = [segment for segment in prefix.split("/") if segment in ("", ".", "..")] if prefix else []
    if bad or _CONTROL.search(prefix):
        what = f"segment {bad[0]!r}" if bad else "a control character"
        raise ValueError(f"{uri!r}: the prefix holds {what}: object keys must stay under one plain prefix")
    return bucket, prefix


def s3_client(endpoint_url: str | None = None, attempts: int | None = None, **kwargs):
    """A boto3 S3 client: standard retries (5xx, throttling, resets) up to `attempts` (default: the
    environment's AWS_MAX_ATTEMPTS, else 8), bounded connect and read times, checksums computed and validated
    where the API supports them. `session=` picks a boto3 Session (a profile); other keyword arguments go to
    `client()` (keys, region)."""
    import boto3
    from botocore.config import Config

    if attempts is None:
        try:
            attempts = max(1, int(os.environ.get("AWS_MAX_ATTEMPTS") or 8))
        except ValueError:
            raise ValueError(f"AWS_MAX_ATTEMPTS={os.environ['AWS_MAX_ATTEMPTS']!r}: expected a whole number") from None

    config = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                    request_checksum_calculation="when_supported", response_checksum_validation="when_supported")
    session = kwargs.pop("session", None) or boto3
    return session.client("s3", endpoint_url=endpoint_url, config=config, **kwargs)


def error_code(exc: Exception) -> str:
    """The S3 error code of a botocore error ('NoSuchKey', '404', ...), '' for any other exception."""
    return getattr(exc, "response", {}).get("Error", {}).get("Code", "")


_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict")


class S3Store(Store):
    """`s3://bucket/prefix` on any S3-compatible endpoint. `create` is a PUT with If-None-Match: *, `replace` a PUT
    with If-Match on the ETag `read_tagged` returned; every PUT carries a SHA256 checksum the store verifies."""

    def __init__(self, uri: str, client=None):
        self.bucket, self.prefix = split_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.client = client or s3_client()

    def key(self, key: str) -> str:
        """The object key in the bucket of `key` (relative to the output root)."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, fn, key: str | None, **kwargs):
        """`fn(Bucket=..., Key=..., **kwargs)`, with the errors a caller acts on made plain: NoSuchBucket, and a
        missing key as FileNotFoundError."""
        from botocore.exceptions import ClientError

        try:
            return fn(Bucket=self.bucket, **({"Key": self.key(key)} if key is not None else {}), **kwargs)
        except ClientError as exc:
            code = error_code(exc)
            if code == "NoSuchBucket":
                raise NoSuchBucket(f"{self.uri}: the bucket {self.bucket!r} does not exist (NoSuchBucket from "
                                   f"{self.client.meta.endpoint_url}): create it, or fix the output") from None
            if code in ("NoSuchKey", "404") and key is not None:
                raise FileNotFoundError(f"{self.where(key)}: no such object") from None
            raise

    def list(self, checksums: bool = False) -> list[StoredObject]:
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self._call(lambda **kw: list(self.client.get_paginator("list_objects_v2").paginate(**kw)), None,
                           Prefix=base)
        found = [StoredObject(o["Key"][len(base):], o["Size"]) for page in pages for o in page.get("Contents", [])]
        if not checksums:
            return found

        def with_checksum(obj: StoredObject) -> StoredObject:
            if not obj.key.endswith(".safetensors"):
                return obj
            return StoredObject(obj.key, obj.size, self.checksum(obj.key))

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(32) as pool:
            return list(pool.map(with_checksum, found))

    def read_tagged(self, key: str) -> tuple[bytes, str]:
        got = self._call(self.client.get_object, key)
        return got["Body"].read(), got["ETag"]

    def read_into(self, key: str, buffer) -> int:
        """Streamed into `buffer` in chunks (no copy of the whole object on the way), the checksum S3 holds
        validated at the end as `read` validates it."""
        got = self._call(self.client.get_object, key)
        body, size, view = got["Body"], got["ContentLength"], memoryview(buffer).cast("B")
        if size > len(view):
            body.close()
            raise ValueError(f"{self.where(key)}: {size} bytes, expected at most {len(view)}")
        done, end = 0, bytearray(1)
        while done < size:
            step = body.readinto(view[done:min(size, done + _CHUNK)])
            if not step:
                raise OSError(f"{self.where(key)}: the download ended at byte {done} of {size}")
            done += step
        if body.readinto(end):  # reading to the end is what validates the checksum
            raise OSError(f"{self.where(key)}: longer than the {size} bytes its response announced")
        return done

    def write(self, key: str, data: bytes) -> None:
        self._call(self.client.put_object, key, Body=data, ChecksumAlgorithm="SHA256")

    def _put_if(self, key: str, data: bytes, **condition) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._call(self.client.put_object, key, Body=data, ChecksumAlgorithm="SHA256", **condition)
        except ClientError as exc:
            if error_code(exc) in _CONFLICT:
                return False
            raise
        return True

    def create(self, key: str, data: bytes) -> bool:
        return self._put_if(key, data, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, tag: str) -> bool:
        return self._put_if(key, data, IfMatch=tag)

    def delete(self, key: str) -> None:
        self._call(self.client.delete_object, key)

    def abort_uploads(self, under: str) -> builtins.list[str]:  # `list` here is the method above
        """Abort every unfinished multipart upload of a key beneath `under` (relative to the output root): the
        parts a killed or stopped uploader left behind, which the bucket would otherwise keep (and bill) until
        a lifecycle rule removes them. Returns the keys (relative) whose uploads were aborted."""
        base = self.key(under)
        pages = self._call(lambda **kw: list(self.client.get_paginator("list_multipart_uploads").paginate(**kw)),
                           None, Prefix=base)
        aborted = []
        for upload in (u for page in pages for u in page.get("Uploads", [])):
            self._call(self.client.abort_multipart_upload, None, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted.append(upload["Key"][len(f"{self.prefix}/") if self.prefix else 0:])
        return aborted

    def checksum(self, key: str) -> str | None:
        """The sha256 the uploader stored as metadata (S3 verified the bytes against it when they arrived)."""
        head = self._call(self.client.head_object, key)
        return head.get("Metadata", {}).get("sha256")
