"""The OpenAI server as `tierserve api-server` runs it (guarded connections), in a thread on a
free loopback port, for tests that drive it with real HTTP clients."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from tierserve.deploy.openai import ServerConfig, build_app
from tierserve.deploy.openai.connections import uvicorn_config

MODEL = "tiny"  # the served model name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving build_app(engine) until stop() (or the end of a with block)."""

    def __init__(self, engine, **config) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.config = ServerConfig(served_model_name=MODEL, **config)
        self.app = build_app(engine, self.config)
        self.server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", self.port,
                                                    self.config.connections,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_idle(engine, timeout: float = 20.0) -> dict:
    """The engine's stats once nothing runs or waits; every block back in the pool."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats["num_running"] == stats["num_waiting"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]):
            return stats
        assert time.monotonic() < deadline, f"requests still hold blocks: {stats}"
        time.sleep(0.05)
