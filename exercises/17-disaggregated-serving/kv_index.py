"""Exercise 17 — the KV-aware router's index and score (mirrors nanoserve/disagg/kv_index.py).

Each replica publishes its prefix cache's events (chapter 16's publisher, vLLM's wire format); the router keeps
an index from block hash to the replicas holding it, and scores each replica by the longest run of a request's
leading block hashes it holds, minus a cost per request in its queue.

    17.2  KVIndex.apply(replica, event), KVIndex.longest_prefix(block_hashes, replicas)   the index
    17.3  choose_replica(matches, queue_lens, load_cost)                                    the score
"""

import msgpack
import zmq


class KVIndex:
    """block hash -> the replicas holding it."""

    def __init__(self):
        self.holders: dict[int, set[str]] = {}  # chain hash -> replica names; a hash nobody holds is not a key
        self.num_events = 0

    def apply(self, replica: str, event: list) -> None:
        """Exercise 17.2. Apply one decoded event from `replica` (its wire array, hashes already ints):

            ["BlockStored", [h, ...], parent, token_ids, block_size, lora_id, medium]   replica holds each h
            ["BlockRemoved", [h, ...], medium]                                          replica no longer holds h
            ["AllBlocksCleared"]                                                        replica holds nothing

        Count it in num_events. A hash no replica holds any more leaves `holders`; removing a hash the replica
        does not hold changes nothing; any other kind raises ValueError("unknown KV event ...").

        >>> index = KVIndex(); index.apply("a", ["BlockStored", [1, 2], None, [], 16, None, "GPU"])
        >>> index.holders
        {1: {'a'}, 2: {'a'}}
        """
        raise NotImplementedError("Exercise 17.2: KVIndex.apply")

    def longest_prefix(self, block_hashes: list[int], replicas) -> dict[str, int]:
        """Exercise 17.2. {replica: how many of the leading block_hashes it holds, without a gap}, for each name
        in `replicas` (0 for a replica holding none, or not holding the first).

        >>> index = KVIndex(); index.apply("a", ["BlockStored", [1, 2], None, [], 16, None, "GPU"])
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

def decode_event(event: list) -> list:
    """Given. A wire event with its 32-byte little-endian hashes as ints (chapter 16's hash_bytes, undone)."""
    as_int = lambda b: None if b is None else int.from_bytes(b, "little")  # noqa: E731
    if event[0] == "BlockStored":
        return [event[0], [as_int(h) for h in event[1]], as_int(event[2]), *event[3:]]
    if event[0] == "BlockRemoved":
        return [event[0], [as_int(h) for h in event[1]], *event[2:]]
    return list(event)


class KVEventSubscriber:
    """Given. One SUB socket connected to every replica's publisher; the topic says whose event it is (the
    publisher's topic is the replica's name). Gaps in a replica's sequence numbers are counted: a missed
    batch leaves the index wrong until the replica's next AllBlocksCleared."""

    def __init__(self, index: KVIndex, endpoints: dict[str, str]):
        self.index = index
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        for name, endpoint in endpoints.items():
            self.socket.setsockopt(zmq.SUBSCRIBE, name.encode())
            self.socket.connect(endpoint)
        self.last_seq: dict[str, int] = {}
        self.num_gaps = 0

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that has arrived (waiting up to timeout_ms for the first); returns how many."""
        n = 0
        while self.socket.poll(timeout_ms if n == 0 else 0):
            topic, seq, payload = self.socket.recv_multipart()
            replica, seq = topic.decode(), int.from_bytes(seq, "big")
            if replica in self.last_seq and seq != self.last_seq[replica] + 1:
                self.num_gaps += 1
            self.last_seq[replica] = seq
            _, events = msgpack.unpackb(payload, raw=False)
            for event in events:
                self.index.apply(replica, decode_event(event))
            n += 1
        return n

    def close(self) -> None:
        self.socket.close()
        self.context.term()
