"""Chapter 05 — prefix caching: find the KV blocks another request already computed.

A full block's keys and values depend on its own tokens *and on every token before it*
(attention mixed them in). So a block is named by a hash chained over the whole prefix:

    h0 = hash_block(None, tokens[0:16])
    h1 = hash_block(h0,   tokens[16:32])
    h2 = hash_block(h1,   tokens[32:48])      ...

Two prompts that share their first 40 tokens share h0 and h1 (blocks 0 and 1 are full and equal)
and differ from h2 on. Only full blocks are hashed: a partial block is still being written.

`PrefixCache` maps hash -> block id. A hash is not proof: two different contents could collide,
so every entry also keeps its parent hash and its tokens, and a lookup only hits when both match.
(With a chain, the parent hash stands in for the whole earlier prefix; a real collision would
need two at once.)
"""

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """SHA-256 of (parent hash, token ids) as an int: deterministic across processes, and hard to
    collide on purpose — one user must not be able to make another user's request read their KV."""
    h = hashlib.sha256()
    h.update(b"root" if parent_hash is None else parent_hash.to_bytes(32, "little"))
    h.update(array("q", token_ids).tobytes())  # int64 each
    return int.from_bytes(h.digest(), "little")


def root_hash(cache_salt: str | None) -> int | None:
    """The parent of a chain's first block: None (one cache for everyone), or the salt's own hash. Requests
    with different salts then never share a block, whatever their tokens: vLLM's `cache_salt`, mixed into the
    first block's hash the same way. Chapter 08's tenants are salted by name, so one tenant's cached prefix
    cannot tell another tenant, by a faster first token, that someone sent it.

        >>> hash_block(root_hash("tenant:a"), [1, 2]) != hash_block(root_hash("tenant:b"), [1, 2])
        True
    """
    if cache_salt is None:
        return None
    return int.from_bytes(hashlib.sha256(b"salt" + cache_salt.encode()).digest(), "little")


class SaltedTokenIds(list):
    """A sequence's token ids (a plain list) that also say whose they are: `cache_salt`, the chain's root
    (root_hash), and `lora`, (lora_id, lora_name) of the adapter whose K/V they get (chapter 19; None: the base
    model's), which the block manager passes on to its KV-event listeners. Everything else sees a list."""

    def __init__(self, token_ids, cache_salt: str | None, lora: tuple[int, str] | None = None):
        super().__init__(token_ids)
        self.cache_salt = cache_salt
        self.lora = lora


def block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int | None = None) -> list[int]:
    """The chain hashes of the full blocks of `token_ids` (a trailing partial block gets none).

    `parent_hash` continues an existing chain: block_hashes(t[32:], 16, parent_hash=h1) == block_hashes(t, 16)[2:].
    """
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes


class PrefixCache:
    """hash of a full block -> the block id holding its keys and values."""

    # The block manager names blocks through its cache, so a cache brings its own hash function.
    hash_block = staticmethod(hash_block)

    def __init__(self):
        self.block_of_hash: dict[int, int] = {}
        # block id -> (hash, parent hash, tokens): to check a hit, and to evict by block id
        self.entries: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}

    def get(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """The cached block with this hash, or None if there is none or it holds other tokens (a collision)."""
        block_id = self.block_of_hash.get(block_hash)
        if block_id is None:
            return None
        _, cached_parent, cached_tokens = self.entries[block_id]
        if cached_parent != parent_hash or cached_tokens != tuple(token_ids):
            return None
        return block_id

    def insert(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int], block_id: int) -> bool:
        """Register a full block; False if the hash is already taken (the first block keeps it) or
        the block is already registered."""
        if block_hash in self.block_of_hash or block_id in self.entries:
            return False
        self.block_of_hash[block_hash] = block_id
        self.entries[block_id] = (block_hash, parent_hash, tuple(token_ids))
        return True

    def evict(self, block_id: int) -> bool:
        """Forget `block_id` (the allocator is handing it out for new contents); False if it was not cached."""
        entry = self.entries.pop(block_id, None)
        if entry is None:
            return False
        del self.block_of_hash[entry[0]]
        return True

    def __len__(self) -> int:
        return len(self.entries)
