"""A socket server run on a daemon thread: every listener of the collector starts and stops the same way."""

from __future__ import annotations

import socketserver
import threading


class ServerThread:
    """Serves `server` from a background thread until stop(), which also releases its port."""

    def __init__(self, server: socketserver.BaseServer, name: str) -> None:
        self.server = server
        # A short poll interval keeps stop() prompt.
        self._thread = threading.Thread(target=server.serve_forever, args=(0.2,), name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()
