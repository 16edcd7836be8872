"""Chapter 17 — a KV-aware router's index: which replica holds which block, learned from the replicas' own
KV events (chapter 16's publisher, vLLM's wire format), as llm-d's KV-cache indexer learns it from vLLM's.

Chapter 16's prefix router *guesses*: it remembers where it sent each block hash, and never hears that a
replica evicted it. This index *knows* (up to the events still in flight): each replica publishes

    ["BlockStored", [h], parent, token_ids, block_size, lora_id, medium, lora_name]  -> index[h] += {replica}
    ["BlockRemoved", [h], medium]                                                   -> index[h] -= {replica}
    ["AllBlocksCleared"]                                                            -> the replica holds nothing

(A LoRA adapter's blocks hash apart from the base model's — chapter 19's salt at the root of the chain — so the
index never mixes them up. No router of the course looks them up: a fleet serves the base model only, and the
routers hash a prompt unsalted, as the base model's chain; chapter 19, section 5, says what one would need.)

and a request's score on a replica is the longest run of its leading block hashes that replica holds (a
prefix-cache hit needs the whole chain from the first block: chapter 05), combined with the replica's load:

    hashes [h0, h1, h2]   index {h0: {a, b}, h1: {a, b}, h2: {a}}   ->   matches {a: 3, b: 2}
    score(r) = matches[r] - load_cost · queue_len[r]     load_cost 2, queues {a: 3, b: 0}:  a: 3 - 6 = -3,
                                                         b: 2 - 0 = 2   ->  b (one block fewer, three requests sooner)

    index = KVIndex(); subscriber = KVEventSubscriber(index, {"r0": "tcp://127.0.0.1:5557", ...})
    subscriber.poll()                         # apply whatever arrived (non-blocking)
    choose_replica(index.longest_prefix(hashes, replicas), queue_lens, load_cost=2)
"""

import msgpack
import zmq


class KVIndex:
    """block hash -> the replicas holding it (exercise 17.2)."""

    def __init__(self):
        self.holders: dict[int, set[str]] = {}  # chain hash -> replica names
        self.num_events = 0

    def apply(self, replica: str, event: list) -> None:
        """One decoded event (its wire array, hashes already ints) from `replica`."""
        self.num_events += 1
        kind = event[0]
        if kind == "BlockStored":
            for h in event[1]:
                self.holders.setdefault(h, set()).add(replica)
        elif kind in ("BlockRemoved", "AllBlocksCleared"):
            gone = event[1] if kind == "BlockRemoved" else [h for h, held in self.holders.items() if replica in held]
            for h in gone:
                held = self.holders.get(h)
                if held is not None:
                    held.discard(replica)
                    if not held:  # nobody holds it: it leaves the index
                        del self.holders[h]
        else:
            raise ValueError(f"unknown KV event {kind!r}")

    def longest_prefix(self, block_hashes: list[int], replicas) -> dict[str, int]:
        """{replica: how many of the leading block_hashes it holds, without a gap} for each of `replicas`.

        >>> index = KVIndex(); index.apply("a", ["BlockStored", [1, 2], None, [], 16, None, "GPU", None])
        >>> index.longest_prefix([1, 2, 3], ["a", "b"])
        {'a': 2, 'b': 0}
        """
        matches = {}
        for r in replicas:
            n = 0
            while n < len(block_hashes) and r in self.holders.get(block_hashes[n], ()):
                n += 1
            matches[r] = n
        return matches


def choose_replica(matches: dict[str, int], queue_lens: dict[str, int], load_cost: float) -> str:
    """The replica of the highest score matches[r] - load_cost · queue_lens[r] (exercise 17.3); on a tie the
    shorter queue, then the first name in sorted order.

    >>> choose_replica({"a": 3, "b": 2}, {"a": 3, "b": 0}, load_cost=2)
    'b'
    >>> choose_replica({"a": 3, "b": 2}, {"a": 0, "b": 0}, load_cost=2)
    'a'
    """
    return min(sorted(queue_lens), key=lambda r: (-(matches.get(r, 0) - load_cost * queue_lens[r]), queue_lens[r]))


def decode_event(event: list) -> list:
    """A wire event with its 32-byte little-endian hashes as ints (chapter 16's hash_bytes, undone)."""
    as_int = lambda b: None if b is None else int.from_bytes(b, "little")  # noqa: E731
    if event[0] == "BlockStored":
        return [event[0], [as_int(h) for h in event[1]], as_int(event[2]), *event[3:]]
    if event[0] == "BlockRemoved":
        return [event[0], [as_int(h) for h in event[1]], *event[2:]]
    return list(event)


class KVEventSubscriber:
    """One SUB socket connected to every replica's publisher; the topic says whose event it is (the
    publisher's topic is the replica's name). Gaps in a replica's sequence numbers are counted: a missed
    batch leaves the index wrong until the replica's next AllBlocksCleared."""

    def __init__(self, index: KVIndex, endpoints: dict[str, str]):
        self.index = index
        self.context = zmq.Context.instance()  # shared, never terminated: a context of its own, garbage-collected
        # while one of its sockets is still open, would block this process for ever in its term()
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
