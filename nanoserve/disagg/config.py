"""Chapter 17 — KVTransferConfig: how an engine takes part in disaggregated serving (vLLM's name and roles).

    KVTransferConfig(kv_role="kv_producer", kv_connector="SharedMemoryConnector",
                     kv_control_endpoint="tcp://127.0.0.1:5600")     # the prefill engine
    KVTransferConfig(kv_role="kv_consumer", kv_connector="SharedMemoryConnector")   # the decode engine

The producer computes prompts' KV and stages it; the consumer loads it into its own blocks and decodes.
The producer's control endpoint is where consumers say "loaded, free it" (ZMQ); the consumer learns it from
each request's kv_transfer_params, so it needs no endpoint of its own.
"""

from dataclasses import dataclass

KV_ROLES = ("kv_producer", "kv_consumer")
KV_CONNECTORS = ("SharedMemoryConnector",)
CLI_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}  # serve --kv-role's words


@dataclass
class KVTransferConfig:
    kv_role: str = "kv_producer"
    kv_connector: str = "SharedMemoryConnector"
    # producer: where its control socket binds ("tcp://127.0.0.1:*": a free port, see the connector's endpoint)
    kv_control_endpoint: str = "tcp://127.0.0.1:*"
    # producer: staged KV nobody asked for within this many seconds is freed (a proxy died between the two halves)
    kv_release_timeout_s: float = 60.0

    def __post_init__(self):
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"unknown kv_role {self.kv_role!r}; known: {', '.join(KV_ROLES)}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"unknown kv_connector {self.kv_connector!r}; known: {', '.join(KV_CONNECTORS)}")
        if not self.kv_release_timeout_s > 0:
            raise ValueError(f"kv_release_timeout_s must be > 0, got {self.kv_release_timeout_s}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"
