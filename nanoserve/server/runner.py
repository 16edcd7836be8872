"""Chapter 08 — running the server: uvicorn around the app, with a graceful shutdown.

    state = server_state(llm.engine, llm.tokenizer, ServerConfig(), stat_logger)   # an AsyncLLMEngine around it
    Server(state, "127.0.0.1", 8000, shutdown_timeout=10).run()   # the CLI: until SIGTERM / Ctrl-C

    with serving(llm.engine, llm.tokenizer) as (url, server):      # tests, notebooks, benchmarks:
        ...                                                         # a thread, a free loopback port

Shutdown, in order: the app starts answering 503 + Retry-After (`draining`) — to every new request,
on new connections too, since the socket keeps listening while the running requests finish (a client
or load balancer told 503 retries elsewhere; a refused connection says less) — for up to
`shutdown_timeout` seconds; then uvicorn stops listening, cancels what is left (each cancelled
request is aborted, its blocks freed), and last the engine thread stops (every loaded version's: chapter 15)
and the server lets its engines go, so that a process serving one model after another frees each one.

SIGHUP (chapter 15, a server started with a loader in the main thread): reload — the same model file in the
same weights format, as a blue-green update (nanoserve/server/versions.py); one line on stderr says how it went.
"""

import asyncio
import signal
import sys
import threading
import time

import contextlib

import uvicorn

from nanoserve.server.api_server import ServerConfig, ServerState, build_app
from nanoserve.server.metrics import PrometheusStatLogger
from nanoserve.student import StudentCode


class Server(uvicorn.Server):
    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 10.0,
                 log_level: str = "warning", on_ready=None):
        config = uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=shutdown_timeout)
        super().__init__(config)
        self.state = state
        self.on_ready = on_ready  # called once the socket accepts connections
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the one the OS picked when asked for port 0)."""
        return self.servers[0].sockets[0].getsockname()[1]

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.state.versions.loader is not None and threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        if self.started and self.on_ready is not None:
            self.on_ready()

    async def reload(self, **kw) -> None:
        """SIGHUP's blue-green update, its outcome in one line on stderr (an APIError: the old version serves on)."""
        from nanoserve.server.protocol import APIError

        if self.state.draining:
            print("nanoserve: reload ignored: the server is shutting down", file=sys.stderr, flush=True)
            return
        try:
            done = await self.state.versions.reload(**kw)
            print(f"nanoserve: reloaded, serving {done['version']} (load {done['load_s']:.1f} s, warm-up "
                  f"{done['warmup_s']:.1f} s); {done['previous']} retires once its requests finish", file=sys.stderr, flush=True)
        except APIError as e:
            print(f"nanoserve: reload failed: {e.message}", file=sys.stderr, flush=True)

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True  # from now on every new request gets 503
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_graceful_shutdown
        while self.state.versions.num_unfinished_requests() and loop.time() < deadline:  # still listening
            await asyncio.sleep(0.02)
        self.config.timeout_graceful_shutdown = max(0.0, deadline - loop.time())  # what is left of it
        await super().shutdown(sockets)

    def run(self, sockets=None) -> None:
        """Serve until SIGTERM or Ctrl-C (or `should_exit`); then drain, stop the engine, return."""
        self.state.engine.start()
        if threading.current_thread() is threading.main_thread():
            # uvicorn re-raises the signal it caught once it is done; with these no-op handlers
            # in place that ends nothing, and the process exits 0 after a clean drain.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
        try:
            super().run(sockets)
        finally:
            self.state.close()

    def start_in_thread(self, timeout: float = 30.0) -> int:
        """Serve from a background thread; returns the port once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="nanoserve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (is the port free?)")
            time.sleep(0.01)
        return self.port

    def stop(self, timeout: float = 60.0) -> None:
        """A graceful shutdown of a server started with start_in_thread (as SIGTERM would)."""
        self.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


def server_state(engine, tokenizer, config: ServerConfig, stat_logger=None, loader=None) -> ServerState:
    """The routes' state over an AsyncLLMEngine around `engine` — with config.student selecting chapter 08, the
    learner's AsyncLLMEngine (exercise 8.3, once finished) and server modules, from one StudentCode. loader: how
    POST /admin/reload builds the next version (chapter 15), or None."""
    student = StudentCode(config.student)
    async_engine = student.module("nanoserve.engine.async_engine").AsyncLLMEngine(engine, stat_logger)
    return ServerState(async_engine, tokenizer, config, stat_logger, student, loader)


@contextlib.contextmanager
def serving(engine, tokenizer, shutdown_timeout: float = 10.0, loader=None, **config):
    """Serve an LLMEngine from a thread on a free loopback port: yields (base URL, Server), then shuts
    down gracefully. `config`: ServerConfig's fields (api_key=..., max_waiting_requests=...); loader: how
    POST /admin/reload builds the next version (chapter 15, with admin_key=...)."""
    config = ServerConfig(**config)
    stat_logger = PrometheusStatLogger(config.model_name, config.metrics_compat)
    state = server_state(engine, tokenizer, config, stat_logger, loader)
    del engine  # the server's versions hold the only reference: a reload (chapter 15) can free it
    server = Server(state, "127.0.0.1", 0, shutdown_timeout=shutdown_timeout)
    port = server.start_in_thread()
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.stop()
