"""A staging fetch whose store does not answer is transient (`hsextract stage fetch` exits 1, the deploy task
retries), unlike a wrong input (exit 2). Against a real closed port and a real HTTP server that answers 503
to everything, with a real boto3 client."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hsextract.errors import Retry
from hsextract.data.inputcache import Cache
from hsextract.data.sources import Manifest, SourceFile, StageError
from hsextract.store import s3_client

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = Manifest("s3://stage-bucket/model", "dir", (SourceFile("config.json", 10, None, "0123abcd"),))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Busy(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"<Error><Code>ServiceUnavailable</Code><Message>down for now</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def busy_store():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def client(endpoint: str):
    return s3_client(endpoint, attempts=2, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing")


def test_a_store_that_refuses_connections_is_transient_and_nothing_is_placed(tmp_path):
    cache = Cache(tmp_path / "inputs")
    with pytest.raises(StageError) as failed:
        cache.fetch(client(f"http://127.0.0.1:{closed_port()}"), [MANIFEST], "h1")
    assert failed.value.retry is Retry.NOW, str(failed.value)
    said = str(failed.value)
    assert "h1: s3://stage-bucket/model: config.json: GET s3://stage-bucket/model/config.json bytes 0-9" in said
    assert "Could not connect" in said
    assert not cache.has(MANIFEST.files[0], MANIFEST.source)


def test_a_store_that_answers_503_is_transient(tmp_path, busy_store):
    with pytest.raises(StageError) as failed:
        Cache(tmp_path / "inputs").fetch(client(busy_store), [MANIFEST], "h1")
    assert failed.value.retry is Retry.NOW and "ServiceUnavailable" in str(failed.value), str(failed.value)


def test_the_cli_exits_1_for_a_store_that_does_not_answer_and_2_for_a_wrong_manifest(tmp_path, busy_store):
    manifest = tmp_path / "model.json"
    manifest.write_text(MANIFEST.to_json())
    keys = tmp_path / "keys"
    keys.write_text("[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")

    def fetch(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "hsextract", "stage", "fetch", "--cache", str(tmp_path / "inputs"), "--host", "h1",
             "--s3-endpoint", busy_store, *extra], capture_output=True, text=True, timeout=120,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), "AWS_MAX_ATTEMPTS": "1",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_SHARED_CREDENTIALS_FILE": str(keys), "HOME": str(tmp_path)})

    down = fetch("--manifest", str(manifest))
    assert down.returncode == 1 and "ServiceUnavailable" in down.stderr, down
    manifest.write_text('{"kind": "dir"}')
    wrong = fetch("--manifest", str(manifest))
    assert wrong.returncode == 2 and "not a manifest" in wrong.stderr, wrong
