"""S3 access for a run: prefect-aws blocks on the orchestrator -> a 0600 file on each host, never argv.

`load_access(name)` reads an `AwsCredentials` block (or the credentials of an `S3Bucket` block) by name.
What is not secret (endpoint URL, region) travels as worker arguments and environment; the keys travel
only as the body of `<control dir>/aws-credentials` (mode 0600, written atomically over SFTP or locally),
which the worker reads through `AWS_SHARED_CREDENTIALS_FILE` and which is removed when the shard ends.
No block name: nothing is sent and the worker uses the host's own AWS credential chain.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from .commands import quote
from .hosts import HostError


class CredentialsError(Exception):
    """The named block is missing or not usable as S3 credentials (the message never holds a secret)."""


@dataclass(frozen=True)
class S3Access:
    """How the orchestrator and the workers reach S3: endpoint and region, and the keys (never printed: repr=False)."""
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    profile: str | None = None

    @property
    def has_keys(self) -> bool:
        """Whether the block holds an access key pair (sent to the hosts as a 0600 file)."""
        return bool(self.access_key_id and self.secret_access_key)

    def credentials_file(self) -> bytes | None:
        """The shared-credentials file body for the hosts, or None when there are no keys to send."""
        if not self.has_keys:
            return None
        lines = ["[default]", f"aws_access_key_id = {self.access_key_id}",
                 f"aws_secret_access_key = {self.secret_access_key}"]
        if self.session_token:
            lines.append(f"aws_session_token = {self.session_token}")
        return ("\n".join(lines) + "\n").encode()

    def client_kwargs(self) -> dict:
        """boto3 client arguments for the orchestrator's own calls (reconcile, journal reads)."""
        kwargs: dict = {}
        if self.region:
            kwargs["region_name"] = self.region
        if self.has_keys:
            kwargs.update(aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
                          aws_session_token=self.session_token or None)
        return kwargs

    def client(self):
        """A boto3 S3 client for the orchestrator's own calls (planning, reconcile, the attempt record)."""
        from hsextract.store import s3_client

        if self.profile and not self.has_keys:
            import boto3

            session = boto3.Session(profile_name=self.profile, region_name=self.region)
            return s3_client(self.endpoint_url, session=session)
        return s3_client(self.endpoint_url, **self.client_kwargs())


def access_from_block(block) -> S3Access:
    """An S3Access from an AwsCredentials-like block (duck-typed: prefect-aws's field names)."""
    secret = getattr(block, "aws_secret_access_key", None)
    if secret is not None and hasattr(secret, "get_secret_value"):
        secret = secret.get_secret_value()
    params = getattr(block, "aws_client_parameters", None)
    return S3Access(endpoint_url=getattr(params, "endpoint_url", None) or None,
                    region=getattr(block, "region_name", None) or None,
                    access_key_id=getattr(block, "aws_access_key_id", None) or None,
                    secret_access_key=secret or None,
                    session_token=getattr(block, "aws_session_token", None) or None,
                    profile=getattr(block, "profile_name", None) or None)


def load_access(name: str | None) -> S3Access:
    """The S3 access a run uses: from the named block, or the default chain (None)."""
    if not name:
        return S3Access()
    from prefect_aws import AwsCredentials, S3Bucket

    errors = []
    for kind in (AwsCredentials, S3Bucket):
        try:
            block = kind.load(name)
        except Exception as exc:  # not found, or another block type under this name
            errors.append(f"{kind.__name__}: {type(exc).__name__}")
            continue
        creds = block.credentials if isinstance(block, S3Bucket) else block
        if not isinstance(creds, AwsCredentials):
            raise CredentialsError(f"aws_credentials={name!r}: block holds {type(creds).__name__}, "
                                   f"expected AwsCredentials")
        access = access_from_block(creds)
        if bool(access.access_key_id) != bool(access.secret_access_key):
            raise CredentialsError(f"aws_credentials={name!r}: has only one of aws_access_key_id / "
                                   f"aws_secret_access_key")
        return access
    raise CredentialsError(f"aws_credentials={name!r}: no AwsCredentials or S3Bucket block by that name "
                           f"({'; '.join(errors)})")


@contextlib.contextmanager
def access_on(host, access: S3Access, path: str, timeout: float):
    """The run's S3 access for one `hsextract` command on `host`, as a launch gives it (tasks/shards.py): yields
    (arguments, environment prefix). The keys, when the block has them, go as a 0600 file at `path`
    (`--aws-credentials-file`), removed after the command; the region as AWS_DEFAULT_REGION; the profile as
    AWS_PROFILE when there are no keys."""
    args, env, creds = [], "", None
    if (body := access.credentials_file()) is not None:
        host.put(body, path, timeout, mode=0o600)
        creds, args = path, ["--aws-credentials-file", path]
    if access.region:
        env += f"AWS_DEFAULT_REGION={quote(access.region)} "
    if creds is None and access.profile:
        env += f"AWS_PROFILE={quote(access.profile)} "
    try:
        yield args, env
    finally:
        if creds is not None:  # a link gone must not hide the error being raised (the command removes it too)
            with contextlib.suppress(HostError):
                host.run(f"rm -f {quote(creds)}", timeout)
