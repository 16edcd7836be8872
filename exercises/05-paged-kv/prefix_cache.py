"""Exercise 5.2 — the prefix hash chain and the prefix cache.

Your version of nanoserve/kv/prefix_cache.py: same names, same signatures. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=05`.

A full block's K/V depend on its tokens and on every token before it, so a block is named by a
hash chained over the whole prefix:  h0 = hash_block(None, t[0:16]),  h1 = hash_block(h0, t[16:32]), ...
"""

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Exercise 5.2. An int that names (parent_hash, token_ids).

    The same arguments give the same int in every process (Python's hash() of a str is salted per
    process); another parent, another token or another order gives another int; and a collision must be
    hard to make on purpose (else one user could make another's request read their K/V): a
    cryptographic hash from hashlib, fed with bytes that stand for None or for the parent hash, then for
    the tokens. Which bytes keep [1, 23] and [12, 3] apart?
    Any such hash serves the engine. Chapter 16's KV events (serve --kv-events-endpoint) need the reference's
    own: each hash goes out as 32 bytes and routers recompute the chain from prompts, so serve refuses them
    with --student 05 unless yours gives the reference's ints.

        hash_block(None, [1, 2, 3]) == hash_block(None, [1, 2, 3])        # an int, every run
        len({hash_block(None, [1, 2, 3]), hash_block(None, [3, 2, 1]), hash_block(None, [1, 2]),
             hash_block(hash_block(None, [1, 2, 3]), [1, 2, 3])}) == 4
    """
    raise NotImplementedError("Exercise 5.2: hash the parent hash and the block's tokens together")


def block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int | None = None) -> list[int]:
    """Exercise 5.2. The chain hashes of the FULL blocks of token_ids (a trailing partial block gets none),
    starting the chain from `parent_hash`, so that
    block_hashes(t[32:], 16, parent_hash=block_hashes(t, 16)[1]) == block_hashes(t, 16)[2:]."""
    raise NotImplementedError("Exercise 5.2: walk the full blocks, each hash the parent of the next")


class PrefixCache:
    """hash of a full block -> the block id holding its keys and values."""

    # The block manager names blocks through its cache, so a cache brings its own hash function.
    hash_block = staticmethod(hash_block)

    def __init__(self):
        """Exercise 5.2. Two maps: block_of_hash (hash -> block id) and entries (block id -> (hash,
        parent hash, tuple of tokens)); the tests and the block manager read both."""
        raise NotImplementedError("Exercise 5.2: set up the two maps")

    def get(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """Exercise 5.2. The block cached under block_hash — but only if its parent hash AND its tokens
        match too (else it is a hash collision): None otherwise."""
        raise NotImplementedError("Exercise 5.2: look up the hash and guard against collisions")

    def insert(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int], block_id: int) -> bool:
        """Exercise 5.2. Register a full block. Return False (changing nothing) if the hash is already
        taken — the first block keeps it — or the block is already registered; else True."""
        raise NotImplementedError("Exercise 5.2: register the block under its hash")

    def evict(self, block_id: int) -> bool:
        """Exercise 5.2. Forget block_id (it is about to get new contents); False if it was not cached."""
        raise NotImplementedError("Exercise 5.2: drop the block from both maps")

    def __len__(self) -> int:
        return len(self.entries)
