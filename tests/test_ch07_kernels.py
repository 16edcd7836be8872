"""Chapter 07 — the Triton kernels, run by Triton's interpreter on the CPU, against chapter 05's torch path.

Paged attention: the kernel == chapter 05's PagedAttention (itself checked against attention written out
in tests/test_ch05_paged_attention.py) on the same pool, over block sizes 4 and 16, GQA ratios 1, 3, 4,
ragged lengths (1, exact block boundaries, partial tail blocks), whole prompts, chunks on a cached prefix
and a mixed step. The pool's blocks are dealt shuffled, so block tables are not contiguous.
Store-KV: the kernel writes exactly what chapter 05's index_copy_ writes.

The graded tests take the kernels from `implementation(...)`: the reference, or the learner's exercises/07
files under `make grade CH=07`. The paged kernel is a ladder (nanoserve/student.py, RUNGS): a test of rung
7.3 runs the learner's block walk inside the reference's kernel and tile update, and so on.

    7.1  online_softmax_step: a probe kernel feeds it hand-made tiles (against the whole-row softmax),
         then the whole kernel on multi-tile batches and float16
    7.2  store_kv_kernel: == index_copy_, ragged last program, strided inputs, a pool with padded blocks
    7.3  load_kv_tile: block sizes 1-16, tiles smaller and larger than a block, shuffled tables, NaN in every
         row it may not read (through the whole kernel, and its tiles read alone by a probe kernel)
    7.4  paged_attention_kernel: GQA 1, 3, 4, decodes, prompts, chunks on a prefix (causal), tile sizes
"""

import os

# before triton itself is first imported, by anything (tests/conftest.py sets it first): @triton.jit reads it
# when a function is defined, and Triton's own tl.zeros, tl.max are @triton.jit functions defined at import
os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanoserve.kv.block_manager import slot_mapping  # noqa: E402
from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache  # noqa: E402
from nanoserve.student import implementation  # noqa: E402
from tests.test_ch05_paged_attention import random_batch  # noqa: E402


def kernel():
    return implementation("nanoserve.kernels.triton_paged_attention")


def store_kv(*args):
    return implementation("nanoserve.kernels.triton_store_kv").store_kv(*args)


def rungs(*exercises, params=(None,)):
    """The same test graded once per rung of the kernel: pytest params marked with each exercise id."""
    return [pytest.param(exercise, p, marks=pytest.mark.exercise(exercise), id=f"{exercise}-{p}")
            for exercise in exercises for p in params]


def make_step(num_kv_heads, group, head_dim, block_size, seq_lens, query_lens, dtype=torch.float32, seed=0):
    """A pool with every sequence's cached prefix (its first seq_len - query_len positions) in shuffled blocks,
    and this step's q, k, v for the rest. Returns (cache, metadata, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(need) + 3))  # room to spare: some blocks stay unused (zeros)
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in need]
    cache = PagedKVCache(1, sum(need) + 3, block_size, num_kv_heads, head_dim, dtype)
    for table, s, n in zip(tables, seq_lens, query_lens):
        k, v = (torch.randn(s - n, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
        cache.store_kv(0, k, v, torch.tensor(slot_mapping(table, 0, s - n, block_size), dtype=torch.long))
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, block_size)
    N = sum(query_lens)
    q = torch.randn(N, num_kv_heads * group, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(N, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    return cache, meta, q, k, v


def compare(cache, meta, q, k, v, tol=1e-4, **launch):
    """Chapter 05's PagedAttention stores k, v and attends; the kernel then reads the same pool."""
    expected = PagedAttention(cache, meta)(0, q, k, v)  # (N, H, D)
    out = kernel().paged_attention(q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens,
                                   meta.cu_seqlens_q, **launch)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    err = (out.float() - expected.float()).abs().max().item()
    assert err < tol, f"max abs diff {err}"


CASES = {  # name: (seq_lens, query_lens)
    "decodes, ragged": ([1, 4, 5, 16, 33, 70], [1] * 6),  # length 1, exact boundaries, partial tails, many tiles
    "whole prompts": ([1, 16, 7, 40], [1, 16, 7, 40]),
    "chunks on a cached prefix": ([24, 9, 70], [8, 5, 30]),
    "mixed step": ([13, 1, 48, 32, 20], [1, 1, 48, 16, 1]),  # decodes, a whole prompt, a chunk
}


@pytest.mark.exercise("7.4")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_kernel_equals_torch_paged_attention(case, block_size, group):
    seq_lens, query_lens = CASES[case]
    # tile 16 < most lengths: the online softmax rescales across tiles; GQA groups of 3 are padded to 4 rows
    compare(*make_step(2, group, 16, block_size, seq_lens, query_lens, seed=block_size + group), tile=16)


@pytest.mark.exercise("7.4")
@pytest.mark.parametrize("block_m, tile", [(16, 16), (16, 64), (64, 32)])
def test_kernel_tile_sizes(block_m, tile):
    """SmolLM2's shape (3 kv heads, G = 3, head_dim 64) with the GPU's 16 rows and the interpreter's 64."""
    compare(*make_step(3, 3, 64, 16, [1, 17, 40, 64], [1, 9, 40, 1], seed=tile), block_m=block_m, tile=tile)


@pytest.mark.parametrize("rung, seed", rungs("7.1", "7.3", "7.4", params=range(2)))
def test_kernel_on_random_batches(rung, seed):
    """Chapter 05's random mixed steps: 1-6 sequences, lengths 1-50, decodes, chunks, whole prompts."""
    seed += 2 * int(rung[-1])  # each rung its own batches
    rng = random.Random(seed)
    torch.manual_seed(seed)
    Hkv, G, bs = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4]), rng.choice([4, 16])
    seq_lens, query_lens, tables, num_blocks, q, k_full, v_full = random_batch(rng, Hkv, G, 16, bs)
    cache = PagedKVCache(1, num_blocks, bs, Hkv, 16)
    for table, s, n, k, v in zip(tables, seq_lens, query_lens, k_full, v_full):
        cache.store_kv(0, k[: s - n], v[: s - n], torch.tensor(slot_mapping(table, 0, s - n, bs), dtype=torch.long))
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, bs)
    new_k = torch.cat([k[s - n:] for k, s, n in zip(k_full, seq_lens, query_lens)])
    new_v = torch.cat([v[s - n:] for v, s, n in zip(v_full, seq_lens, query_lens)])
    compare(cache, meta, torch.cat(q), new_k, new_v, tile=16)


@pytest.mark.exercise("7.1")
def test_kernel_float16():
    """fp16 in, fp32 scores and sums inside, fp16 out. (bf16 is left to the GPU: in triton 3.9 the
    interpreter's tl.dot gets bfloat16 inputs wrong — a 16 x 16 bf16 product comes out off by ~1e10.)"""
    compare(*make_step(3, 3, 64, 16, [5, 40, 20], [1, 40, 8], dtype=torch.float16), tol=2e-2, tile=16)


def poison_unreadable(cache, tables, seq_lens, block_size, width):
    """NaN in every K/V row of the pool that no sequence's first seq_len positions hold: the blocks outside every
    table and the rows of each tail block past its sequence's length. Block 0, where a table entry loaded as a
    masked lane's `other=0` points, is made one of them (its keys move to a spare block). Returns the tables
    padded to `width` entries with another NaN block: a table read past a sequence's blocks stays inside the
    table and names NaN rows too."""
    spare = sorted(set(range(cache.num_blocks)) - {b for t in tables for b in t} - {0})
    if any(0 in t for t in tables):
        moved = spare.pop(0)
        for pool in (cache.k_cache[0], cache.v_cache[0]):
            pool[:, moved] = pool[:, 0]
        tables = [[moved if b == 0 else b for b in t] for t in tables]
    readable = torch.zeros(cache.num_blocks, block_size, dtype=torch.bool)
    for table, s in zip(tables, seq_lens):
        for pos in range(s):
            readable[table[pos // block_size], pos % block_size] = True
    for pool in (cache.k_cache[0], cache.v_cache[0]):
        pool[:, ~readable] = float("nan")  # (Hkv, num_blocks, block_size, D)
    return torch.tensor([t + [spare[0]] * (width - len(t)) for t in tables])


@pytest.mark.exercise("7.3")
def test_kernel_reads_only_its_blocks():
    """The whole kernel on a pool whose unreadable rows are NaN (poison_unreadable), block 0 among them: a V row
    read at a position >= num_keys reaches the output (p = 0 times NaN is NaN). A stray K row does not (the
    kernel turns those scores into -inf whatever they were): test_block_walk_returns_only_its_keys looks at the
    tiles themselves."""
    cache, meta, q, k, v = make_step(2, 3, 16, 4, [7, 12], [3, 1])
    expected = PagedAttention(cache, meta)(0, q, k, v)  # stores the step's k, v in the pool first
    tables = poison_unreadable(cache, meta.block_tables.tolist(), meta.seq_lens.tolist(), 4, width=8)
    assert torch.isnan(cache.v_cache[0][:, 0]).all() and torch.isnan(cache.k_cache[0][:, 0]).all()
    out = kernel().paged_attention(q, cache.k_cache[0], cache.v_cache[0], tables, meta.seq_lens,
                                   meta.cu_seqlens_q, tile=16)
    assert not out.isnan().any(), "NaN in the output: a V row was read at a position >= num_keys"
    assert (out - expected).abs().max().item() < 1e-4


@triton.jit
def probe_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, k_out_ptr, v_out_ptr, pos_out_ptr, num_keys,
                  stride_kh, stride_kb, stride_ks, KV_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr):
    """Program (t, j): KV_TILE's tile t (key positions t · TILE ..) of kv head j, stored as it comes back into
    k_out, v_out (Hkv, tiles · TILE, D_PAD) and pos_out (Hkv, tiles · TILE)."""
    t, kv_head = tl.program_id(0), tl.program_id(1)
    k, v, key_pos = KV_TILE(k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_kh, table_ptr,
                            t * TILE, num_keys, stride_kb, stride_ks, HEAD_DIM, BLOCK_SIZE, D_PAD, TILE)
    row = (kv_head * tl.num_programs(0) + t) * TILE + tl.arange(0, TILE)  # (TILE,)
    d = tl.arange(0, D_PAD)
    tl.store(k_out_ptr + row[:, None] * D_PAD + d[None, :], k)
    tl.store(v_out_ptr + row[:, None] * D_PAD + d[None, :], v)
    tl.store(pos_out_ptr + row, key_pos)


WALKS = {  # name: (block_size, tile, head_dim, num_keys, the sequence's table, width of the table)
    "the docstring's example": (4, 8, 16, 6, [5, 2], 2),
    "a tile past a narrow table row": (4, 16, 16, 6, [5, 2], 2),  # entries 2, 3: the next sequence's row
    "a tile past the padded table's end": (4, 16, 12, 6, [5, 2], 4),  # head dim 12: dims 12-15 are padding
    "keys past num_keys in its own block": (16, 4, 16, 21, [3, 1], 2),  # rows 21-31 of block 1: not yet visible
    "block size 1": (1, 8, 8, 5, [9, 4, 6, 2, 8], 8),
}


@pytest.mark.exercise("7.3")
@pytest.mark.parametrize("walk", WALKS)
def test_block_walk_returns_only_its_keys(walk):
    """The tiles a walk returns, read directly: k, v = the pool's rows its table names for positions < num_keys,
    0 for every other position and for the padding dims. Every other row of the pool is NaN: block 0 (where a
    masked table load's other=0 points), the block the table's padding entries name, the sequence's own rows from
    num_keys on, and the blocks of a second sequence whose table row follows this one's (where a table read past
    a narrow row lands). So a K or V load at a masked position, or through a table entry read at one, returns NaN
    where 0 is due."""
    from nanoserve.kernels.backend import stub_errors_unwrapped

    bs, tile, D, num_keys, table, width = WALKS[walk]
    Hkv, num_blocks, padding = 2, 16, 15
    other = [b for b in range(1, padding) if b not in table][:width]  # the next sequence's blocks
    tables = torch.tensor([table + [padding] * (width - len(table)), other])  # row 0: the walk's sequence
    g = torch.Generator().manual_seed(bs)
    k_cache, v_cache = torch.full((2, Hkv, num_blocks, bs, D), float("nan"))  # (Hkv, num_blocks, block_size, D)
    k_expected, v_expected = (torch.zeros(Hkv, -(-num_keys // tile) * tile, triton.next_power_of_2(D))
                              for _ in range(2))  # (Hkv, the tiles' positions, D_PAD)
    for pos in range(num_keys):
        for pool, expected in ((k_cache, k_expected), (v_cache, v_expected)):
            pool[:, table[pos // bs], pos % bs] = expected[:, pos, :D] = torch.randn(Hkv, D, generator=g)
    k_out, v_out = torch.empty_like(k_expected), torch.empty_like(v_expected)
    pos_out = torch.empty(k_expected.shape[:2], dtype=torch.int32)
    with stub_errors_unwrapped():
        probe_kv_tile[(k_expected.shape[1] // tile, Hkv)](
            k_cache, v_cache, tables, k_out, v_out, pos_out, num_keys, *k_cache.stride()[:3],
            KV_TILE=kernel().load_kv_tile, HEAD_DIM=D, BLOCK_SIZE=bs, D_PAD=k_expected.shape[-1], TILE=tile)
    assert pos_out.tolist() == [list(range(k_expected.shape[1]))] * Hkv
    torch.testing.assert_close(k_out, k_expected, rtol=0, atol=0, msg=lambda m: f"k: {m}")
    torch.testing.assert_close(v_out, v_expected, rtol=0, atol=0, msg=lambda m: f"v: {m}")


@pytest.mark.exercise("7.2")
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size, block_t", [(2, 16, 4, 16), (3, 64, 16, 4), (1, 8, 1, 2)])
def test_store_kv_equals_index_copy(num_kv_heads, head_dim, block_size, block_t):
    """SmolLM2's 3 kv heads pad to 4 rows (192 = 3 · 64 is not a power of two); every other slot untouched."""
    g = torch.Generator().manual_seed(head_dim)
    reference = PagedKVCache(1, 6, block_size, num_kv_heads, head_dim)
    reference.k_cache[0].normal_(generator=g)
    reference.v_cache[0].normal_(generator=g)
    k_cache, v_cache = reference.k_cache[0].clone(), reference.v_cache[0].clone()
    slots = torch.randperm(6 * block_size, generator=g)[:5]
    k, v = torch.randn(5, num_kv_heads, head_dim, generator=g), torch.randn(5, num_kv_heads, head_dim, generator=g)
    reference.store_kv(0, k, v, slots)
    store_kv(k, v, k_cache, v_cache, slots, block_t)  # 5 tokens: a partly filled last program
    assert torch.equal(k_cache, reference.k_cache[0]) and torch.equal(v_cache, reference.v_cache[0])


@pytest.mark.exercise("7.2")
def test_store_kv_takes_strided_inputs_and_refuses_mismatches():
    """k, v as the model hands them over: views into one (N, 2 · Hkv · D) projection output."""
    kv = torch.randn(3, 2, 2, 16)  # (N, k|v, Hkv, D)
    reference = PagedKVCache(1, 2, 4, 2, 16)
    k_cache, v_cache = reference.k_cache[0].clone(), reference.v_cache[0].clone()
    slots = torch.tensor([7, 0, 3])
    store_kv(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    reference.store_kv(0, kv[:, 0], kv[:, 1], slots)
    assert torch.equal(k_cache, reference.k_cache[0]) and torch.equal(v_cache, reference.v_cache[0])
    with pytest.raises(ValueError, match="do not agree"):
        store_kv(kv[:, 0], kv[:, 1], k_cache, v_cache, slots[:2])


def test_kernel_refuses_a_query_that_does_not_fit_the_pool():
    cache, meta, q, k, v = make_step(2, 3, 16, 4, [5], [1])
    with pytest.raises(ValueError, match="does not fit the pool"):
        kernel().paged_attention(q[:, :5], cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens,
                                 meta.cu_seqlens_q)  # 5 query heads for 2 kv heads
    # the kernel reads V with K's strides: a V pool laid out otherwise would be read at the wrong addresses
    v_other = cache.v_cache[0].transpose(0, 1).contiguous().transpose(0, 1)  # same shape, blocks outermost
    assert v_other.shape == cache.k_cache[0].shape and v_other.stride() != cache.k_cache[0].stride()
    with pytest.raises(ValueError, match="same strides"):
        kernel().paged_attention(q, cache.k_cache[0], v_other, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)


def test_gpu_dot_minimums_are_the_pinned_triton_backends():
    """min_dot_k is the K of Triton's nvidia backend's min_dot_size, whose M and N minimums are 1."""
    from types import SimpleNamespace

    from triton.backends.nvidia.compiler import min_dot_size

    from nanoserve.kernels.triton_paged_attention import min_dot_k

    for dtype in (torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        operand = SimpleNamespace(scalar=SimpleNamespace(primitive_bitwidth=dtype.itemsize * 8))
        assert min_dot_size(None)(operand, operand) == (1, 1, min_dot_k(dtype)), dtype


def test_a_tile_too_small_for_a_gpu_dot_is_refused_on_cuda_only(monkeypatch):
    """TILE and D_PAD are the K of the kernel's two dots: below min_dot_k an NVIDIA GPU's Triton would not compile
    the kernel, so the launch refuses it there; the interpreter takes any size (the 7.3 tests use tiles of 4)."""
    from nanoserve.kernels import triton_paged_attention as reference
    from nanoserve.kernels.triton_paged_attention import check_dot_sizes, launch_config

    if torch.version.hip is not None:
        pytest.skip("a ROCm build: Triton's AMD backend has no minimum")
    cuda = torch.device("cuda")  # naming a device needs no GPU
    with pytest.raises(ValueError, match="TILE = 4, .* at least 8 .* pass tile >= 8"):
        check_dot_sizes(launch_config(9, 3, 64, block_m=16, tile=4), torch.float32, cuda)
    check_dot_sizes(launch_config(9, 3, 64, block_m=16, tile=8), torch.float32, cuda)
    with pytest.raises(ValueError, match="TILE = 8, .* at least 16 "):
        check_dot_sizes(launch_config(9, 3, 64, block_m=16, tile=8), torch.float16, cuda)
    with pytest.raises(ValueError, match="D_PAD = 8, .* at least 16 "):
        check_dot_sizes(launch_config(2, 1, 8, block_m=16), torch.bfloat16, cuda)
    check_dot_sizes(launch_config(9, 3, 64, block_m=16, tile=4), torch.float16, torch.device("cpu"))
    # the launch checks the tiles it is given, on the device of its tensors
    seen = []
    monkeypatch.setattr(reference, "check_dot_sizes", lambda cfg, dtype, device: seen.append((cfg["TILE"], dtype,
                                                                                               device.type)))
    cache, meta, q, k, v = make_step(1, 1, 16, 4, [3], [1])
    reference.paged_attention(q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens,
                              meta.cu_seqlens_q, tile=4)
    assert seen == [(4, torch.float32, "cpu")]


@pytest.mark.parametrize("block_m, tile, num_warps, num_stages", [(16, 16, 8, 3), (32, 32, 1, 1)])
def test_launch_parameters_reach_the_kernel(block_m, tile, num_warps, num_stages):
    """paged_attention's num_warps and num_stages (bench attention's sweep) go to the launch with the tiles, and
    the output stays chapter 05's (the interpreter drops warps and stages, so a spy reads them at the launch)."""
    from nanoserve.kernels import triton_paged_attention as reference

    seen = []

    class Spy:  # kernel[grid](...) records the launch's keywords, then runs the kernel itself
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append({k: kwargs[k] for k in ("num_warps", "num_stages", "TILE", "BLOCK_Q", "G_PAD")})
                return reference.paged_attention_kernel[grid](*args, **kwargs)
            return run

    cache, meta, q, k, v = make_step(3, 3, 64, 16, [1, 40, 20], [1, 1, 8], seed=tile)
    expected = PagedAttention(cache, meta)(0, q, k, v)
    out = reference.launch(Spy(), reference.online_softmax_step, reference.load_kv_tile, q, cache.k_cache[0],
                           cache.v_cache[0], meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, block_m=block_m,
                           tile=tile, num_warps=num_warps, num_stages=num_stages)
    assert seen == [{"num_warps": num_warps, "num_stages": num_stages, "TILE": tile, "BLOCK_Q": block_m // 4,
                     "G_PAD": 4}]
    assert (out - expected).abs().max().item() < 1e-4
    # paged_attention passes them on
    out = reference.paged_attention(q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens,
                                    meta.cu_seqlens_q, block_m=block_m, tile=tile, num_warps=num_warps,
                                    num_stages=num_stages)
    assert (out - expected).abs().max().item() < 1e-4


def test_launch_parameters_no_gpu_takes_are_refused():
    """Sizes tl.arange cannot build, warps no CTA holds, a pipeline of no stage: a ValueError before the launch."""
    from nanoserve.kernels import triton_paged_attention as reference

    cache, meta, q, k, v = make_step(1, 1, 16, 4, [3], [1])
    args = (q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)
    for bad, match in [({"tile": 24}, "tile = 24, .* power of two"), ({"block_m": 0}, "block_m = 0, .* power of two"),
                       ({"num_warps": 3}, "num_warps = 3, .* power of two"), ({"num_warps": 64}, "1 to 32"),
                       ({"num_stages": 0}, "num_stages = 0, .* at least 1"),
                       ({"partition_size": 48}, "partition_size = 48, .* power of two"),
                       ({"partition_size": 0}, "partition_size = 0, .* power of two"),
                       ({"partition_size": 32, "tile": 64}, "partition_size = 32, .* whole number of tiles, .* 64")]:
        with pytest.raises(ValueError, match=match):
            reference.paged_attention(*args, **bad)


SPLIT_CASES = {  # name: (seq_lens, query_lens); block size 4, partitions of 16 keys, tiles of 8
    # 1 to 5 partitions (70 = 4 · 16 + 6: a partly filled last one), the grid's 5 for all: a sequence of 1 key
    # leaves 4 programs with no key at all
    "decodes": ([1, 4, 5, 16, 33, 70], [1] * 6),
    # a whole prompt and chunks on cached prefixes: a query block of 16 tokens (the interpreter's 64 rows) spans a
    # partition edge, so some of its rows see no key of the later partition
    "mixed step": ([13, 1, 48, 32, 70], [1, 1, 48, 16, 30]),
}


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_kv_equals_one_pass(case, monkeypatch):
    """partition_size: split-KV (a grid axis of partitions, each program's partial (m, l, acc) combined afterwards)
    gives the one-pass kernel's output and chapter 05's, over partitions of 16 keys: 5 for the longest sequence."""
    from nanoserve.kernels import triton_paged_attention as reference

    seq_lens, query_lens = SPLIT_CASES[case]
    cache, meta, q, k, v = make_step(2, 3, 16, 4, seq_lens, query_lens, seed=len(case))
    expected = PagedAttention(cache, meta)(0, q, k, v)
    args = (q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)
    grids = []
    split_kernel = reference.paged_attention_split_kernel

    class Spy:  # records the split kernel's grid, then runs it
        def __getitem__(self, grid):
            grids.append(grid)
            return split_kernel[grid]

    monkeypatch.setattr(reference, "paged_attention_split_kernel", Spy())
    split = reference.paged_attention(*args, tile=8, partition_size=16)
    monkeypatch.undo()
    assert len(grids) == 1 and grids[0][1:] == (2, 5)  # (query blocks, kv heads, partitions)
    one_pass = reference.paged_attention(*args, tile=8)
    assert not split.isnan().any()
    assert (split - expected).abs().max().item() < 1e-4
    assert (split - one_pass).abs().max().item() < 1e-5


@pytest.mark.exercise("7.2")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_store_kv_finds_block_and_row_in_a_pool_with_padded_blocks(dtype):
    """A pool whose blocks are rows of a wider buffer (block stride != block_size x row stride): slot s must go
    to block s // block_size, row s % block_size, not to "slot s of a flat view". Padding stays untouched."""
    Hkv, D, bs = 2, 8, 4
    k_buf, v_buf = torch.zeros(Hkv, 5, bs + 2, D), torch.zeros(Hkv, 5, bs + 2, D)  # 2 spare rows per block
    k_cache, v_cache = k_buf[:, :, :bs], v_buf[:, :, :bs]  # (Hkv, 5, 4, D), stride(1) = 6 · D
    slots = torch.tensor([19, 3, 4, 10, 0, 7, 13], dtype=dtype)  # blocks 4, 0, 1, 2, 0, 1, 3
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(7, Hkv, D, generator=g), torch.randn(7, Hkv, D, generator=g)
    store_kv(k, v, k_cache, v_cache, slots, 4)  # 2 programs, the second 3 tokens short
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[:, slot // bs, slot % bs], k[t]) and torch.equal(v_cache[:, slot // bs, slot % bs], v[t])
    written = torch.zeros(5, bs + 2, dtype=torch.bool)
    written[slots // bs, slots % bs] = True
    assert (k_buf[:, ~written] == 0).all() and (v_buf[:, ~written] == 0).all()


@pytest.mark.parametrize("rung, block_size", rungs("7.3", params=[1, 4, 16]))
@pytest.mark.parametrize("tile", [4, 32])
def test_block_walk_across_block_sizes_and_tiles(rung, block_size, tile):
    """Tiles smaller than a block (several tiles per block) and larger (several blocks per tile), block size 1
    (every key its own block), shuffled tables: the keys of a tile come from the blocks its table names. (A tile
    of 4 runs in the interpreter only: an NVIDIA GPU's tl.dot needs 8 keys or more, see min_dot_k.)"""
    compare(*make_step(2, 2, 16, block_size, [1, 6, 21, 37], [1, 1, 5, 37], seed=block_size), tile=tile)


@triton.jit
def probe_step(scores_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, STEP: tl.constexpr, NUM_TILES: tl.constexpr,
               M: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr):
    """Calls STEP on NUM_TILES hand-made tiles of scores (NUM_TILES, M, TILE) and values (NUM_TILES, TILE, D),
    from the kernel's starting state, and stores the final m, l, acc."""
    r, c, d = tl.arange(0, M), tl.arange(0, TILE), tl.arange(0, D)
    m = tl.full((M,), float("-inf"), tl.float32)
    l = tl.zeros((M,), tl.float32)
    acc = tl.zeros((M, D), tl.float32)
    for i in range(NUM_TILES):
        s = tl.load(scores_ptr + i * M * TILE + r[:, None] * TILE + c[None, :])
        v = tl.load(v_ptr + i * TILE * D + c[:, None] * D + d[None, :])
        m, l, acc = STEP(s, v, m, l, acc)
    tl.store(m_ptr + r, m)
    tl.store(l_ptr + r, l)
    tl.store(acc_ptr + r[:, None] * D + d[None, :], acc)


@pytest.mark.exercise("7.1")
@pytest.mark.parametrize("num_tiles", [1, 3])
def test_tile_update_equals_the_whole_row_softmax(num_tiles):
    """After the last tile: m = the row's max, l = sum exp(s - m), acc = sum exp(s - m) v, for rows whose max
    rises in a later tile, falls, and rows that see nothing of tiles 1+ (all -inf there: alpha must be 1)."""
    from nanoserve.kernels.backend import stub_errors_unwrapped

    M, TILE, D = 16, 16, 16
    g = torch.Generator().manual_seed(num_tiles)
    scores = torch.randn(num_tiles, M, TILE, generator=g) * 3
    scores[:, :4] += torch.arange(num_tiles)[:, None, None] * 5.0  # rows 0-3: the max rises tile after tile
    scores[1:, 4:8] = float("-inf")  # rows 4-7 see only tile 0
    scores[0, 8:12, TILE // 2:] = float("-inf")  # rows 8-11: half of tile 0 masked (the causal edge)
    v = torch.randn(num_tiles, TILE, D, generator=g)
    m, l, acc = torch.empty(M), torch.empty(M), torch.empty(M, D)
    with stub_errors_unwrapped():
        probe_step[(1,)](scores, v, m, l, acc, STEP=kernel().online_softmax_step, NUM_TILES=num_tiles, M=M,
                         TILE=TILE, D=D)
    row = scores.permute(1, 0, 2).reshape(M, -1)  # (M, all keys)
    expected_m = row.max(-1).values
    p = torch.exp(row - expected_m[:, None])
    torch.testing.assert_close(m, expected_m)
    torch.testing.assert_close(l, p.sum(-1))
    torch.testing.assert_close(acc, p @ v.reshape(-1, D), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(acc / l[:, None], torch.softmax(row, -1) @ v.reshape(-1, D), rtol=1e-5, atol=1e-5)
