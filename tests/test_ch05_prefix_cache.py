"""Chapter 05, exercise 5.2 (graded): the prefix hash chain and the collision-guarded prefix cache."""

import os
import subprocess
import sys

import pytest

from nanoserve.kv.block_manager import BlockManager
from nanoserve.student import implementation

pytestmark = pytest.mark.exercise("5.2")


@pytest.fixture
def pc():
    return implementation("nanoserve.kv.prefix_cache")


def test_hash_is_deterministic_and_depends_on_parent_and_order(pc):
    assert pc.hash_block(None, [1, 2, 3]) == pc.hash_block(None, [1, 2, 3])
    assert isinstance(pc.hash_block(None, [1, 2, 3]), int)
    h = pc.hash_block(None, [1, 2, 3])
    variants = [pc.hash_block(None, [3, 2, 1]), pc.hash_block(h, [1, 2, 3]), pc.hash_block(None, [1, 2, 4]),
                pc.hash_block(None, [1, 2])]
    assert len({h, *variants}) == 5


def test_hash_is_the_same_int_in_every_process(pc):
    """A cache that outlives a process, or events a router reads in another one (chapter 16), need the same hash
    for the same tokens everywhere. Python's hash() is not such a hash: hash(None) is the object's address, which
    moves from process to process, and a str's hash changes with PYTHONHASHSEED."""
    here = (str(pc.hash_block(None, [1, 2, 3])), str(pc.hash_block(12345, [4, 5])))  # a stub raises here, not below
    code = ("from nanoserve.student import implementation; pc = implementation('nanoserve.kv.prefix_cache'); "
            "print(pc.hash_block(None, [1, 2, 3]), pc.hash_block(12345, [4, 5]))")
    runs = {tuple(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.getcwd()}).stdout.split()[-2:])
            for seed in ("1", "2")}
    assert runs == {here}


def test_chain_over_full_blocks(pc):
    a = list(range(40))
    b = a[:20] + [99] + a[21:]  # differs in block 1 (tokens 16..31)
    ha, hb = pc.block_hashes(a, 16), pc.block_hashes(b, 16)
    assert len(ha) == 2  # tokens 32..39 are a partial block: no hash
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert ha[0] == pc.hash_block(None, a[:16]) and ha[1] == pc.hash_block(ha[0], a[16:32])
    # the same block of tokens after a different prefix is a different block
    c = [7] * 16 + a[16:32]
    assert pc.block_hashes(c, 16)[1] != ha[1]
    assert pc.block_hashes(a[16:], 16, parent_hash=ha[0]) == ha[1:]
    assert pc.block_hashes(a[:15], 16) == [] and pc.block_hashes([], 4) == []


def test_cache_get_insert_evict(pc):
    cache = pc.PrefixCache()
    h0 = pc.hash_block(None, [1, 2])
    assert cache.get(h0, None, [1, 2]) is None
    assert cache.insert(h0, None, [1, 2], block_id=5)
    assert cache.get(h0, None, (1, 2)) == 5 and len(cache) == 1
    assert not cache.insert(h0, None, [1, 2], block_id=6)  # hash taken: the first block keeps it
    assert not cache.insert(pc.hash_block(h0, [3, 4]), h0, [3, 4], block_id=5)  # block 5 is registered already
    assert cache.get(h0, None, [1, 2]) == 5
    assert cache.evict(5) and not cache.evict(5)
    assert cache.get(h0, None, [1, 2]) is None and len(cache) == 0


def test_collisions_are_caught(pc):
    cache = pc.PrefixCache()
    cache.insert(42, None, [1, 2], block_id=0)
    assert cache.get(42, None, [9, 9]) is None  # same hash, other tokens
    assert cache.get(42, 41, [1, 2]) is None  # same hash and tokens, other prefix


def test_it_runs_the_block_manager(pc, monkeypatch):
    """Your prefix cache under the real block manager, with a hash that collides all the time."""
    cache = pc.PrefixCache()
    m = BlockManager(num_blocks=8, block_size=4, prefix_cache=cache)
    a = list(range(13))
    m.allocate_slots(1, a, 13)
    assert m.lookup_prefix(a) == 12 and m.lookup_prefix(a[:6] + [0] * 7) == 4
    monkeypatch.setattr(type(cache), "hash_block", staticmethod(lambda parent, tokens: sum(tokens) % 2))
    m2 = BlockManager(num_blocks=8, block_size=4, prefix_cache=pc.PrefixCache())
    m2.allocate_slots(1, [1, 1, 0, 0, 5], 5)
    assert m2.lookup_prefix([0, 0, 1, 1, 5]) == 0  # same (bad) hash, different tokens
    assert m2.lookup_prefix([1, 1, 0, 0, 5]) == 4
