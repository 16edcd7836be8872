"""A real uvicorn server on a loopback port, in a thread, for the chapter 12 tests (SSE and the browser)."""

from nanoserve.engine.async_engine import AsyncLLMEngine
from nanoserve.server.api_server import ServerConfig, ServerState
from nanoserve.server.runner import Server


def start_server(engine, tokenizer=None, port: int = 0, **config) -> Server:
    """Serve an LLMEngine (a fresh AsyncLLMEngine around it); `server.port` is the bound port, `server.stop()` ends it."""
    state = ServerState(AsyncLLMEngine(engine), tokenizer, ServerConfig(**config))
    server = Server(state, "127.0.0.1", port, shutdown_timeout=30)  # a loaded machine may take seconds to drain
    server.start_in_thread()
    return server
