"""moto's S3 server as the tests run it, holding S3's own promise that a conditional write is atomic.

moto checks `If-Match` / `If-None-Match` and then writes, with no lock between the two, on a threaded server:
two writers at the same version can both win, which real S3 never allows (a store's `update` then loses a
count, 19 of 20, about once in a few hundred runs). Every PUT of an object is made one at a time here, so the
fake keeps the guarantee the code under test relies on; nothing else of moto changes.
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
    """A started ThreadedMotoServer on `ip_address`:`port` (0: a free one), conditional writes atomic."""
    from moto.server import ThreadedMotoServer

    atomic_conditional_writes()
    server = ThreadedMotoServer(ip_address=ip_address, port=port, verbose=False)
    server.start()
    return server
