"""A real uvicorn server on a free loopback port, in a thread, for the chapter 08 tests."""

import contextlib

from nanoserve.engine.async_engine import AsyncLLMEngine
from nanoserve.server.api_server import ServerConfig, ServerState
from nanoserve.server.metrics import PrometheusStatLogger
from nanoserve.server.runner import Server


@contextlib.contextmanager
def serving(engine, tokenizer, shutdown_timeout: float = 10.0, **config):
    """Yield (base URL, Server) for an LLMEngine; stop it (gracefully) afterwards."""
    config = ServerConfig(**config)
    stat_logger = PrometheusStatLogger(config.model_name)
    state = ServerState(AsyncLLMEngine(engine, stat_logger), tokenizer, config, stat_logger)
    server = Server(state, "127.0.0.1", 0, shutdown_timeout=shutdown_timeout)
    port = server.start_in_thread()
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.stop()
