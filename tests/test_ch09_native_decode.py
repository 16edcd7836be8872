"""Chapter 09 — the native decode step (kernels/cpu_decode.c, up to max_rows sequences' one token each)
against the eager q4 step it replaces, and a B-row step against each row's batch-1 step (bit for bit).

The eager step it is checked against: the same model, q4 layers with integer_dot on (cpu_dot.c's products, the
very functions cpu_decode.c includes), on a PagedKVCache through chapter 05's PagedAttention. Both run the
same integer products; what differs is float32 rounding around them (a norm's sum in another order, FMA
contraction, cosf / expf against torch's). Such a difference of ~1e-7 relative is all there is until it moves
an activation across an int8 rounding boundary (p = round(x / dx)): that element of the product's input then
moves by one step dx = max|x| / 127 of its block, and the output by that times the weight.

Tolerances, as the largest difference over the largest |value| of the tensor compared (REL):
  float32 pool: 1e-4. On the tiny model no activation of the steps compared with the eager one crosses a
      boundary (measured: 5e-7, float32 rounding); the margin is for another compiler's rounding, not for a
      crossing, which would fail it. The 9-row step below has one (1.6e-3), so that case checks only that each row
      is bit for bit its batch-1 step, which the other cases check against the eager step.
  bf16 pool: 5e-2. The eager step's attention runs in bf16 (torch's attention on bf16 q, K, V rounds inside),
      the C step's in float32 over the same bf16 K, V; through the next int8 rounding and the two layers that
      gave up to 2.1 % (logits 1.6 %, K 1.5 %, V 2.1 %). The C step's own bf16 casts (q, this token's k and v,
      the attention output: cpu_decode.c) are each far smaller than that, so this case does not check them: it
      checks the step on a bf16 pool as a whole (the pool's layout, reads and writes) at that tolerance, and the
      float32 case is the close check of the arithmetic.
On the real SmolLM2 crossings do happen (its residual stream has outliers of several hundred, so dx is large):
the K it stores agreed to float32 rounding through layer 14 and then by up to 0.14 in values of ~15, logits
by up to 1 in ~20, with the greedy token the same at all but near-ties; the slow test below holds it to
test_ch10_model's bar against float32. Greedy tokens are compared as the eager step's own argmax or within a
near-tie of it (MARGIN, a fraction of the row's largest |logit|): on a float32 pool the step's own tolerance,
REL; on a bf16 pool 2 %, since the pool's rounding moves the logits from the uncached float32 forward's by about
as much as the bf16 case above measured (1.6 %). On these prompts every token was the exact argmax in both
(gap 0, with top-1 minus top-2 down to 0.005 where the largest |logit| is 0.60).
"""

import pytest
import torch

from nanoserve.kernels import cpu_decode
from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache
from nanoserve.model.layers import Linear
from nanoserve.model.quant import quantize_model
from nanoserve.sampling import SamplingParams
from tests.test_ch10_quant import q4_1_blocks
from tests.tiny_model import tiny_llama

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason=f"kernels/cpu_decode.c does not run here "
                                f"({cpu_decode.build_error()}): install gcc with OpenMP on an AVX2 CPU")

REL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # by the pool's dtype (module docstring)
MARGIN = {"fp32": REL[torch.float32], "bf16": 2e-2}  # a near-tie, over the row's largest |logit| (module docstring)


def tiny_q4(model=None):
    """The tiny random model (or `model`) with its Linear layers in Q4_1 (the gguf package's quantizer) and
    integer_dot on."""
    model = tiny_llama() if model is None else model
    blocks = {name: q4_1_blocks(m.weight.detach().numpy()) for name, m in model.named_modules()
              if isinstance(m, Linear) and name != "lm_head"}
    return quantize_model(model, "q4", blocks, integer_dot=True)


def pool(model, dtype, num_blocks=12, block_size=4):
    c = model.config
    return PagedKVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype)


def assert_close(got, want, what, rel):
    err, scale = (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()
    assert err <= rel * scale, f"{what}: max difference {err:.3g} against max |value| {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_native_step_computes_the_eager_step_and_stores_the_same_kv(dtype):
    """A 3-token prompt, then 12 one-token steps (positions 3..14: across the block boundaries at 4, 8 and 12)
    through a block table out of order; the same tokens fed to both (teacher-forced)."""
    model = tiny_q4()
    eager_pool, native_pool = pool(model, dtype), pool(model, dtype)
    table, bs = [7, 2, 9, 0], 4
    tokens = torch.randint(0, model.config.vocab_size, (15,), generator=torch.Generator().manual_seed(1))
    for p in (eager_pool, native_pool):  # the prompt, by the model's forward in both
        model(tokens[:3], torch.arange(3), PagedAttention(p, AttentionMetadata.build([table], [3], [3], bs)))
    assert cpu_decode.NativeDecoder.why_not(model, native_pool) == ""
    native = cpu_decode.NativeDecoder(model, native_pool)
    for pos in range(3, 15):
        meta = AttentionMetadata.build([table], [pos + 1], [1], bs)
        want = model.compute_logits(model(tokens[pos:pos + 1], torch.tensor([pos]), PagedAttention(eager_pool, meta)))
        hidden = native.step(tokens[pos:pos + 1], torch.tensor([pos]),
                             meta.block_tables, meta.seq_lens, meta.slot_mapping)
        assert_close(native.logits(hidden), want, f"logits at position {pos}", REL[dtype])
        slot = int(meta.slot_mapping[0])
        for layer in range(model.config.num_hidden_layers):
            for name in ("k_cache", "v_cache"):
                got, exp = (getattr(p, name)[layer].view(model.config.num_key_value_heads, -1, model.config.head_dim)[:, slot]
                            for p in (native_pool, eager_pool))
                assert got.dtype == dtype
                assert_close(got, exp, f"{name}[{layer}] at position {pos}", REL[dtype])
    for name in ("k_cache", "v_cache"):  # and nothing else of the pool was written
        for got, exp in zip(getattr(native_pool, name), getattr(eager_pool, name)):
            untouched = torch.ones(got.shape[1], dtype=torch.bool)
            untouched[table] = False
            assert torch.equal(got[:, untouched], exp[:, untouched]) and not got[:, untouched].any()


FIVE, NINE = [2, 5, 8, 3, 11], [2, 5, 8, 3, 11, 1, 9, 6, 4]


@pytest.mark.parametrize("lens", [FIVE, NINE], ids=["5 rows", "9 rows"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_batched_native_step_is_each_rows_batch_1_step_bit_for_bit(dtype, threads, lens):
    """5 or 9 sequences of different lengths (1 to 11 tokens of prompt; 9 rows are a full tile of 8 in cpu_dot.c's
    products and one more, 5 a part tile), block tables out of order, 4 one-token steps (across block
    boundaries): the B-row native step on one pool, each row's batch-1 native step on another, the eager
    forward's batched step on a third. Row r's logits and the K/V it stores equal its batch-1 step's (torch.equal:
    cpu_decode.c's invariant); for the 5 rows the step is also close to the eager one (the tolerance above: no
    activation of theirs crosses an int8 boundary; one of the 9's does, 1.6e-3 of the largest logit). At one
    thread and at two (the C step takes torch's thread count; make test's workers run one): with two, the threads
    split the output rows and the (row, head) pairs of the attention differently at B rows than at 1."""
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_batched_against_batch_1(dtype, lens, against_eager=lens is FIVE)
    finally:
        torch.set_num_threads(was)


def check_batched_against_batch_1(dtype, lens, against_eager: bool):
    model = tiny_q4()
    c, bs = model.config, 4
    order = torch.randperm(4 * len(lens), generator=torch.Generator().manual_seed(2)).tolist()
    tables = [order[4 * i:4 * i + 4] for i in range(len(lens))]  # 4 blocks each: up to 16 tokens
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, c.vocab_size, (n + 4,), generator=gen) for n in lens]
    batched, single, eager = (pool(model, dtype, num_blocks=4 * len(lens), block_size=bs) for _ in range(3))
    for p in (batched, single, eager):  # the prompts, by the model's forward in all three
        model(torch.cat([t[:n] for t, n in zip(tokens, lens)]), torch.cat([torch.arange(n) for n in lens]),
              PagedAttention(p, AttentionMetadata.build(tables, lens, lens, bs)))
    native_b, native_1 = cpu_decode.NativeDecoder(model, batched), cpu_decode.NativeDecoder(model, single)
    for step in range(4):
        pos = [n + step for n in lens]
        ids, positions = torch.stack([t[p] for t, p in zip(tokens, pos)]), torch.tensor(pos)
        meta = AttentionMetadata.build(tables, [p + 1 for p in pos], [1] * len(lens), bs)
        got = native_b.logits(native_b.step(ids, positions, meta.block_tables, meta.seq_lens, meta.slot_mapping))
        for r, p in enumerate(pos):
            one = AttentionMetadata.build([tables[r]], [p + 1], [1], bs)
            want = native_1.logits(native_1.step(ids[r:r + 1], positions[r:r + 1], one.block_tables, one.seq_lens,
                                                 one.slot_mapping))
            assert torch.equal(got[r:r + 1], want), f"step {step}, row {r}: not its batch-1 step's logits"
        for name in ("k_cache", "v_cache"):  # every layer's pool, the rows' new K/V included
            assert all(torch.equal(a, b) for a, b in zip(getattr(batched, name), getattr(single, name))), name
        if not against_eager:
            continue
        want = model.compute_logits(model(ids, positions, PagedAttention(eager, meta)))
        assert_close(got, want, f"logits at step {step}", REL[dtype])
        for name in ("k_cache", "v_cache"):
            for layer, (a, b) in enumerate(zip(getattr(batched, name), getattr(eager, name))):
                assert_close(a, b, f"{name}[{layer}] at step {step}", REL[dtype])


def greedy(model, prompts, native: bool, max_tokens=12, **config):
    from nanoserve.llm import LLM

    model.native_decode = native
    llm = LLM(model, num_blocks=64, block_size=4, **config)
    runner = llm.engine.executor.workers[0].model_runner if hasattr(llm.engine, "executor") else None
    outs = [llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)[0].token_ids for p in prompts]  # one at a time: every decode is batch 1
    return outs, runner


def assert_eager_argmax_or_near_tie(model, prompts, outs, kv_cache_dtype):
    """Every greedy token is the eager q4 model's argmax over the same prefix (no cache, teacher-forced), or within
    MARGIN of it (a near-tie)."""
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor(prompt + out)
        logits = model.compute_logits(model(ids))[len(prompt) - 1:-1]  # (max_tokens, vocab): row i predicts out[i]
        picked = logits[torch.arange(len(out)), torch.tensor(out)]
        gap = logits.max(-1).values - picked
        tie = MARGIN[kv_cache_dtype] * logits.abs().max(-1).values
        assert (gap <= tie).all(), f"tokens off the eager argmax by more than a near-tie: {gap.tolist()}"


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "bf16"])
@torch.inference_mode()
def test_the_engine_takes_the_native_step_and_decodes_what_the_eager_step_would(kv_cache_dtype):
    """Greedy, one request at a time through the engine with native_decode on: every token is the eager q4
    model's argmax over the same prefix (no cache, teacher-forced), or within MARGIN of it (a near-tie)."""
    model = tiny_q4()
    prompts = [list(range(5, 5 + n)) for n in (3, 6, 9)]
    outs, runner = greedy(model, prompts, True, kv_cache_dtype=kv_cache_dtype)
    assert runner is not None and [d for d in runner.native_decoders.values() if d is not None], \
        "the engine never built a native step"
    assert_eager_argmax_or_near_tie(model, prompts, outs, kv_cache_dtype)


def count_native_rows(monkeypatch) -> list[int]:
    """The row count of every native step from now on (NativeDecoder.step wrapped)."""
    rows, step = [], cpu_decode.NativeDecoder.step

    def counted(self, ids, *args):
        rows.append(ids.shape[0])
        return step(self, ids, *args)

    monkeypatch.setattr(cpu_decode.NativeDecoder, "step", counted)
    return rows


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "bf16"])
@torch.inference_mode()
def test_the_engine_takes_the_native_step_for_concurrent_requests(kv_cache_dtype, monkeypatch):
    """6 prompts of different lengths in one generate call: their decode steps are multi-row native steps (all 6
    rows together), and every greedy token is the eager q4 model's argmax over the same prefix or within MARGIN."""
    from nanoserve.llm import LLM

    model = tiny_q4()
    model.native_decode = True
    rows = count_native_rows(monkeypatch)
    prompts = [list(range(5, 5 + n)) for n in (3, 6, 9, 2, 11, 5)]
    llm = LLM(model, num_blocks=64, block_size=4, kv_cache_dtype=kv_cache_dtype)
    outs = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    assert max(rows, default=0) == len(prompts), f"native steps of {rows} rows: never all 6 requests in one"
    assert_eager_argmax_or_near_tie(model, prompts, outs, kv_cache_dtype)


@torch.inference_mode()
def test_a_step_of_more_than_native_decode_max_rows_runs_the_forward(monkeypatch):
    """17 concurrent requests: their decode steps of 17 one-token rows run the model's forward, not the C step
    (which refuses more than NATIVE_DECODE_MAX_ROWS rows itself too)."""
    from nanoserve.llm import LLM

    model = tiny_q4()
    model.native_decode = True
    rows, forward_rows = count_native_rows(monkeypatch), []
    model.register_forward_pre_hook(lambda module, args: forward_rows.append(args[0].shape[0]))
    n = cpu_decode.NATIVE_DECODE_MAX_ROWS + 1
    llm = LLM(model, num_blocks=128, block_size=4)
    outs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(n)],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 3 for o in outs)
    assert n in forward_rows, (forward_rows, rows)
    native = cpu_decode.NativeDecoder(model, pool(model, torch.float32))
    with pytest.raises(ValueError, match="rows"):
        native.step(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), torch.zeros(n, 1, dtype=torch.long),
                    torch.ones(n, dtype=torch.long), torch.arange(n))


@torch.inference_mode()
def test_one_token_requests_decode_together_exactly_as_alone(monkeypatch):
    """6 one-token prompts (each its own one-token row, so every step of the run is all one-token rows and native):
    generated together, each request's greedy tokens equal its tokens generated alone (==, not a near-tie): the
    engine-level form of the B-row step's bit-for-bit invariant. With longer prompts it need not hold: a prompt's
    chunk runs the forward, for every row of its step, and is prefilled beside other prompts."""
    from nanoserve.llm import LLM

    model = tiny_q4()
    model.native_decode = True
    rows, forward_rows = count_native_rows(monkeypatch), []
    model.register_forward_pre_hook(lambda module, args: forward_rows.append(args[0].shape[0]))
    prompts, params = [[5 + 7 * i] for i in range(6)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(model, num_blocks=64, block_size=4)
    together = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].token_ids for p in prompts]
    assert forward_rows == [] and max(rows) == len(prompts), (forward_rows, rows)  # every step native, 6 rows once
    assert together == alone


@torch.inference_mode()
def test_the_native_step_refuses_block_ids_outside_the_pool_and_negative_positions():
    """What the C code would read out of bounds (a block id of its tables, scores[-1] at position -1) is refused
    in Python before the call; the rows' slots are checked the same way (written unchecked)."""
    model = tiny_q4()
    kv = pool(model, torch.float32, num_blocks=12, block_size=4)
    native = cpu_decode.NativeDecoder(model, kv)
    ids, one = torch.tensor([5]), torch.tensor([1])
    for table in ([[12]], [[-1]]):  # the pool has blocks 0..11
        with pytest.raises(ValueError, match="block ids"):
            native.step(ids, torch.tensor([0]), torch.tensor(table), one, torch.tensor([0]))
    with pytest.raises(ValueError, match="negative positions"):
        native.step(ids, torch.tensor([-1]), torch.tensor([[0]]), torch.tensor([0]), torch.tensor([0]))
    two = (torch.tensor([5, 6]), torch.tensor([0, 4]))  # row 1: 5 tokens, so its table's second block is read
    with pytest.raises(ValueError, match="block ids"):
        native.step(*two, torch.tensor([[0, 3], [1, 12]]), torch.tensor([1, 5]), torch.tensor([0, 8]))
    native.step(*two, torch.tensor([[0, 3], [1, 2]]), torch.tensor([1, 5]), torch.tensor([0, 8]))  # in the pool: runs
    native.step(ids, torch.tensor([0]), torch.tensor([[0, 99]]), one, torch.tensor([0]))  # 99 never read: runs


@pytest.mark.parametrize("integer_dot, crossover, expected", [(True, 16, 16), (True, 4, 4), (True, 0, 1),
                                                             (False, 16, 1)])
@torch.inference_mode()
def test_several_rows_go_native_only_where_the_layers_take_cpu_dot(monkeypatch, integer_dot, crossover, expected):
    """cpu_decode.max_rows: a step of several rows goes native only where the q4 layers' own small steps are
    cpu_dot.c's (integer_dot), up to their crossover and NATIVE_DECODE_MAX_ROWS; batch 1 always. Six concurrent
    requests (5-token prompts) decode together to the end: their 6-row steps go native where the limit allows 6,
    else through the forward."""
    from nanoserve.llm import LLM

    model = tiny_q4()
    for m in model.modules():  # what LLM's kernel_crossover_tokens and integer_dot set on the q4 layers
        if hasattr(m, "integer_dot"):
            m.integer_dot, m.max_kernel_tokens = integer_dot, crossover
    assert cpu_decode.max_rows(model) == expected
    model.native_decode = True
    rows, forward_rows = count_native_rows(monkeypatch), []
    model.register_forward_pre_hook(lambda module, args: forward_rows.append(args[0].shape[0]))
    llm = LLM(model, num_blocks=128, block_size=4)
    llm.generate([{"prompt_token_ids": [5 + i, 6, 7, 8, 9]} for i in range(6)],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert max(rows, default=0) == (6 if expected >= 6 else 0), rows  # the six decode together to the end
    assert (6 in forward_rows) == (expected < 6), forward_rows


@torch.inference_mode()
def test_steps_it_cannot_run_fall_back_to_the_forward():
    model = tiny_q4()
    assert "q4 weights only" in cpu_decode.why_not_model(tiny_llama())  # float32 weights
    assert "KV pool" in cpu_decode.NativeDecoder.why_not(model, pool(model, torch.float16))
    outs, runner = greedy(model, [[5, 6, 7]], False)
    assert runner is not None and runner.native_decoders == {}  # off: never even looked at
    model.native_decode = True
    from nanoserve.llm import LLM

    llm = LLM(model, num_blocks=64, block_size=4, kv_cache_dtype="int8")  # chapter 18's quantized pool
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    assert all(d is None for d in llm.engine.executor.workers[0].model_runner.native_decoders.values())


def test_an_explicit_native_decode_is_refused_where_it_cannot_be_honoured():
    from nanoserve.llm import LLM

    with pytest.raises(ValueError, match="q4 weights"):
        LLM(weights="int8", native_decode=True)
    with pytest.raises(ValueError, match="integer_dot=False"):
        LLM(weights="q4", integer_dot=False, native_decode=True)
    with pytest.raises(ValueError, match="a model given"):
        LLM(tiny_llama(), native_decode=True)
    # the runner would pass these by (NativeDecoder.why_not, ModelRunner.native_decoder): refused before loading
    for settings, reason in [(dict(kv_cache_dtype="int8"), "kv_cache_dtype 'int8'"),
                             (dict(kv_cache_dtype="fp8"), "kv_cache_dtype 'fp8'"),
                             (dict(attention_backend="triton"), "triton attention backend"),
                             (dict(student="02"), "your chapter 02 blocks"),
                             (dict(student="05"), "your chapter 05 attention"),
                             (dict(student="10"), "your chapter 10 quantizer"),
                             (dict(enable_lora=True), "LoRA")]:
        with pytest.raises(ValueError, match=reason):
            LLM(weights="q4", native_decode=True, **settings)


@pytest.mark.parametrize("flags, native", [
    ([], True), (["--kv-cache-dtype", "fp32"], True), (["--native-decode", "off"], False),
    (["--kv-cache-dtype", "int8"], False), (["--kv-cache-dtype", "fp8"], False), (["--student", "02"], False),
    (["--student", "05"], False), (["--student", "10"], False), (["--integer-dot", "off"], False),
])
def test_serve_says_where_one_token_steps_run(flags, native):
    """serve's banner names cpu_decode.c exactly where LLM turns the native step on (native_decode_blocker), and
    `--native-decode on` is refused with the same settings that turn `auto` off."""
    import argparse

    from nanoserve.cli import serve
    from nanoserve.cli.batch import check_engine_args, native_settings
    from nanoserve.kernels.cpu_decode import native_decode_blocker

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", *flags])
    text = serve.serving_format(args)
    off = flags == ["--native-decode", "off"]
    assert ("one-token rows in kernels/cpu_decode.c" in text) == native
    if native:  # how many: 16 where the q4 layers' small steps are cpu_dot.c's (no native bf16), else 1
        from nanoserve.model.quant import default_integer_dot

        assert ("up to 16 one-token rows" if default_integer_dot() else "up to 1 one-token row in") in text, text
    assert ("one-token rows in the model's forward" in text) == (not native)
    assert ("(--native-decode off)" in text) == off
    assert (native_decode_blocker(*native_settings(args)) == "") == (native or off)
    if "--native-decode" not in flags:
        args.native_decode = "on"
        problem = check_engine_args(args)
        assert (problem is None) == native and (native or problem.startswith("--native-decode on: "))


@pytest.mark.slow
@torch.inference_mode()
def test_smollm2_greedy_with_the_native_step_agrees_with_float32(smollm2, smollm2_tokenizer):
    """test_ch10_model's bar for q4 (at least 4 of bench quality's 12 chat prompts identical to float32 over 16
    greedy tokens, half of all tokens before a prompt's first divergence), with every decode step native: each
    prompt alone, on a bf16 pool (the measured configuration)."""
    from nanoserve.bench.quality import CHAT_PROMPTS, first_divergence, greedy_outputs
    from nanoserve.llm import LLM
    from nanoserve.model import load_gguf

    fp32 = greedy_outputs(smollm2, smollm2_tokenizer, CHAT_PROMPTS, 16)
    q4 = load_gguf(weights="q4", integer_dot=True)
    q4.native_decode = True
    llm = LLM(q4, num_blocks=64, kv_cache_dtype="bf16")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = [llm.generate([[{"role": "user", "content": p}]], params, use_tqdm=False)[0].token_ids for p in CHAT_PROMPTS]
    assert [d for d in llm.engine.executor.workers[0].model_runner.native_decoders.values() if d is not None]
    div = [first_divergence(a, b) for a, b in zip(outs, fp32)]
    assert sum(d == 16 for d in div) >= 4, div
    assert sum(div) / (16 * len(div)) >= 0.5, div
