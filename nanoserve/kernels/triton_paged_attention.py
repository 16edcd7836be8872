"""Chapter 07 — ONE paged attention kernel in Triton for the engine's whole step (vLLM's "unified" design).

The step's flat batch mixes decodes (1 query), whole prompts and chunks on top of a cached prefix;
all of them go through this kernel. It reads K/V where they lie in chapter 05's pool
(Hkv, num_blocks, block_size, D): no gather, no copy, no reformat.

The grid: one program per (block of BLOCK_Q query tokens of one sequence, kv head).

    program (qb, j): sequence s = q_block_seq[qb], its query tokens q_block_start[qb] .. + BLOCK_Q,
                     kv head j and the G = H / Hkv query heads that share it (GQA)

Its rows are (query token, head of the group) pairs, BLOCK_M = BLOCK_Q · G_PAD of them, the group
padded to a power of two (SmolLM2: G = 3 -> 4 rows per token; the padding row is masked off).
Every K/V row the program loads serves all G heads at once.

The program walks its sequence's block table TILE keys at a time. Key position p lives in
physical block block_table[s, p // block_size], row p % block_size. The kernel is built of three
@triton.jit functions, each one rung of exercise 07 (the store-KV kernel, 7.2, is triton_store_kv.py):

    7.1  online_softmax_step   one tile's update of the running max m, sum l and accumulator acc
                               (the online softmax of nanoserve/kernels/online_softmax.py)
    7.3  load_kv_tile          the block walk: a tile's key positions -> physical blocks -> K and V rows
    7.4  paged_attention_kernel  the program: GQA row packing, scores, the causal mask, the loop, the store

The kernel takes the other two as constexpr arguments (STEP, KV_TILE): Triton compiles a jit function
passed that way into the kernel, so each rung can be swapped for a learner's on its own.

    # q (N, H, D), the pool's k_cache/v_cache (Hkv, num_blocks, block_size, D), chapter 05's metadata
    out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)

Split-KV ("flash decoding", vLLM's paged attention v2; chapter 07, section 9), an option: with
partition_size=P the grid gets a third axis, (query blocks, kv heads, partitions of P keys).
paged_attention_split_kernel walks only its partition's keys, with the same STEP and KV_TILE, and writes
its rows' partial (m, l, acc) to float32 scratch; combine_partitions_kernel merges the partials of each
(query token, head) with section 2's rescaling and writes out. More programs for the same bytes: what
a step of few sequences needs to fill the GPU. On an H200 (chapter 07, section 9.2; tile 128, partitions of
1024 keys, 2 stages, timed from a CUDA graph) it took batch 64 x 8192 from 56.3 % of the memory bandwidth in
one pass at the same tile and stages to 74.1 %, and 64 x 2048 from 43.9 % to 51.4 %; it loses where a partition holds the whole context (an
extra launch and the scratch for nothing). partition_size=None (the default) is the one-pass kernel.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.backend import check_launchable, interpreter_requested, stub_errors_unwrapped


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, q_block_seq_ptr, q_block_start_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,  # q, out: (num_tokens, H, D), last stride 1
    stride_kh, stride_kb, stride_ks,  # pool: (Hkv, num_blocks, block_size, D), last stride 1
    stride_bt,  # block_tables: (num_seqs, max_blocks)
    sm_scale,
    STEP: tl.constexpr,  # the tile update (exercise 7.1): online_softmax_step, or the learner's
    KV_TILE: tl.constexpr,  # the block walk (exercise 7.3): load_kv_tile, or the learner's
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
):
    """Exercise 7.4: one program = BLOCK_Q query tokens of one sequence x the G query heads of one kv head."""
    qb, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(q_block_seq_ptr + qb)
    q_first = tl.load(q_block_start_ptr + qb)  # this block's first query, counted within the sequence
    token_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - token_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys cached before this step: query i sits at position context_len + i

    # GQA row packing: rows = (query token, head of the group) pairs, the group padded to G_PAD
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    q_idx = q_first + rows // G_PAD  # (BLOCK_M,) query within the sequence
    head = kv_head * G + rows % G_PAD  # (BLOCK_M,) query head
    row_ok = (q_idx < q_len) & (rows % G_PAD < G)
    query_pos = context_len + q_idx
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    token = (token_begin + q_idx).to(tl.int64)  # int64 offsets: a big batch or pool overflows int32 on a GPU
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, D_PAD)

    m_i = tl.full((BLOCK_Q * G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q * G_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_Q * G_PAD, D_PAD), tl.float32)

    # the keys the block's last query sees: everything up to its position, nothing after
    num_keys = tl.minimum(seq_len, context_len + q_first + BLOCK_Q)
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh  # this kv head's (num_blocks, block_size, D)
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_kh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt  # this sequence's row of the block table
    for tile_start in range(0, num_keys, TILE):
        k, v, key_pos = KV_TILE(k_head, v_head, table, tile_start, num_keys, stride_kb, stride_ks,
                                HEAD_DIM, BLOCK_SIZE, D_PAD, TILE)
        # float32 scores; "ieee": true float32 products (a GPU would use tf32, the interpreter numpy float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # (BLOCK_M, TILE)
        visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < num_keys)  # causal edge, tail
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = STEP(scores, v, m_i, l_i, acc)

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def paged_attention_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, m_ptr, l_ptr, acc_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, q_block_seq_ptr, q_block_start_ptr,
    stride_qt, stride_qh,  # q: (num_tokens, H, D), last stride 1
    stride_mt, stride_mh,  # m, l: (num_tokens, H, num_partitions), last stride 1
    stride_at, stride_ah, stride_ap,  # acc: (num_tokens, H, num_partitions, D), last stride 1
    stride_kh, stride_kb, stride_ks, stride_bt, sm_scale,
    STEP: tl.constexpr, KV_TILE: tl.constexpr,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr, PARTITION: tl.constexpr,
):
    """Split-KV, pass 1: paged_attention_kernel's program (qb, j) over key positions part · PARTITION ..
    + PARTITION - 1 alone; it stores its rows' unnormalised (m, l, acc) at partition `part`, not acc / l."""
    qb, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(q_block_seq_ptr + qb)
    q_first = tl.load(q_block_start_ptr + qb)
    token_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - token_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # the rows, the q tile and the causal edge: as in paged_attention_kernel
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    q_idx = q_first + rows // G_PAD  # (BLOCK_M,)
    head = kv_head * G + rows % G_PAD  # (BLOCK_M,)
    row_ok = (q_idx < q_len) & (rows % G_PAD < G)
    query_pos = context_len + q_idx
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    token = (token_begin + q_idx).to(tl.int64)
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, D_PAD)

    # m starts at a floor far below any score, not -inf: a row may see no key of its partition (a partition past
    # the row's own position, inside a chunk), and STEP on an all -inf tile from m = -inf is exp(-inf - -inf) = NaN;
    # from the floor it is alpha = 1, p = 0, as for a later tile a row cannot see in the one-pass kernel
    m_i = tl.full((BLOCK_Q * G_PAD,), -1e30, tl.float32)
    l_i = tl.zeros((BLOCK_Q * G_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_Q * G_PAD, D_PAD), tl.float32)

    num_keys = tl.minimum(seq_len, context_len + q_first + BLOCK_Q)
    part_start = part * PARTITION
    part_end = tl.minimum(part_start + PARTITION, num_keys)  # <= part_start: nothing to walk, (m, l) = (-inf, 0)
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_kh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(part_start, part_end, TILE):  # PARTITION is whole tiles: no tile crosses its end
        k, v, key_pos = KV_TILE(k_head, v_head, table, tile_start, num_keys, stride_kb, stride_ks,
                                HEAD_DIM, BLOCK_SIZE, D_PAD, TILE)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # (BLOCK_M, TILE)
        visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < num_keys)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = STEP(scores, v, m_i, l_i, acc)

    # a row that saw no key (l = 0) writes m = -inf: the combine's exp(m_p - m) makes it 0
    m_i = tl.where(l_i > 0, m_i, float("-inf"))
    ml_off = token * stride_mt + head.to(tl.int64) * stride_mh + part  # (BLOCK_M,)
    tl.store(m_ptr + ml_off, m_i, mask=row_ok)
    tl.store(l_ptr + ml_off, l_i, mask=row_ok)
    acc_ptrs = acc_ptr + (token * stride_at + head.to(tl.int64) * stride_ah + part * stride_ap)[:, None] + d[None, :]
    tl.store(acc_ptrs, acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def combine_partitions_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, num_partitions,
    stride_mt, stride_mh,  # m, l: (num_tokens, H, num_partitions), last stride 1
    stride_at, stride_ah, stride_ap,  # acc: (num_tokens, H, num_partitions, D), last stride 1
    stride_ot, stride_oh,  # out: (num_tokens, H, D), last stride 1
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, P_PAD: tl.constexpr,
):
    """Split-KV, pass 2: program (t, h) merges query token t's partials for head h, as section 2 merges tiles:
    m = max m_p, alpha_p = exp(m_p - m), l = sum alpha_p l_p, acc = sum alpha_p acc_p, out = acc / l."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    p = tl.arange(0, P_PAD)
    p_ok = p < num_partitions
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    ml = token * stride_mt + head * stride_mh + p  # (P_PAD,)
    m_p = tl.load(m_ptr + ml, mask=p_ok, other=float("-inf"))  # (P_PAD,)
    l_p = tl.load(l_ptr + ml, mask=p_ok, other=0.0)
    acc_p = tl.load(acc_ptr + token * stride_at + head * stride_ah + p[:, None] * stride_ap + d[None, :],
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0)  # (P_PAD, D_PAD)
    # every query sees its own key, so one partition at least has m_p finite: m is, and no exp(-inf - -inf)
    m = tl.max(m_p, 0)
    alpha = tl.exp(m_p - m)  # (P_PAD,), 0 for a partition of no visible key (m_p = -inf)
    l = tl.sum(alpha * l_p, 0)
    acc = tl.sum(alpha[:, None] * acc_p, 0)  # (D_PAD,)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, (acc / l).to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def load_kv_tile(k_head_ptr, v_head_ptr, table_ptr, tile_start, num_keys, stride_kb, stride_ks,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr):
    """Exercise 7.3, the block walk: the K and V of key positions tile_start .. tile_start + TILE - 1.

    k_head_ptr, v_head_ptr: one kv head's part of the pool, (num_blocks, block_size, D) with strides
    (stride_kb, stride_ks, 1); table_ptr: the sequence's row of the block table (logical -> physical block).
    Returns k, v (TILE, D_PAD) — 0 for positions >= num_keys and for the padding dims >= HEAD_DIM — and
    key_pos (TILE,). Reads no block the table does not name for a position < num_keys.
    """
    key_pos = tile_start + tl.arange(0, TILE)  # (TILE,)
    key_ok = key_pos < num_keys
    # key position p lives in physical block table[p // block_size], row p % block_size
    block = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
    row_off = block.to(tl.int64) * stride_kb + (key_pos % BLOCK_SIZE).to(tl.int64) * stride_ks  # int64: big pools
    d = tl.arange(0, D_PAD)
    mask = key_ok[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_head_ptr + row_off[:, None] + d[None, :], mask=mask, other=0.0)  # (TILE, D_PAD)
    v = tl.load(v_head_ptr + row_off[:, None] + d[None, :], mask=mask, other=0.0)
    return k, v, key_pos


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc):
    """Exercise 7.1, the tile update of the online softmax (nanoserve/kernels/online_softmax.py, in torch).

    scores (BLOCK_M, TILE) float32, already scaled and masked (-inf where a row may not see a key);
    v (TILE, D_PAD) the tile's values; m_i, l_i (BLOCK_M,) the running max and sum of exp(score - m_i);
    acc (BLOCK_M, D_PAD) the running sum of exp(score - m_i) · v. Returns the new (m_i, l_i, acc).
    """
    # The kernel's tile 0 holds key 0, which every row sees: m_new is finite from the first tile on,
    # so no -inf - -inf; a later tile a row cannot see at all gives alpha = 1 and p = 0.
    m_new = tl.maximum(m_i, tl.max(scores, 1))  # (BLOCK_M,)
    alpha = tl.exp(m_i - m_new)  # how much the old max overstated: rescale what was summed so far
    p = tl.exp(scores - m_new[:, None])  # (BLOCK_M, TILE), 0 where masked
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


def query_blocks(cu_seqlens_q: list[int], block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid's first axis: (sequence, first query) of every block of block_q query tokens.

    >>> [t.tolist() for t in query_blocks([0, 1, 6, 7], block_q=4)]  # a decode, a 5-token chunk, a decode
    [[0, 1, 1, 2], [0, 0, 4, 0]]
    """
    seqs, starts = [], []
    for s, (a, b) in enumerate(zip(cu_seqlens_q, cu_seqlens_q[1:])):
        for first in range(0, b - a, block_q):
            seqs.append(s)
            starts.append(first)
    return torch.tensor(seqs, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)


def launch_config(num_heads: int, num_kv_heads: int, head_dim: int, block_m: int | None = None,
                  tile: int = 64) -> dict:
    """Tile sizes: BLOCK_M = BLOCK_Q · G_PAD rows per program, TILE keys per loop iteration, each a power of
    two (tl.arange needs it). block_m None: 16 on a GPU (the tensor cores multiply tiles of 16 rows, and
    Triton pads a dot with fewer rows up to them, see min_dot_k; a decode fills only G of the rows, and
    more rows would cost registers, not bandwidth), 64 in the interpreter (its cost is per program and per
    op, hardly per row: fewer, larger programs run faster there). The rows have no lower limit; the dots'
    shared axis does, on an NVIDIA GPU: see min_dot_k. ValueError for a size that is not a power of two.

    >>> launch_config(num_heads=9, num_kv_heads=3, head_dim=64, block_m=16)  # SmolLM2: G = 3 padded to 4
    {'G': 3, 'HEAD_DIM': 64, 'G_PAD': 4, 'D_PAD': 64, 'BLOCK_Q': 4, 'TILE': 64}
    """
    for name, size in (("block_m", block_m), ("tile", tile)):
        if size is not None and (size < 1 or size & (size - 1)):
            raise ValueError(f"paged_attention: {name} = {size}, but tl.arange needs a power of two")
    if block_m is None:
        block_m = 64 if interpreter_requested() else 16
    g_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    return dict(G=num_heads // num_kv_heads, HEAD_DIM=head_dim, G_PAD=g_pad, D_PAD=triton.next_power_of_2(head_dim),
                BLOCK_Q=max(block_m, g_pad) // g_pad, TILE=tile)


def min_dot_k(dtype: torch.dtype) -> int:
    """The least K (the axis a tl.dot sums over) Triton compiles for an NVIDIA GPU with inputs of `dtype`:
    its nvidia backend's min_dot_size gives (M, N, K) >= (1, 1, 16) for 16-bit inputs, (1, 1, 8) for 32-bit
    (and 32 for 8-bit, 4 for 64-bit); M and N have no limit ("For small M/N ... we can still use tensorcores
    with padding"). The kernel's dots sum over D_PAD (q·kᵀ) and over TILE (p·v, p cast to the pool's dtype).
    The interpreter has no such limit.

    >>> min_dot_k(torch.float32), min_dot_k(torch.float16), min_dot_k(torch.bfloat16)
    (8, 16, 16)
    """
    return {1: 32, 2: 16, 4: 8, 8: 4}[dtype.itemsize]


def check_dot_sizes(cfg: dict, dtype: torch.dtype, device: torch.device) -> None:
    """On an NVIDIA GPU, refuse a TILE or a padded head dim below min_dot_k(dtype), which Triton would not
    compile; the CPU's interpreter (and a ROCm GPU, whose Triton backend has no minimum) take any size."""
    if torch.device(device).type != "cuda" or torch.version.hip is not None:
        return
    least = min_dot_k(dtype)
    for name in ("TILE", "D_PAD"):
        if cfg[name] < least:
            raise ValueError(f"paged_attention: {name} = {cfg[name]}, but tl.dot on an NVIDIA GPU sums over at "
                             f"least {least} values for {dtype} inputs (the kernel's dots sum over TILE and D_PAD)"
                             + (f": pass tile >= {least}" if name == "TILE" else ""))


# a GPU launch's warps per program and software-pipeline depth (bench attention's --num-warps, --num-stages sweep
# them; the interpreter drops both). Kept after one sweep on an H200 (chapter 07, section 9.2): at 64 x 2048, tile
# 128 with 4 warps and 2-4 stages was the best one-pass launch: the tile, not these two, made the difference, and
# the defaults stay (section 9.3)
NUM_WARPS, NUM_STAGES = 4, 2


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, query_block_index=None,
                    block_m: int | None = None, tile: int = 64, num_warps: int = NUM_WARPS,
                    num_stages: int = NUM_STAGES, partition_size: int | None = None) -> torch.Tensor:
    """q (num_tokens, H, D), k_cache/v_cache (Hkv, num_blocks, block_size, D) -> out (num_tokens, H, D).

    Sequence i's queries are tokens cu_seqlens_q[i]:cu_seqlens_q[i+1], the last of its seq_lens[i]
    positions; its keys are found through block_tables[i]. `query_block_index` (from query_blocks, with
    the same BLOCK_Q) can be built once per step, moved to q's device, and passed to every layer's call.
    block_m, tile: see launch_config; num_warps, num_stages: see check_warps_and_stages;
    partition_size: None, one pass, or split-KV over partitions of that many keys (see check_partition_size).
    """
    # this module's three rungs, looked up here at call time: in a learner's copy, the learner's (or,
    # for a rung not done yet, the reference's that nanoserve/student.py put in its place)
    return launch(paged_attention_kernel, online_softmax_step, load_kv_tile, q, k_cache, v_cache, block_tables,
                  seq_lens, cu_seqlens_q, query_block_index, block_m, tile, num_warps, num_stages, partition_size)


def check_warps_and_stages(num_warps: int, num_stages: int) -> None:
    """A GPU launch's warps per program (a power of two, at most 32: 1024 threads, a CTA's most) and its
    software-pipeline depth (tiles loaded ahead while one is computed, at least 1). ValueError otherwise;
    the interpreter drops both, but a value no GPU would take is refused there too."""
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"paged_attention: num_warps = {num_warps}, but a program has a power of two of warps, "
                         "1 to 32")
    if num_stages < 1:
        raise ValueError(f"paged_attention: num_stages = {num_stages}, but the pipeline is at least 1 stage deep")


def check_partition_size(partition_size: int | None, tile: int) -> None:
    """Split-KV's partition: None (no split), or a power of two of keys that is a whole number of tiles, so
    that no tile straddles two partitions (both powers of two: partition_size >= tile). ValueError otherwise."""
    if partition_size is None:
        return
    if partition_size < 1 or partition_size & (partition_size - 1):
        raise ValueError(f"paged_attention: partition_size = {partition_size}, but a partition is a power of two "
                         "of keys")
    if partition_size % tile:
        raise ValueError(f"paged_attention: partition_size = {partition_size}, but a partition is a whole number of "
                         f"tiles, and tile = {tile}")


def launch(kernel, step, kv_tile, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, query_block_index=None,
           block_m: int | None = None, tile: int = 64, num_warps: int = NUM_WARPS,
           num_stages: int = NUM_STAGES, partition_size: int | None = None) -> torch.Tensor:
    """Launch `kernel` (paged_attention_kernel's signature) over the grid (query blocks, kv heads) with
    `step` (online_softmax_step's) as its tile update and `kv_tile` (load_kv_tile's) as its block walk:
    Triton takes a jit function as a constexpr argument and compiles it into the kernel. With a partition_size,
    split-KV instead: this module's paged_attention_split_kernel (not `kernel`) over (query blocks, kv heads,
    partitions) with the same `step` and `kv_tile`, then combine_partitions_kernel."""
    for fn in (kernel, step, kv_tile) if partition_size is None else (paged_attention_split_kernel,
                                                                      combine_partitions_kernel, step, kv_tile):
        check_launchable(fn, q.device)
    check_warps_and_stages(num_warps, num_stages)
    check_partition_size(partition_size, tile)
    N, H, D = q.shape
    Hkv, _, block_size, _ = k_cache.shape
    if H % Hkv or k_cache.shape[-1] != D or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:  # the kernel reads V with K's strides
        raise ValueError(f"paged_attention: k_cache and v_cache need the same strides, the last 1: "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    cfg = launch_config(H, Hkv, D, block_m, tile)
    check_dot_sizes(cfg, k_cache.dtype, q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if query_block_index is None:
        query_block_index = query_blocks(cu_seqlens_q.tolist(), cfg["BLOCK_Q"])
    q_block_seq, q_block_start = (t.to(q.device) for t in query_block_index)  # no copy if already there
    out = torch.empty_like(q)
    if partition_size is not None:
        return split_kv(step, kv_tile, q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q,
                        (q_block_seq, q_block_start), cfg, num_warps, num_stages, partition_size)
    grid = (len(q_block_seq), Hkv)
    with stub_errors_unwrapped():
        kernel[grid](
            q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, q_block_seq, q_block_start,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            D ** -0.5, STEP=step, KV_TILE=kv_tile, BLOCK_SIZE=block_size, num_warps=num_warps,
            num_stages=num_stages, **cfg,
        )
    return out


def split_kv(step, kv_tile, q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, query_block_index,
             cfg: dict, num_warps: int, num_stages: int, partition_size: int) -> torch.Tensor:
    """launch's split-KV path: the partials of every (query token, head, partition), then their combine."""
    N, H, D = q.shape
    Hkv, _, block_size, _ = k_cache.shape
    q_block_seq, q_block_start = query_block_index
    # partitions: enough for the widest block table, which holds every sequence's seq_len (AttentionMetadata.build
    # pads the table to the longest sequence's blocks). Read from the table's shape, not from seq_lens: no copy
    # back from the GPU, so a CUDA graph can capture the call. A sequence with fewer partitions writes (-inf, 0).
    num_partitions = max(1, -(-block_tables.shape[1] * block_size // partition_size))
    m = torch.empty(N, H, num_partitions, dtype=torch.float32, device=q.device)  # (N, H, P) running max
    l = torch.empty_like(m)  # (N, H, P): sum of exp(score - m)
    acc = torch.empty(N, H, num_partitions, D, dtype=torch.float32, device=q.device)  # (N, H, P, D) unnormalised
    with stub_errors_unwrapped():
        paged_attention_split_kernel[(len(q_block_seq), Hkv, num_partitions)](
            q, k_cache, v_cache, m, l, acc, block_tables, seq_lens, cu_seqlens_q, q_block_seq, q_block_start,
            q.stride(0), q.stride(1), m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            D ** -0.5, STEP=step, KV_TILE=kv_tile, BLOCK_SIZE=block_size, PARTITION=partition_size,
            num_warps=num_warps, num_stages=num_stages, **cfg,
        )
    combine_partitions_kernel[(N, H)](
        m, l, acc, out, num_partitions, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1), HEAD_DIM=D, D_PAD=cfg["D_PAD"], P_PAD=triton.next_power_of_2(num_partitions),
    )
    return out
