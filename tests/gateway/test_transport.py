"""The ZeroMQ transport's life: a transport the garbage collector reaps without ``close`` (a
gateway app built but never started, as the docs' reference builder makes one) ends its
sockets and context instead of blocking the collector."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CODE = """
import gc, os
from gateway.transport import ZmqTransport

class Holder:
    pass

h = Holder()
h.transport = ZmqTransport()
h.transport.connect("r0")
h.itself = h  # a cycle: only the collector can reap it
directory = h.transport.dir
del h
gc.collect()
print("collected", os.path.exists(directory))
"""


def test_a_transport_reaped_without_close_does_not_block_the_collector():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["collected", "False"], out.stderr[-2000:]
