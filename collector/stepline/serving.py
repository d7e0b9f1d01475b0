"""A socket server run on a daemon thread: every listener of the collector starts and stops the same way."""

from __future__ import annotations

import socketserver
import threading


class Address:
    """Where an HTTP listener is: `host`, and the port it asked for until it is bound (port 0: any free one)."""

    host: str
    _port: int
    _server: socketserver.TCPServer | None

    @property
    def port(self) -> int:
        """The bound port once started (useful with port 0), else the configured one."""
        return self._server.server_address[1] if self._server is not None else self._port

    @property
    def base_url(self) -> str:
        """http://host:port, an IPv6 host in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


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
