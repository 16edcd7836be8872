"""Chapter 11 — tensor parallelism for real: worker processes over gloo, compared with TP = 1 (the same
model in one process, chapter 06's engine), which is the reference for tokens and logits.

Tiny random models keep it affordable on 2 cores: 6 query / 3 KV heads (TP 3: KV heads sharded; TP 2:
refused) and 6 / 1 (TP 2: the one KV head replicated). One real-model test at TP 3 is marked slow."""

import os
import re
import signal
import time

import pytest
import torch

from nanoserve.distributed.parallel_state import STEP, STEP_FIELDS, WorkerError
from nanoserve.engine.config import KVTransferConfig, LoRAConfig
from nanoserve.engine.worker import Worker
from nanoserve.llm import LLM
from nanoserve.model import Llama, LlamaConfig
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation, use_student
from tests.test_student import exercises  # noqa: F401  (a fixture: a copy of exercises/ the loader reads)

# The tests count this process's children in /proc (Linux); CI runs them always.
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="checks for leftover worker processes "
                                "through Linux's /proc: run these tests on Linux (the course's CI does)")

POOL = dict(num_blocks=12, block_size=4)  # 48 token slots: the batch below must preempt
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 13 + i))} for i in range(4)]  # 10 tokens each
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tiny(num_kv_heads):
    torch.manual_seed(0)
    config = LlamaConfig.tiny(hidden_size=96, num_attention_heads=6, num_key_value_heads=num_kv_heads,
                              intermediate_size=192)
    model = Llama(config).eval()
    with torch.no_grad():  # wide enough that greedy decoding does not just repeat one token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def child_pids() -> set[int]:
    """This process's children, without Python's resource tracker (one per interpreter, started by the
    first spawn and shared by all of multiprocessing: not ours to stop)."""
    pids = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            pids |= {int(p) for p in f.read().split()}
    return {p for p in pids if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()}


def shm() -> set[str]:
    """/dev/shm's segments, less chapter 17's KV segments: tests of another file may stage those at the same time
    (pytest-xdist runs two files at once), and they are not this process's."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("nskv_")}


def record_logits(llm):
    """Wrap rank 0's sampler to keep every step's logits (the gathered, full-vocabulary ones)."""
    runner = llm.engine.executor.workers[0].model_runner
    seen, sample = [], runner.sample
    runner.sample = lambda seqs, logits, *rest: seen.append(logits.clone()) or sample(seqs, logits, *rest)
    return seen


def parallel_samples(engine, prompt_token_ids, params):
    """The n completions of one request (n > 1 runs through LLMEngine: LLM keeps one output per input),
    and that at least one step copied a block (copy-on-write after the fork)."""
    engine.add_request("fork", prompt_token_ids, params)
    done, copied = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finish_reason is not None:  # this completion's end (`finished`: the whole request's)
                done[out.index] = out.token_ids
        copied |= bool(engine.last_scheduler_output.blocks_to_copy)
    assert copied, "the fork should copy the prompt's shared last block"
    return [done[i] for i in range(params.n)]


def run_stepwise(llm, prompts, params):
    """Tokens by request and whether any step preempted."""
    ids = [llm.add_request(p, params) for p in prompts]
    preempted = False
    out = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        preempted |= bool(llm.engine.last_scheduler_output.preempted_seq_ids)
    return [out[i] for i in ids], preempted


@pytest.fixture(scope="module")
def model63():
    return tiny(3)


@pytest.fixture(scope="module")
def reference63(model63):
    llm = LLM(model63, **POOL)
    logits = record_logits(llm)
    tokens, preempted = run_stepwise(llm, PROMPTS, GREEDY)
    assert preempted, "the reference batch should preempt: the pool is too small for all four"
    return tokens, list(logits), [llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="class")
def tp3(model63):
    """One TP = 3 group for the tests of TestTP3 (one group per process at a time: closed after the class)."""
    before = child_pids()
    with LLM(model63, tensor_parallel_size=3, **POOL) as llm:
        yield llm
    assert child_pids() == before


class TestTP3:
    def test_gives_tp1_tokens_and_logits_with_preemption(self, tp3, reference63):
        ref_tokens, ref_logits, _ = reference63
        logits = record_logits(tp3)
        tokens, preempted = run_stepwise(tp3, PROMPTS, GREEDY)
        assert preempted
        assert tokens == ref_tokens
        assert len(logits) == len(ref_logits)
        for got, want in zip(logits, ref_logits):  # float32, summed in another order: a few ulps of the logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    def test_batch_invariance(self, tp3, reference63):
        """Each prompt alone at TP 3 gives what it gave in the preempting batch, and what TP 1 gives alone."""
        ref_tokens, _, ref_alone = reference63
        alone = [tp3.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
        assert alone == ref_alone == ref_tokens

    def test_forked_completions_copy_on_write_on_every_rank(self, tp3, model63):
        """n = 2: the completions share the prompt's partial last block until each writes into it; then
        every rank copies its slice of that block (the copy travels in the step), so both completions draw
        what they draw at TP 1."""
        fork = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
        assert parallel_samples(tp3.engine, PROMPTS[0]["prompt_token_ids"], fork) == \
            parallel_samples(LLM(model63, **POOL).engine, PROMPTS[0]["prompt_token_ids"], fork)

    def test_refuses_to_sleep(self, tp3):
        """Sleep mode frees one process's weights and pool; the workers' would stay: refused, and the group serves on."""
        from nanoserve.engine.llm_engine import SleepRefused

        with pytest.raises(SleepRefused, match=r"cannot sleep: .* not tensor parallelism"):
            tp3.engine.sleep(1)
        assert tp3.engine.sleep_level == 0 and len(tp3.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].token_ids) == 8

    def test_kv_pool_holds_one_kv_head_per_rank(self, tp3, model63):
        """Memory math: 2 (K, V) · 2 layers · 1 KV head · 16 head_dim · 4 B = 256 B per token per rank, a
        third of TP 1's 768 B: the same bytes hold 3× the blocks."""
        cache = tp3.engine.executor.workers[0].model_runner.kv_cache
        assert tuple(cache.k_cache[0].shape) == (1, 12, 4, 16)  # (Hkv per rank, blocks, block_size, head_dim)
        budget = 1 << 20
        one, three = Worker(model63).num_blocks_for(budget, 16), tp3.engine.executor.num_blocks_for(budget, 16)
        assert (one, three) == (budget // (768 * 16), budget // (256 * 16))


def test_refused_split_names_the_heads_and_starts_nothing(model63):
    before = child_pids()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split num_key_value_heads=3 "
                                         r"\(num_attention_heads=6\)"):
        LLM(model63, tensor_parallel_size=2)
    assert child_pids() == before


def test_refused_mlp_split_names_the_features_and_starts_nothing():
    """The heads split 3 ways (6 / 3), but 190 MLP features do not: refused before any process starts (SmolLM2 at
    TP 9 is refused so: 1536 features)."""
    before = child_pids()
    config = LlamaConfig.tiny(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=190)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide intermediate_size=190"):
        LLM(Llama(config), tensor_parallel_size=3)
    assert child_pids() == before


# everything tensor parallelism cannot run, by the name the refusal gives it (EngineConfig.check_tensor_parallel)
SINGLE_PROCESS_ONLY = [
    pytest.param(dict(weights="int8"), "weights='int8'", id="weights"),
    pytest.param(dict(degrade_under_load=2), "degrade_under_load", id="degrade"),
    pytest.param(dict(attention_backend="triton"), "attention_backend='triton'", id="triton"),
    pytest.param(dict(kv_cache_dtype="bf16"), "kv_cache_dtype='bf16'", id="bf16_pool"),
    pytest.param(dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8'", id="int8_pool"),
    pytest.param(dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'", id="fp8_pool"),
    pytest.param(dict(compile_mode="buckets"), "compile_mode='buckets'", id="compiled"),
    pytest.param(dict(speculative="draft"), "speculative='draft'", id="draft"),
    pytest.param(dict(enable_lora=True), "enable_lora", id="lora"),
    pytest.param(dict(lora_modules={"a": "/nowhere"}), "lora_modules", id="lora_modules"),
    pytest.param(dict(kv_tier_blocks=8), "kv_tier_blocks", id="kv_tier"),
    pytest.param(dict(kv_transfer_config=KVTransferConfig()), "kv_transfer_config", id="kv_connector"),
    # shard_llama builds the reference's blocks on every rank: chapter 02's code would run nowhere
    pytest.param(dict(student="02"), "chapter 02's exercises in student", id="student02"),
    pytest.param(dict(student=True), "chapter 02's exercises in student", id="student_all")]
# LLMEngine is given a model, not `weights`, and a LoRAConfig; on the CPU it refuses Triton without Triton's
# interpreter before this check
IN_THE_ENGINE = [p for p in SINGLE_PROCESS_ONLY if p.id not in ("weights", "lora", "lora_modules", "triton")] + [
    pytest.param(dict(lora_config=LoRAConfig()), "enable_lora", id="lora")]
REFUSED = r"tensor_parallel_size > 1 runs .*: .*{}.* single-process only"


@pytest.mark.parametrize("setting, name", SINGLE_PROCESS_ONLY)
def test_llm_refuses_what_the_workers_cannot_do_before_starting_them(model63, monkeypatch, setting, name):
    from nanoserve.distributed import multiproc

    monkeypatch.setattr(multiproc, "start_workers", lambda *args, **kwargs: pytest.fail("a worker process started"))
    with pytest.raises(ValueError, match=REFUSED.format(re.escape(name))):
        LLM(model63, tensor_parallel_size=3, **setting)


@pytest.mark.parametrize("precision, name", [
    pytest.param("int8", "a model given as weight_format='int8'", id="int8_model"),
    pytest.param("bf16", "a model given as weight_format='bf16'", id="bf16_model"),
    pytest.param(torch.bfloat16, "a model given with torch.bfloat16 parameters", id="bf16_cast")])
def test_llm_refuses_a_model_given_in_other_than_float32(monkeypatch, precision, name):
    """A model object is copied into float32 shards: an int8 one would not load, a bf16 one would serve upcast,
    other arithmetic than the same model at TP 1. Refused, naming it, before any worker starts; the same model at
    TP 1 keeps its own precision (the reference the refusal protects)."""
    from nanoserve.distributed import multiproc
    from nanoserve.model.quant import quantize_model

    model = tiny(3)
    model = model.to(precision) if isinstance(precision, torch.dtype) else quantize_model(model, precision)
    monkeypatch.setattr(multiproc, "start_workers", lambda *args, **kwargs: pytest.fail("a worker process started"))
    with pytest.raises(ValueError, match=REFUSED.format(re.escape(name))):
        LLM(model, tensor_parallel_size=3)
    assert LLM(model, **POOL).model is model  # TP 1 serves it as it is


@pytest.mark.parametrize("setting, name", IN_THE_ENGINE)
def test_the_engine_refuses_what_the_workers_cannot_do(model63, setting, name):
    """LLMEngine's own refusals, for rank 0's shard handed to it directly (LLM refuses the same earlier, above): a
    shard of a group of 3 whose other ranks never started, refused before the engine's first collective (which
    would fail with "Default process group has not been initialized")."""
    from nanoserve.distributed.parallel_state import TPGroup
    from nanoserve.distributed.shard import shard_llama
    from nanoserve.engine.config import engine_config
    from nanoserve.engine.llm_engine import LLMEngine

    shard = shard_llama(model63.config, TPGroup(0, 3))
    degraded = shard_llama(model63.config, TPGroup(0, 3)) if "degrade_under_load" in setting else None
    with pytest.raises(ValueError, match=REFUSED.format(re.escape(name))):
        LLMEngine(shard, engine_config(**POOL, **setting), degraded_model=degraded)


def test_engine_settings_are_refused_before_any_worker_starts(model63, monkeypatch):
    """A setting the engine's config rejects is refused before the workers start, as the split is."""
    from nanoserve.distributed import multiproc

    monkeypatch.setattr(multiproc, "start_workers", lambda *args, **kwargs: pytest.fail("a worker process started"))
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        LLM(model63, tensor_parallel_size=3, max_num_seqs=0)


def test_a_failure_after_the_workers_started_stops_them():
    """The engine refuses a pool of no block only once rank 0 holds its shard, so after the workers started: the
    constructor stops them and leaves the process group, so the next LLM may start a group of its own."""
    import torch.distributed as dist

    before = child_pids()
    with pytest.raises(ValueError, match="holds no block"):
        LLM(tiny(1), tensor_parallel_size=2, kv_cache_memory=1)
    assert child_pids() == before and not dist.is_initialized()


def test_tp2_ngram_speculation_on_an_explicit_float32_pool_gives_tp1():
    """What tensor parallelism runs, asked for by name: kv_cache_dtype="fp32" and n-gram speculation (the
    proposer reads token ids on rank 0; the verify step is one forward pass of every rank). The tokens are those
    without speculation, and every draft and acceptance is TP 1's."""
    model = tiny(1)
    # this model's greedy tokens come back to ones seen before twice (3, then 89): 2 proposals, 1 token accepted
    prompt = {"prompt_token_ids": list(range(3, 13)) * 2}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    pool = dict(num_blocks=16, block_size=4)  # 44 tokens and the proposals verified past them
    plain = LLM(model, **pool).generate(prompt, greedy, use_tqdm=False)[0].token_ids
    one = LLM(model, speculative="ngram", **pool)
    want = one.generate(prompt, greedy, use_tqdm=False)[0].token_ids
    before = child_pids()
    with LLM(model, tensor_parallel_size=2, kv_cache_dtype="fp32", speculative="ngram", **pool) as llm:
        assert llm.engine.executor.workers[0].model_runner.kv_cache.k_cache[0].dtype == torch.float32
        got = llm.generate(prompt, greedy, use_tqdm=False)[0].token_ids
        stats = llm.engine.spec_stats
    assert child_pids() == before
    assert got == want == plain
    assert stats == one.engine.spec_stats and stats.num_drafts > 0 and stats.num_accepted_tokens > 0


@pytest.mark.exercise("11.3")
def test_tp2_replicated_kv_head_gives_tp1_tokens():
    """6 query heads, 1 KV head: each rank holds 3 query heads and a copy of the KV head. Graded: with
    `make grade CH=11` both ranks build their layers from YOUR finished exercises/11-tensor-parallel/ files
    (the reference where a rung is still a stub), the all_reduce between real processes over gloo."""
    layers = implementation("nanoserve.distributed.linear")
    layers.RowParallelLinear(2, 2, type("TP1", (), {"rank": 0, "size": 1})())  # a stub fails here, at once
    model = tiny(1)
    want = [o.token_ids for o in LLM(model, **POOL).generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    with LLM(model, tensor_parallel_size=2, student="11" if use_student() else None, **POOL) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    assert got == want


def test_tp2_serves_your_files_and_reports_them(exercises, capsys):
    """LLM(student="11", tensor_parallel_size=2) on a copy of YOUR exercises/11-tensor-parallel/ files in which only
    the functions still stubbed get the reference's code (untouched stubs: all of them): rank 0 builds its shard
    from the four files and sends every step through their pack_step, the tokens are TP 1's, and the run's report
    names the four files and counts their calls, as `batch --student 11 --tensor-parallel-size 3` prints it. Rank 1,
    a process of its own, reads exercises/ itself, as `--student 11` does (the reference where a rung is unfinished).
    The model's column-parallel products are fused (qkv_proj, gate_up_proj): each part's slice comes from the
    ColumnParallelLinear constructor in the copy."""
    from nanoserve.student import student_path, unfinished
    from tests.test_student import finish

    files = {"shard": "split_heads", "linear": "RowParallelLinear.forward", "vocab": "ParallelLMHead.forward",
             "parallel_state": "pack_step"}
    for name in files:
        module = f"nanoserve.distributed.{name}"
        stubs = [qualname for names in unfinished(student_path(module)).values() for qualname in names]
        if stubs:
            finish(module, stubs)  # the reference's code where yours is still a stub; what you wrote stays
    model = tiny(1)
    want = [o.token_ids for o in LLM(model, **POOL).generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    with LLM(model, tensor_parallel_size=2, student="11", **POOL) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
        proof, calls = llm.engine.student_proof(), llm.engine.student.calls
    assert got == want
    assert calls["ColumnParallelLinear.__init__"] == 2 * 5  # 2 layers x (q, k, v, gate, up)
    err = capsys.readouterr().err
    for name, function in files.items():
        assert f"from exercises/11-tensor-parallel/{name}.py" in err, err
        assert f"{function} ×" in proof, proof
    assert "no exercise of chapter 11 plugs into this run" not in err


def hand_step():
    """3 sequences, 5 tokens: A decodes at position 9, B prefills [0, 3), C decodes at 4; block_size 4."""
    from nanoserve.engine.model_runner import ModelInput
    from nanoserve.kv.paged_attention import AttentionMetadata

    metadata = AttentionMetadata.build([[7, 2, 5], [3], [0, 6]], [10, 3, 5], [1, 3, 1], 4)
    return ModelInput(torch.tensor([11, 20, 21, 22, 30]), torch.tensor([9, 0, 1, 2, 4]), metadata,
                      torch.tensor([0, 3, 4]), sampled_seqs=[])


@pytest.mark.exercise("11.5")
def test_pack_step_sizes_and_round_trip_by_hand():
    codec = implementation("nanoserve.distributed.parallel_state")
    batch = hand_step()
    sizes, payload = codec.pack_step(batch, [(5, 8), (6, 9)])
    assert tuple(sizes) == (5, 3, 3, 3, 2) and payload.dtype == torch.long
    assert payload.numel() == 5 * 3 + 3 * 3 + 3 + 4 + 3 + 2 * 2  # 38 integers, 304 bytes
    fields = codec.unpack_step(list(sizes) + [0, 0], payload)  # the header's zero padding rides along
    m = batch.attn_metadata
    want = {"input_ids": batch.input_ids, "positions": batch.positions, "slot_mapping": m.slot_mapping,
            "block_tables": m.block_tables, "seq_lens": m.seq_lens, "cu_seqlens_q": m.cu_seqlens_q,
            "logits_indices": batch.logits_indices, "blocks_to_copy": torch.tensor([[5, 8], [6, 9]])}
    assert set(fields) == set(want)
    for name, tensor in want.items():
        assert torch.equal(fields[name], tensor.long()), name
    # the contract's layout, which the other ranks' unpack_step reads: every field of STEP_FIELDS in that order
    assert torch.equal(payload, torch.cat([want[name].long().flatten() for name in STEP_FIELDS]))
    assert m.slot_mapping.tolist() == [21, 12, 13, 14, 24]  # worked by hand: block · 4 + offset


@pytest.mark.exercise("11.5")
def test_a_step_without_copies():
    codec = implementation("nanoserve.distributed.parallel_state")
    sizes, payload = codec.pack_step(hand_step())
    assert tuple(sizes) == (5, 3, 3, 3, 0) and payload.numel() == 34
    assert tuple(codec.unpack_step(list(sizes), payload)["blocks_to_copy"].shape) == (0, 2)


@pytest.mark.exercise("11.5")
def test_tp2_forked_completions_travel_through_your_step_broadcast():
    """The same step packed by YOUR pack_step on rank 0 and unpacked by YOUR unpack_step on rank 1, copy-on-write
    pairs included (n = 2 forks the prompt's last block): the tokens of TP 1."""
    implementation("nanoserve.distributed.parallel_state").pack_step(hand_step())  # a stub fails here, at once
    model = tiny(1)
    fork = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    want = parallel_samples(LLM(model, **POOL).engine, PROMPTS[1]["prompt_token_ids"], fork)
    with LLM(model, tensor_parallel_size=2, student="11" if use_student() else None, **POOL) as llm:
        assert parallel_samples(llm.engine, PROMPTS[1]["prompt_token_ids"], fork) == want


def assert_failed_cleanly(llm, before_children, before_shm, excinfo, *words):
    message = str(excinfo.value)
    for word in words:
        assert word in message, message
    assert not llm.engine.has_unfinished_requests()  # the in-flight requests were failed, not left hanging
    bm = llm.engine.block_manager
    assert bm.get_num_free_blocks() == bm.num_blocks
    assert child_pids() == before_children and shm() == before_shm
    with pytest.raises(WorkerError, match="shut down"):  # the group stays dead; it does not hang
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.close()  # idempotent


def test_killed_worker_fails_the_request_and_leaves_no_process():
    before_children, before_shm = child_pids(), shm()
    llm = LLM(tiny(1), tensor_parallel_size=2, **POOL)
    (pid,) = child_pids() - before_children
    request_id = llm.add_request(PROMPTS[0], GREEDY)
    llm.engine.step()  # the prompt is in, a token out: mid-request
    os.kill(pid, signal.SIGKILL)
    t = time.perf_counter()
    with pytest.raises(WorkerError) as excinfo:
        llm.run([request_id], use_tqdm=False)
    # noticed through the closed socket, not a timeout: well under the collectives' 120 s backstop
    # (multiproc.COLLECTIVE_TIMEOUT), with room for a loaded machine
    assert time.perf_counter() - t < 60
    assert_failed_cleanly(llm, before_children, before_shm, excinfo, "rank 1", "SIGKILL", f"['{request_id}']")


def test_exception_in_a_workers_forward_fails_the_request():
    before_children, before_shm = child_pids(), shm()
    llm = LLM(tiny(1), tensor_parallel_size=2, **POOL)
    request_id = llm.add_request(PROMPTS[0], GREEDY)
    # Only rank 1 runs this step: one token at position 10**6, beyond the model's context, so rank 1's
    # Llama.forward raises before its first collective; it reports the error and exits, and rank 0's
    # next step finds the group broken.
    bad = torch.tensor([1, 10**6, 0, 0, 1, 0, 1, 0])  # ids, positions, slots, table, seq_lens, cu_seqlens_q, rows
    llm.model.tp_group.broadcast_command(STEP, 1, 1, 1, 1, payload=bad)
    with pytest.raises(WorkerError) as excinfo:
        llm.run([request_id], use_tqdm=False)
    assert_failed_cleanly(llm, before_children, before_shm, excinfo, "rank 1", "ValueError: position 1000000",
                          f"['{request_id}']")


@pytest.mark.slow
def test_real_smollm2_tp3_matches_tp1(smollm2):
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name a colour."}]]
    params = SamplingParams(temperature=0, max_tokens=6)
    # seeded parallel sampling: completion i of n forks the prompt's blocks, copy-on-write on every rank
    fork = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4)
    reference = LLM(smollm2)
    want = [o.token_ids for o in reference.generate(chats, params, use_tqdm=False)]
    prompt = reference.prompt_token_ids(chats[0])
    want_fork = parallel_samples(reference.engine, prompt, fork)
    before = child_pids()
    with LLM(tensor_parallel_size=3) as llm:  # each rank reads its slice of the embedded GGUF
        got = [o.token_ids for o in llm.generate(chats, params, use_tqdm=False)]
        got_fork = parallel_samples(llm.engine, prompt, fork)
    assert got == want
    assert got_fork == want_fork and want_fork[0] != want_fork[1]
    assert child_pids() == before
