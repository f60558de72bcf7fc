"""A fault-injecting HTTP proxy in front of a real S3 endpoint (moto): 500s, throttling, dropped connections.

`FaultProxy(upstream).start()` listens on 127.0.0.1:<free port>; `rule(request) -> action` decides per request:
None passes it on, an int answers with that status and an S3 error body (403 AccessDenied, 500 InternalError, 503 SlowDown),
"drop" closes the connection without an answer. Every request is recorded in `seen` as (method, path+query).
`bandwidth` (bytes/s) makes request bodies cross one shared link at that rate, as an uplink would (the wait
is a sleep: no CPU is spent on it).
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
from urllib.parse import urlsplit

ERRORS = {403: "AccessDenied", 500: "InternalError", 503: "SlowDown"}


class FaultProxy:
    def __init__(self, upstream: str, rule=None, bandwidth: float | None = None):
        self.upstream = urlsplit(upstream)
        self.rule = rule or (lambda method, path: None)
        self.bandwidth = bandwidth
        self._link_free_at = 0.0  # when the shared link has sent every body queued so far
        self.seen: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.seen.append((self.command, self.path))
                    action = proxy.rule(self.command, self.path)
                    if proxy.bandwidth and length:
                        proxy._link_free_at = max(time.monotonic(), proxy._link_free_at) + length / proxy.bandwidth
                        sent_at = proxy._link_free_at
                if proxy.bandwidth and length:
                    time.sleep(max(0.0, sent_at - time.monotonic()))
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if isinstance(action, int):
                    text = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{ERRORS.get(action, 'Error')}"
                            f"</Code><Message>injected</Message></Error>").encode()
                    self.send_response(action)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FaultProxy":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
