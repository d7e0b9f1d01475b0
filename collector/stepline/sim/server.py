"""Real-time mode: a background thread advances the simulation with the clock; HTTP serves it."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stepline.clock import Clock, SystemClock
from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation, StepCallback
from stepline.sim.metrics import CONTENT_TYPE
from stepline.sim.workloads import Workload


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True


class _HttpServer6(_HttpServer):
    address_family = socket.AF_INET6


class SimServer:
    """A running simulated vLLM server: `/metrics`, `/health`, `/v1/models`."""

    def __init__(self, simulation: Simulation, host: str, port: int, speed: float, clock: Clock, tick_s: float) -> None:
        self.simulation = simulation
        self._lock = threading.Lock()
        self._clock = clock
        self._speed = speed
        self._tick_s = tick_s
        self._started = clock.monotonic()
        self._stopping = threading.Event()
        server_class = _HttpServer6 if ":" in host else _HttpServer
        self._httpd = server_class((host, port), _handler_for(self))
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._http_thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="stepline-sim-http", daemon=True
        )
        self._tick_thread = threading.Thread(target=self._tick, name="stepline-sim-engine", daemon=True)
        self._http_thread.start()
        self._tick_thread.start()

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8000."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def metrics(self) -> bytes:
        """The exposition as of now."""
        with self._lock:
            self.simulation.advance_to(self._sim_now())
            return self.simulation.render_metrics()

    def stop(self) -> None:
        """Stop serving and the engine thread; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._http_thread.join()
        self._tick_thread.join()

    def _sim_now(self) -> float:
        return (self._clock.monotonic() - self._started) * self._speed

    def _tick(self) -> None:
        # Without scrapes the engine still moves, so on_step callbacks arrive in real time.
        while not self._stopping.wait(self._tick_s):
            with self._lock:
                self.simulation.advance_to(self._sim_now())


def _handler_for(server: SimServer) -> type[BaseHTTPRequestHandler]:
    model = server.simulation.config.model
    models = {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": int(server.simulation.start_ts),
                "owned_by": "vllm",
                "root": model,
                "parent": None,
            }
        ],
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE, server.metrics())
            elif path == "/health":
                self._reply(200, "text/plain; charset=utf-8", b"")
            elif path == "/v1/models":
                self._reply(200, "application/json", json.dumps(models).encode())
            else:
                self._reply(404, "application/json", b'{"detail":"Not Found"}')

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a scrape every few seconds would flood stderr

    return Handler


def serve(
    workload: Workload,
    config: EngineConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    speed: float = 1.0,
    repeat: bool = True,
    clock: Clock | None = None,
    tick_s: float = 0.05,
    on_step: StepCallback | None = None,
) -> SimServer:
    """Start serving a simulated engine; port 0 picks a free one. Call `.stop()` when done."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    clock = clock or SystemClock()
    simulation = Simulation(workload, config, clock, repeat=repeat, on_step=on_step)
    return SimServer(simulation, host, port, speed, clock, tick_s)
