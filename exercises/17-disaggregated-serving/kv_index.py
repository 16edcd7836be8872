"""Exercise 17 — the KV-aware router's index and score (mirrors nanoserve/disagg/kv_index.py).

Each replica publishes its prefix cache's events (chapter 16's publisher, vLLM's wire format); the router keeps
an index from block hash to the replicas holding it, and scores each replica by the longest run of a request's
leading block hashes it holds, minus a cost per request in its queue.

    17.2  KVIndex.apply(replica, event), KVIndex.longest_prefix(block_hashes, replicas)   the index
    17.3  choose_replica(matches, queue_lens, load_cost)                                    the score
"""

# given, not exercises: the wire decoding and the ZMQ subscriber that feeds your KVIndex (it calls index.apply for
# each event it receives)
from nanoserve.disagg.kv_index import KVEventSubscriber, decode_event  # noqa: F401


class KVIndex:
    """block hash -> the replicas holding it."""

    def __init__(self):
        self.holders: dict[int, set[str]] = {}  # chain hash -> replica names; a hash nobody holds is not a key
        self.num_events = 0

    def apply(self, replica: str, event: list) -> None:
        """Exercise 17.2. Apply one decoded event from `replica` (its wire array, hashes already ints):

            ["BlockStored", [h, ...], parent, token_ids, block_size, lora_id, medium, lora_name]   holds each h
            ["BlockRemoved", [h, ...], medium]                                         replica no longer holds h
            ["AllBlocksCleared"]                                                       replica holds nothing

        Count it in num_events. A hash no replica holds any more leaves `holders`; removing a hash the replica
        does not hold changes nothing; any other kind raises ValueError("unknown KV event ...").

        >>> index = KVIndex(); index.apply("a", ["BlockStored", [1, 2], None, [], 16, None, "GPU", None])
        >>> index.holders
        {1: {'a'}, 2: {'a'}}
        """
        raise NotImplementedError("Exercise 17.2: KVIndex.apply")

    def longest_prefix(self, block_hashes: list[int], replicas) -> dict[str, int]:
        """Exercise 17.2. {replica: how many of the leading block_hashes it holds, without a gap}, for each name
        in `replicas` (0 for a replica holding none, or not holding the first).

        >>> index = KVIndex(); index.apply("a", ["BlockStored", [1, 2], None, [], 16, None, "GPU", None])
        >>> index.longest_prefix([1, 2, 3], ["a", "b"])
        {'a': 2, 'b': 0}
        """
        raise NotImplementedError("Exercise 17.2: KVIndex.longest_prefix")


def choose_replica(matches: dict[str, int], queue_lens: dict[str, int], load_cost: float) -> str:
    """Exercise 17.3. The replica (a key of queue_lens) of the highest score matches.get(r, 0) - load_cost ·
    queue_lens[r]; on a tie the shorter queue, then the first name in sorted order.

    >>> choose_replica({"a": 3, "b": 2}, {"a": 3, "b": 0}, load_cost=2)
    'b'
    """
    raise NotImplementedError("Exercise 17.3: choose_replica")
