"""moto's S3 server, with ranged GETs that read only their range (for benchmarks that move gigabytes).

    python tests/harness/s3range.py PORT

moto answers a ranged GET by reading the whole object out of its buffer and then slicing it: a 64 MiB part of
a 1 GiB object costs a 1 GiB copy, so on a benchmark the endpoint, not the code measured, is the ceiling. Here,
while a GET with a `Range` header is answered, the object's value is a view that reads only the slice asked
for, under the object's lock. Everything else is moto's, unchanged (objects held in memory: set
MOTO_S3_DEFAULT_KEY_BUFFER_SIZE above the largest object).
"""

from __future__ import annotations

import sys
import threading

_ranged = threading.local()


class _Window:
    """A stored object's bytes as far as a ranged GET's answer needs them: its length, and slices read on demand."""

    def __init__(self, key):
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __bool__(self) -> bool:
        return self.key.size > 0

    def __getitem__(self, item):
        start, stop, _ = item.indices(self.key.size)
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))


def patch() -> None:
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    plain = FakeKey.value

    def value(self):
        return _Window(self) if getattr(_ranged, "on", False) else plain.fget(self)

    FakeKey.value = property(value, plain.fset)
    key_response = S3Response.key_response

    def ranged_key_response(self, request, full_url, headers):
        _ranged.on = request.method == "GET" and bool(request.headers.get("range"))
        try:
            return key_response(self, request, full_url, headers)
        finally:
            _ranged.on = False

    S3Response.key_response = ranged_key_response


if __name__ == "__main__":
    from moto.server import ThreadedMotoServer

    patch()
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=int(sys.argv[1]), verbose=False)
    server.start()
    threading.Event().wait()
