"""The query endpoint's watch on its clients: a client that closes its connection while its query runs gets the query
killed, so no engine works for nobody."""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

_WATCH_S = 0.25  # how often a connection is looked at while its query runs


class Watchers:
    """One thread that looks at the connections whose queries run: a client that has closed its end gets its query
    killed. One for the endpoint, not one per query: registering costs a dict entry, not a thread's start."""

    def __init__(self) -> None:
        self._watched: dict[int, tuple[socket.socket, Callable[[], None]]] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepline-query-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def add(self, sock: socket.socket, kill: Callable[[], None]) -> int:
        with self._lock:
            self._next += 1
            self._watched[self._next] = (sock, kill)
            return self._next

    def remove(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)

    def _run(self) -> None:
        while not self._done.wait(_WATCH_S):
            with self._lock:
                watched = dict(self._watched)
            by_fd = {sock.fileno(): key for key, (sock, _) in watched.items() if sock.fileno() >= 0}
            try:
                readable, _, _ = select.select(list(by_fd), [], [], 0)
            except (OSError, ValueError):  # a socket closed between the copy and the look: next round
                continue
            for fd in readable:
                sock, kill = watched[by_fd[fd]]
                try:
                    if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        continue  # the client's next request: it is still there
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:  # reset: gone as well
                    pass
                with self._lock:
                    if self._watched.pop(by_fd[fd], None) is None:
                        continue  # its query ended meanwhile
                logger.warning("query endpoint: the client left before its result: killing its query")
                try:
                    kill()
                except Exception as ex:  # the query may have ended meanwhile; nothing then runs for nobody
                    logger.warning("query endpoint: could not kill a query whose client left: %s", ex)


class Watch:
    """A request's connection, watched (by the endpoint's Watchers) while its query runs."""

    def __init__(self, watchers: Watchers, sock: socket.socket) -> None:
        self._watchers, self._sock = watchers, sock
        self._key: int | None = None

    def on_gone(self, kill: Callable[[], None]) -> None:
        """Watch from now on, and call `kill` (once) if the client closes its end."""
        self._key = self._watchers.add(self._sock, kill)

    def stop(self) -> None:
        if self._key is not None:
            self._watchers.remove(self._key)
