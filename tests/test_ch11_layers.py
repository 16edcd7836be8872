"""Chapter 11 — the sharded layers in one process: a fake group stands in for torch.distributed, and every
rank's shard is run by hand. The reference is the whole layer (an nn.Linear, an nn.Embedding) and, for the
heads, counts worked out by hand. Graded: 11.1 split_heads, 11.2 column-, 11.3 row-parallel, 11.4 the
vocabulary (each rung alone: the reference stands in for the others)."""

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from nanoserve.distributed.shard import HeadSplit
from nanoserve.model import LlamaConfig
from nanoserve.student import implementation
from tests.test_student import exercises  # noqa: F401  (a fixture: a copy of exercises/ the loader reads)
from tests.tiny_model import write_llama_gguf


class FakeGroup:
    """Rank `rank` of `size`, in one process: all_reduce and gather return this rank's part unchanged,
    so the test itself adds (or concatenates) the parts — the sum a real all_reduce would compute."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def all_reduce(self, x):
        return x

    def gather(self, x):
        return x


def ranks(n):
    return [FakeGroup(r, n) for r in range(n)]


class GatherWorld:
    """n fake ranks whose gather really gathers: rank r's gather keeps its part; rank 0's (run last) returns
    every part side by side, in rank order, the others None — as torch.distributed.gather to rank 0."""

    def __init__(self, n):
        self.parts = {}
        self.ranks = [FakeGroup(r, n) for r in range(n)]
        for tp in self.ranks:
            tp.gather = lambda x, r=tp.rank: self._gather(r, x)

    def _gather(self, rank, x):
        self.parts[rank] = x
        return torch.cat([self.parts[r] for r in range(len(self.ranks))], dim=-1) if rank == 0 else None


@pytest.mark.exercise("11.2")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_column_parallel_holds_output_rows_and_concatenates(n):
    L = implementation("nanoserve.distributed.linear")
    torch.manual_seed(n)
    W, x = torch.randn(12, 5), torch.randn(4, 5)
    shards = [L.ColumnParallelLinear(5, 12, tp) for tp in ranks(n)]
    # the slice each rank holds, by hand: rows r·12/n .. of W (dim 0), what the model's fused layers read off it
    assert [(s.shard_dim, s.shard_offset, s.shard_size) for s in shards] == [(0, r * 12 // n, 12 // n) for r in range(n)]
    for s in shards:
        s.weight_loader(W)
    assert [tuple(s.weight.shape) for s in shards] == [(12 // n, 5)] * n
    assert torch.equal(torch.cat([s.weight for s in shards]), W)  # rank r holds rows r·12/n ..
    out = torch.cat([s(x) for s in shards], dim=-1)  # each rank: its slice of the output features
    torch.testing.assert_close(out, F.linear(x, W))


@pytest.mark.exercise("11.2")
def test_column_parallel_replicated_kv_slices():
    """4 ranks over 2 KV heads (head_dim 3): ranks 0, 1 hold KV head 0, ranks 2, 3 KV head 1."""
    L = implementation("nanoserve.distributed.linear")
    W = torch.arange(6 * 2, dtype=torch.float32).view(6, 2)
    for tp in ranks(4):
        s = L.ColumnParallelLinear(2, 6, tp, num_shards=2, shard_index=tp.rank * 2 // 4)
        assert (s.shard_dim, s.shard_offset, s.shard_size, tuple(s.weight.shape)) == (0, 3 * (tp.rank // 2), 3, (3, 2))
        s.weight_loader(W)
        assert torch.equal(s.weight, W[3 * (tp.rank // 2):3 * (tp.rank // 2) + 3])


@pytest.mark.exercise("11.2")
@pytest.mark.parametrize("n", [2, 4])
def test_fused_layers_take_their_slices_from_your_constructor(n):
    """What of 11.2 serves: the model's q/k/v and gate/up are fused layers (the reference's) that build a
    ColumnParallelLinear per part and keep its (shard_offset, shard_size) as `part_slices`. 4 query / 2 KV heads of
    head_dim 3, hidden 5: at TP 2 the KV heads are sharded, at TP 4 each is replicated on 2 ranks. Each rank's fused
    weight must be its rows of q, k and v (of gate and up), cut here by hand."""
    from nanoserve.distributed.linear import MergedColumnParallelLinear, QKVParallelLinear

    L = implementation("nanoserve.distributed.linear")
    torch.manual_seed(20 + n)
    Wq, Wk, Wv, Wg, Wu = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5), torch.randn(8, 5), torch.randn(8, 5)
    kv_shards, q, g = min(n, 2), 12 // n, 8 // n  # distinct KV slices; query and gate rows per rank
    k = 6 // kv_shards  # k (and v) rows per KV slice
    for tp in ranks(n):
        kv = tp.rank * kv_shards // n  # ranks 0, 1 | 2, 3 share KV head 0 | 1 at TP 4
        qkv = QKVParallelLinear(5, 3, 4, 2, tp, kv_shards, kv, column=L.ColumnParallelLinear)
        gate_up = MergedColumnParallelLinear(5, [8, 8], tp, column=L.ColumnParallelLinear)
        assert qkv.part_slices == [(tp.rank * q, q), (kv * k, k), (kv * k, k)]
        assert gate_up.part_slices == [(tp.rank * g, g)] * 2
        for i, w in enumerate((Wq, Wk, Wv)):
            qkv.weight_loader(w, i)
        for i, w in enumerate((Wg, Wu)):
            gate_up.weight_loader(w, i)
        rows = lambda W, i, size: W[i * size:(i + 1) * size]  # noqa: E731
        assert torch.equal(qkv.weight, torch.cat([rows(Wq, tp.rank, q), rows(Wk, kv, k), rows(Wv, kv, k)]))
        assert torch.equal(gate_up.weight, torch.cat([rows(Wg, tp.rank, g), rows(Wu, tp.rank, g)]))


@pytest.mark.exercise("11.3")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_row_parallel_partial_sums_add_up(n):
    L = implementation("nanoserve.distributed.linear")
    torch.manual_seed(10 + n)
    W, x = torch.randn(7, 12), torch.randn(4, 12)
    shards = [L.RowParallelLinear(12, 7, tp) for tp in ranks(n)]
    # the slice the GGUF loader reads, by hand: columns r·12/n .. of W (dim 1)
    assert [(s.shard_dim, s.shard_offset, s.shard_size) for s in shards] == [(1, r * 12 // n, 12 // n) for r in range(n)]
    for s in shards:
        s.weight_loader(W)
    assert [tuple(s.weight.shape) for s in shards] == [(7, 12 // n)] * n
    assert torch.equal(torch.cat([s.weight for s in shards], dim=1), W)  # rank r holds columns r·12/n ..
    parts = [s(xr) for s, xr in zip(shards, x.chunk(n, dim=-1))]  # rank r sees its slice of the input
    assert all(p.shape == (4, 7) for p in parts)
    torch.testing.assert_close(sum(parts), F.linear(x, W))  # what the all_reduce adds up


@pytest.mark.exercise("11.2")
def test_column_parallel_refuses_features_that_do_not_split():
    """12 output features over 5 shards (and 5 over 2 replicated-KV shards): a ValueError naming the counts."""
    L = implementation("nanoserve.distributed.linear")
    with pytest.raises(ValueError, match=r"12.*5|5.*12"):
        L.ColumnParallelLinear(4, 12, FakeGroup(0, 5))
    with pytest.raises(ValueError, match=r"5.*2|2.*5"):
        L.ColumnParallelLinear(4, 5, FakeGroup(0, 4), num_shards=2, shard_index=0)


@pytest.mark.exercise("11.3")
def test_row_parallel_refuses_features_that_do_not_split():
    """7 input features over 2 ranks: a ValueError naming the counts."""
    L = implementation("nanoserve.distributed.linear")
    with pytest.raises(ValueError, match=r"7.*2|2.*7"):
        L.RowParallelLinear(7, 4, FakeGroup(1, 2))


@pytest.mark.exercise("11.3")
def test_column_then_row_is_the_whole_mlp():
    """The Megatron MLP: gate/up column-parallel, SiLU·up per slice, down row-parallel; one sum at the end."""
    L = implementation("nanoserve.distributed.linear")
    torch.manual_seed(0)
    Wg, Wu, Wd, x = torch.randn(8, 6), torch.randn(8, 6), torch.randn(6, 8), torch.randn(3, 6)
    total = 0
    for tp in ranks(2):
        gate, up, down = L.ColumnParallelLinear(6, 8, tp), L.ColumnParallelLinear(6, 8, tp), L.RowParallelLinear(8, 6, tp)
        for layer, w in ((gate, Wg), (up, Wu), (down, Wd)):
            layer.weight_loader(w)
        total = total + down(F.silu(gate(x)) * up(x))
    torch.testing.assert_close(total, F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd))


@pytest.mark.exercise("11.4")
@pytest.mark.parametrize("vocab,n,sizes", [(256, 3, [86, 86, 84]), (10, 4, [3, 3, 3, 1]), (12, 2, [6, 6]), (7, 1, [7]),
                                           (5, 4, [2, 2, 1, 0])])
def test_vocab_parallel_embedding_and_lm_head(vocab, n, sizes):
    """sizes: each rank's rows of the real vocabulary, by hand (ceil(V / n) rows each, the last ones padded; V = 5
    over 4 ranks: rank 3 holds padding alone, from row 6, past the vocabulary)."""
    V = implementation("nanoserve.distributed.vocab")
    torch.manual_seed(vocab)
    W = torch.randn(vocab, 5)
    ids = torch.tensor([0, vocab - 1, 3, vocab // 2, 3])
    embeds = [V.VocabParallelEmbedding(vocab, 5, tp) for tp in ranks(n)]
    world = GatherWorld(n)
    heads = [V.ParallelLMHead(vocab, 5, tp) for tp in world.ranks]
    for layer in embeds + heads:
        layer.weight_loader(W)
    per_rank = sizes[0]
    assert [tuple(e.weight.shape) for e in embeds] == [(per_rank, 5)] * n  # padded to equal shards
    # the rows the GGUF loader reads for each rank (the LM head's the same): dim 0, from r · per_rank
    for layers in (embeds, heads):
        assert [(e.shard_dim, e.shard_offset, e.shard_size) for e in layers] == \
            [(0, r * per_rank, size) for r, size in enumerate(sizes)]
    assert torch.equal(torch.cat([e.weight for e in embeds])[vocab:], torch.zeros(n * per_rank - vocab, 5))
    # every id is looked up by exactly one rank, the others add zeros: the all_reduce's sum
    torch.testing.assert_close(sum(e(ids) for e in embeds), F.embedding(ids, W))
    h = torch.randn(2, 5)
    outs = [head(h) for head in reversed(heads)]  # ranks n-1 .. 0: rank 0 gathers last
    assert all(o is None for o in outs[:-1])
    torch.testing.assert_close(outs[-1], h @ W.T)  # (2, vocab): the padding's logits cut off


@pytest.mark.exercise("11.4")
def test_embedding_returns_its_all_reduce():
    """The embedding's forward hands its masked rows to the group's all_reduce, once, and returns what that returns
    (the sum over ranks): a fake whose all_reduce doubles its input tells a forward that skips it, or drops its
    result, from one that does not."""
    V = implementation("nanoserve.distributed.vocab")

    class Doubling(FakeGroup):
        calls = 0

        def all_reduce(self, x):
            Doubling.calls += 1
            return 2 * x

    W = torch.arange(1.0, 13.0).view(6, 2)
    embeds = [V.VocabParallelEmbedding(6, 2, Doubling(r, 2)) for r in range(2)]
    for e in embeds:
        e.weight_loader(W)
    ids = torch.tensor([0, 5, 3])
    torch.testing.assert_close(sum(e(ids) for e in embeds), 2 * F.embedding(ids, W))
    assert Doubling.calls == 2  # one all_reduce per rank and forward


@pytest.mark.exercise("11.4")
def test_embedding_ignores_ids_of_other_ranks():
    """An id outside a rank's rows gives zeros there, whatever that rank's table holds: no wrap-around, no
    index error."""
    V = implementation("nanoserve.distributed.vocab")
    W = torch.arange(1.0, 13.0).view(6, 2)
    rank1 = V.VocabParallelEmbedding(6, 2, FakeGroup(1, 2))  # rows 3, 4, 5
    rank1.weight_loader(W)
    assert torch.equal(rank1(torch.tensor([0, 2, 3, 5])), torch.tensor([[0.0, 0], [0, 0], [7, 8], [11, 12]]))


@pytest.mark.exercise("11.1")
def test_split_heads_shards_replicates_or_refuses():
    split_heads = implementation("nanoserve.distributed.shard").split_heads
    smol = LlamaConfig()  # 9 query / 3 KV heads
    assert split_heads(smol, 1) == HeadSplit(9, 3, 1)
    assert split_heads(smol, 3) == HeadSplit(3, 1, 3)
    assert split_heads(smol, 9) == HeadSplit(1, 1, 3)  # each KV head on 3 ranks
    assert [split_heads(smol, 9).kv_shard(r, 9) for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    llama8b = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    assert [split_heads(llama8b, n).num_kv_heads for n in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    assert [split_heads(llama8b, n).num_kv_shards for n in (1, 2, 4, 8, 16, 32)] == [1, 2, 4, 8, 8, 8]
    assert split_heads(llama8b, 16).num_heads == 2


@pytest.mark.exercise("11.1")
def test_split_heads_refuses_uneven_splits_naming_the_counts():
    split_heads = implementation("nanoserve.distributed.shard").split_heads
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*num_attention_heads=9"):
        split_heads(LlamaConfig(), 2)  # 9 query heads do not split over 2
    tiny = LlamaConfig.tiny(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*num_key_value_heads=3"):
        split_heads(tiny, 2)  # 6 query heads do, but 3 KV heads neither split over 2 nor 2 ranks over 3
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        split_heads(tiny, 0)


def test_finished_rungs_of_exercise_11_build_the_shards(exercises):
    """--student 11 with 11.1, 11.3 and 11.4 done and 11.2 stubbed: a shard is built by the learner's split_heads,
    RowParallelLinear and vocabulary layers, and the reference's ColumnParallelLinear; at TP 1 it computes the
    whole model's logits."""
    from nanoserve.distributed.parallel_state import TPGroup
    from nanoserve.distributed.shard import linear_layers_for, load_shard_from_state, shard_llama
    from nanoserve.model import Llama

    from tests.test_student import finish

    finish("nanoserve.distributed.shard", ["split_heads"])
    finish("nanoserve.distributed.vocab", ["VocabParallelEmbedding.__init__", "VocabParallelEmbedding.weight_loader",
                                           "VocabParallelEmbedding.forward", "ParallelLMHead.forward"])
    finish("nanoserve.distributed.linear", ["RowParallelLinear.__init__", "RowParallelLinear.weight_loader",
                                            "RowParallelLinear.forward"])
    torch.manual_seed(0)
    config = LlamaConfig.tiny(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192)
    full = Llama(config).eval()
    with pytest.warns(UserWarning, match="Exercise 11.2 not finished"):
        layers = linear_layers_for("11")
    shard = load_shard_from_state(shard_llama(config, TPGroup(), layers), full.state_dict())
    block = shard.layers[0]
    assert type(shard.embed_tokens).__module__ == type(shard.lm_head).__module__ == "student_nanoserve_distributed_vocab"
    assert type(block.mlp.down_proj).__module__ == "student_nanoserve_distributed_linear"
    # the fused gate_up / qkv layers are the reference's, their slices cut by ColumnParallelLinear (11.2: the reference's)
    assert type(block.mlp.gate_up_proj).__module__ == type(block.self_attn.qkv_proj).__module__ == "nanoserve.distributed.linear"
    assert layers.split_heads.__module__ == "student_nanoserve_distributed_shard"
    ids = torch.tensor([3, 1, 4, 1, 5])
    with torch.no_grad():
        torch.testing.assert_close(shard.compute_logits(shard(ids)), full.compute_logits(full(ids)))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_float_gguf_shards_by_columns_too(tmp_path, dtype):
    """An F32 / F16 GGUF at TP 2: every rank reads its own slice, the row-parallel layers' by columns. Each rank's
    shard equals the matrices written (o_proj, down_proj: their column halves) and the shard the whole model's
    state gives (every weight); the whole model is the TP 1 loader's."""
    from nanoserve.distributed.shard import load_shard_from_gguf, load_shard_from_state, shard_llama
    from nanoserve.model.gguf_loader import load_gguf

    config = LlamaConfig.tiny(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    path = tmp_path / "tiny-float.gguf"
    written = write_llama_gguf(path, config, dtype)
    full = load_gguf(path)
    for tp in ranks(2):
        shard = load_shard_from_gguf(path, tp)
        o, d = 64 // 2, 96 // 2  # each rank's columns of o_proj (64 inputs) and down_proj (96)
        for i, block in enumerate(shard.layers):
            assert np.array_equal(block.self_attn.o_proj.weight.detach().numpy(),
                                  written[f"blk.{i}.attn_output.weight"][:, tp.rank * o:(tp.rank + 1) * o])
            assert np.array_equal(block.mlp.down_proj.weight.detach().numpy(),
                                  written[f"blk.{i}.ffn_down.weight"][:, tp.rank * d:(tp.rank + 1) * d])
        expected = load_shard_from_state(shard_llama(full.config, tp), full.state_dict()).state_dict()
        assert expected.keys() == shard.state_dict().keys()
        for name, weight in shard.state_dict().items():
            assert torch.equal(weight, expected[name]), name




def test_a_quantized_slice_of_columns_must_fall_on_blocks():
    """read_gguf_slice on SmolLM2's Q4_1 down_proj (576 × 1536, blocks of 32 weights along a row): columns 32:64 are
    the second block of every row, the same as the whole matrix dequantized (gguf.dequantize) and then cut; columns
    16:48 would split blocks, and are refused with a ValueError that names the tensor. Rows are any slice."""
    from gguf import dequantize

    from nanoserve.distributed.shard import read_gguf_slice
    from nanoserve.model.gguf_loader import embedded_gguf_path, open_gguf

    (t,) = [t for t in open_gguf(embedded_gguf_path()).tensors if t.name == "blk.0.ffn_down.weight"]
    assert t.tensor_type.name == "Q4_1"
    whole = dequantize(t.data, t.tensor_type)  # (576, 1536)
    assert np.array_equal(read_gguf_slice(t, 1, 32, 32), whole[:, 32:64])
    assert np.array_equal(read_gguf_slice(t, 0, 5, 7), whole[5:12])
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight: columns 16:48 do not fall on 32-weight blocks"):
        read_gguf_slice(t, 1, 16, 32)

def layers_with_yours(rung):
    """The layers shard_llama builds from (as `linear_layers_for` gives them): YOUR RowParallelLinear for rung 11.3,
    YOUR vocabulary layers for 11.4 (when graded; the reference's otherwise), the reference's for the rest."""
    from types import SimpleNamespace

    from nanoserve.distributed import linear, shard, vocab

    row = implementation("nanoserve.distributed.linear") if rung == "11.3" else linear
    words = implementation("nanoserve.distributed.vocab") if rung == "11.4" else vocab
    return SimpleNamespace(**{**vars(linear), **vars(row)}, VocabParallelEmbedding=words.VocabParallelEmbedding,
                           ParallelLMHead=words.ParallelLMHead, split_heads=shard.split_heads)


@pytest.mark.parametrize("rung", [pytest.param("11.3", marks=pytest.mark.exercise("11.3")),
                                  pytest.param("11.4", marks=pytest.mark.exercise("11.4"))])
def test_your_layers_read_their_slice_of_a_gguf(tmp_path, rung):
    """What `--student 11` serves from the real model: the GGUF loader reads each row-parallel and vocabulary layer's
    slice straight from the file at its (shard_dim, shard_offset, shard_size). A float32 GGUF at TP 2, loaded with
    YOUR RowParallelLinear (11.3) or YOUR vocabulary layers (11.4): each rank holds the columns of o_proj and
    down_proj, or the rows of the embedding and the LM head (101 over 2 ranks: 51 + 50, one zero row of padding),
    of the matrices written, cut here by hand."""
    from nanoserve.distributed.shard import load_shard_from_gguf

    config = LlamaConfig.tiny(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                              vocab_size=101)
    written = write_llama_gguf(tmp_path / "tiny.gguf", config, np.float32)
    layers = layers_with_yours(rung)
    for tp in ranks(2):
        shard = load_shard_from_gguf(tmp_path / "tiny.gguf", tp, layers)
        got = lambda layer: layer.weight.detach().numpy()  # noqa: E731
        if rung == "11.3":
            o, d = 64 // 2, 96 // 2  # each rank's columns of o_proj (64 inputs) and down_proj (96)
            for i, block in enumerate(shard.layers):
                assert np.array_equal(got(block.self_attn.o_proj), written[f"blk.{i}.attn_output.weight"][:, tp.rank * o:][:, :o])
                assert np.array_equal(got(block.mlp.down_proj), written[f"blk.{i}.ffn_down.weight"][:, tp.rank * d:][:, :d])
        else:
            for layer, name in ((shard.embed_tokens, "token_embd.weight"), (shard.lm_head, "output.weight")):
                want = np.zeros((51, 64), np.float32)
                rows = written[name][tp.rank * 51:(tp.rank + 1) * 51]  # rank 1: rows 51..100, then padding
                want[:len(rows)] = rows
                assert np.array_equal(got(layer), want), name

def test_shards_are_built_without_initialising_only_in_their_own_thread():
    """shard_llama builds inside SkipInit, which skips torch.nn.init in the thread that entered it and nowhere
    else: an nn.Embedding built meanwhile in another thread gets its usual seeded normal_() weights."""
    import threading

    from nanoserve.distributed.shard import SkipInit

    torch.manual_seed(0)
    usual = torch.nn.Embedding(50, 4).weight.detach().clone()
    inside, built = threading.Event(), threading.Event()

    def build_a_shard():
        with SkipInit():
            inside.set()
            built.wait(60)  # stay inside while the other thread builds its embedding

    shard_thread = threading.Thread(target=build_a_shard)
    shard_thread.start()
    assert inside.wait(60)
    torch.manual_seed(0)
    meanwhile = torch.nn.Embedding(50, 4).weight.detach().clone()
    built.set()
    shard_thread.join()
    assert torch.equal(meanwhile, usual)
    torch.manual_seed(0)
    with SkipInit():
        torch.nn.Embedding(50, 4)  # inside: not initialised, so no random number is drawn
    assert torch.equal(torch.randn(50, 4), usual)
