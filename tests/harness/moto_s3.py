"""moto's S3 server as the tests run it, holding S3's own promise that a conditional write is atomic.

moto checks `If-Match` / `If-None-Match` and then writes, with no lock between the two, on a threaded server:
two writers at the same version can both win, which real S3 never allows (a store's `update` then loses a
count, 19 of 20, about once in a few hundred runs). Every PUT of an object is made one at a time here, so the
fake keeps the guarantee the code under test relies on; nothing else of moto's S3 changes.

The server serves S3 alone: moto's dispatcher otherwise works out each request's service anew (a scan of its
package's directories, under one lock for every request) and logs every request. Without the two, a PutObject or
HeadObject costs 2.6 ms of CPU instead of 3.6 (boto3's side included; 400 of each, one process).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()


def atomic_conditional_writes() -> None:
    """Patch moto's PutObject handler (once per process) to run under one lock."""
    from moto.s3.responses import S3Response

    put = S3Response.put_object
    if getattr(put, "hsx_atomic", False):
        return

    def put_object(self):
        with _lock:
            return put(self)

    put_object.hsx_atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


def start_server(ip_address: str = "127.0.0.1", port: int = 0):
    """A started ThreadedMotoServer of S3 on `ip_address`:`port` (0: a free one), conditional writes atomic."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    class S3Only(DomainDispatcherApplication):
        def get_application(self, environ):
            with self.lock:
                if "s3" not in self.app_instances:
                    self.app_instances["s3"] = self.create_app("s3")
                return self.app_instances["s3"]

    class Quiet(MotoRequestHandler):
        def log_request(self, code="-", size="-"):
            pass  # errors are still logged (log_error)

    class S3Server(ThreadedMotoServer):
        def _server_entry(self) -> None:
            self._server = make_server(self._ip_address, self._port, S3Only(create_backend_app), True,
                                       request_handler=Quiet)
            self._server_ready_event.set()
            self._server.serve_forever()

    atomic_conditional_writes()
    server = S3Server(ip_address=ip_address, port=port, verbose=False)
    server.start()
    return server
