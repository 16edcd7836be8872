"""Chapter 16 — the few things a fleet needs that Ray (2.x) offers no public API for, each named as private here,
so an upgrade of Ray breaks one file, and a reader sees at once what the rest of nanoserve/cluster/ leans on.

    internal_kv        Ray's own key-value store (in the GCS): where each replica announces its /metrics URL.
                       The public alternatives are an actor to hold the table (a process more to run and stop)
                       or a file (not shared by the nodes of a cluster).
    handle_cache       Ray Serve keeps one DeploymentHandle (and its router) per deployment in a process-wide
                       cache that `serve.delete` does not evict; a fleet deployed again under the same names
                       must not route with the old handle.
    request_router     the RequestRouter object a handle routes with (the prefix router's decisions, for the
                       tests and the notebook): Ray Serve has no accessor for it.
"""


def kv_put(key: str, value: str, namespace: bytes) -> None:
    from ray.experimental.internal_kv import _internal_kv_put  # private: Ray's GCS key-value store

    _internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_delete_prefix(prefix: bytes, namespace: bytes) -> None:
    from ray.experimental.internal_kv import _internal_kv_del  # private

    _internal_kv_del(prefix, del_by_prefix=True, namespace=namespace)


def kv_items(prefix: bytes, namespace: bytes) -> dict[bytes, bytes]:
    """Every key under `prefix`, with its value (a key deleted meanwhile is left out)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list  # private

    items = {key: _internal_kv_get(key, namespace=namespace) for key in _internal_kv_list(prefix, namespace=namespace)}
    return {key: value for key, value in items.items() if value is not None}


def forget_cached_handles(app_name: str) -> None:
    """Shut down and drop this process's cached DeploymentHandles of `app_name` (private: the Serve controller
    client's `handle_cache`, keyed by (deployment, application))."""
    from ray.serve.context import _get_global_client  # private

    client = _get_global_client(raise_if_no_controller_running=False)
    for key in [k for k in getattr(client, "handle_cache", {}) if k[1] == app_name]:
        client.handle_cache.pop(key).shutdown()


def request_router(handle):
    """The RequestRouter a DeploymentHandle routes with, or None before its first request (private attributes:
    handle -> router -> asyncio router -> request router)."""
    router = getattr(handle._router, "_asyncio_router", None)
    return getattr(router, "_request_router", None)
