"""Chapter 14 — speculative decoding in the engine, on the tiny random-weight model.

The oracle: the same requests without speculation. Greedy outputs must be token-identical alone, in mixed
batches (speculating and plain sequences, prefills and decodes in one step), under preemption (a rollback
and a preemption in the same run), with stop tokens inside an accepted run, and every run ends with the
pool whole and nothing rejected in the prefix cache. Beside chapter 09's native step on a bf16 pool, where a verify
step and a one-token step round unlike each other, the oracle is the eager q4 model's top pick or a near-tie of it.
"""

import random

import pytest
import torch

from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from tests.test_ch06_engine import run  # submit all, step until idle, check the pool is whole
from tests.tiny_model import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def requests(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts that repeat themselves (so n-gram lookup finds something) with random noise mixed in."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
        prompt = (motif * 8)[:rng.randint(6, 40)] + [rng.randrange(256) for _ in range(rng.randint(0, 5))]
        out.append((prompt, rng.randint(8, 40)))
    return out


def engine(model, speculative=None, eos=-1, **config):
    config = {"num_blocks": 128, "block_size": 4, "speculative_disable_by_batch_size": None, **config}
    return LLMEngine(model, engine_config(speculative=speculative, **config), eos_token_id=eos)


@pytest.fixture(scope="module")
def plain(model):
    return run(engine(model), requests(12))


@pytest.mark.parametrize("method, k", [("ngram", 2), ("ngram", 4), ("draft", 3)])
def test_greedy_is_token_identical_alone_and_in_a_mixed_batch(model, plain, method, k):
    reqs = requests(12)[:12 if method == "ngram" else 5]  # the draft runs its layers once per proposed token
    e = engine(model, method, num_speculative_tokens=k)
    assert {0: run(e, reqs[:1])[0]} == {0: plain[0]}  # alone
    e = engine(model, method, num_speculative_tokens=k, max_num_batched_tokens=32)  # prefills and verifies mix
    mixed_steps = []
    assert run(e, reqs, on_step=lambda so: mixed_steps.append(mixed(so))) == {i: plain[i] for i in range(len(reqs))}
    s = e.spec_stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # some accepted, some rolled back
    assert any(mixed_steps)


def test_greedy_parity_with_penalties_and_logit_bias(model, plain):
    """Penalties read the tokens before each row: row i of a verify must see the prompt, the output and
    d_1..d_i, as plain decoding would have. A penalty applied to the wrong row (the same counts for all k + 1
    rows, say) changes a greedy token somewhere in these 8 requests."""
    reqs = requests(8)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, repetition_penalty=1.05,
                             frequency_penalty=0.1, presence_penalty=0.05, logit_bias={5: 1.0, 7: -2.0})
              for _, m in reqs]
    expected = run(engine(model), reqs, params)
    assert expected != {i: plain[i] for i in range(len(reqs))}  # the penalties change what is generated
    e = engine(model, "ngram", num_speculative_tokens=3)
    assert run(e, reqs, params) == expected
    assert 0 < e.spec_stats.num_accepted_tokens < e.spec_stats.num_draft_tokens


def mixed(so) -> bool:
    """Did the step verify proposals beside a prefill chunk?"""
    return any(n > 1 and s.num_output_tokens > 2 for s, n in ((s, so.num_scheduled_tokens[s.seq_id])
                                                              for s in so.scheduled_seqs)) and \
        any(s.num_output_tokens == 0 for s in so.scheduled_seqs)


def test_rollback_and_preemption_in_the_same_run(model, plain):
    e = engine(model, "ngram", num_speculative_tokens=4, num_blocks=24, max_num_batched_tokens=64)
    freed, preempted = [], []
    rollback = e.rollback
    e.rollback = lambda seq_id, n: freed.extend(rollback(seq_id, n)) or []
    assert run(e, requests(12), on_step=lambda so: preempted.extend(so.preempted_seq_ids)) == plain
    assert preempted, "the pool was meant to be too small: no preemption happened"
    assert freed, "no rollback gave a block back"


def test_nothing_rejected_reaches_the_prefix_cache(model):
    e = engine(model, "ngram", num_speculative_tokens=4)
    inserted = []
    insert = e.block_manager.prefix_cache.insert
    e.block_manager.prefix_cache.insert = lambda h, parent, tokens, block: (inserted.append(tuple(tokens)),
                                                                            insert(h, parent, tokens, block))
    reqs = requests(12)
    out = run(e, reqs)
    real = {tuple((p + out[i])[j:j + 4]) for i, (p, _) in enumerate(reqs) for j in range(0, len(p) + len(out[i]), 4)}
    assert inserted and set(inserted) <= real
    assert e.spec_stats.num_accepted_tokens < e.spec_stats.num_draft_tokens  # and some tokens were rejected


def test_stop_token_inside_an_accepted_run(model, plain):
    """With EOS a token that the greedy outputs produce mid-way, the output stops exactly where a plain run stops."""
    eos = plain[3][len(plain[3]) // 2]
    params = [SamplingParams(temperature=0, max_tokens=m) for _, m in requests(12)]
    base = run(engine(model, eos=eos), requests(12), params)
    assert any(len(base[i]) < requests(12)[i][1] for i in base)  # some stopped early
    assert run(engine(model, "ngram", num_speculative_tokens=8, eos=eos), requests(12), params) == base


def test_opt_out_and_the_batch_size_policy(model):
    reqs = requests(3)
    for n in (1, 2):  # n = 2: the opt-out reaches the forked completion too
        e = engine(model, "ngram")
        e.add_request("no", reqs[0][0], SamplingParams(n=n, temperature=0, max_tokens=20, ignore_eos=True),
                      speculative=False)
        while e.has_unfinished_requests():
            e.step()
        assert e.spec_stats.num_drafts == 0, n
    e = engine(model, "ngram", speculative_disable_by_batch_size=2)
    drafts_while_two_run = []
    run(e, reqs, on_step=lambda so: drafts_while_two_run.append(
        len(so.scheduled_seqs) >= 2 and any(so.num_scheduled_tokens[s.seq_id] > 1 and s.num_output_tokens > 1
                                            for s in so.scheduled_seqs)))
    assert not any(drafts_while_two_run)
    assert e.spec_stats.num_drafts > 0  # the last one alone speculated


def test_a_draft_under_tensor_parallelism_is_refused(model):
    """The draft runs the model's first layers on rank 0 alone: ranks 1 .. n-1 would wait for a collective that
    never comes. Refused before any process starts, by LLM and on the command line (one error: line, exit 2)."""
    from nanoserve.llm import LLM

    with pytest.raises(ValueError, match="speculative='draft'"):
        LLM(model, tensor_parallel_size=2, speculative="draft")


@pytest.mark.parametrize("flags, named", [(["--speculative", "draft", "--tensor-parallel-size", "3"], "speculative"),
                                          (["--num-speculative-tokens", "3"], "--num-speculative-tokens")])
def test_a_speculative_flag_the_engine_cannot_honour_is_refused_in_one_line(flags, named, tmp_path, capsys):
    from nanoserve.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Hi", "max_tokens": 2}\n')
    assert main(["batch", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--no-progress", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    if named == "--num-speculative-tokens":  # serve refuses it too, before it binds its port
        assert main(["serve", "--port", "0", *flags]) == 2
        assert named in capsys.readouterr().err


def test_seeded_sampling_with_speculation_completes_and_is_reproducible(model):
    reqs = requests(4)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=m, ignore_eos=True) for i, (_, m) in enumerate(reqs)]
    a = run(engine(model, "ngram"), reqs, params)
    assert a == run(engine(model, "ngram"), reqs, params)
    assert all(len(a[i]) == reqs[i][1] for i in a)


def chi2_quantile(df: int, z: float = 4.75) -> float:
    """The chi-square quantile with `df` degrees of freedom at the normal quantile z (Wilson-Hilferty; z = 4.75:
    exceeded with chance ~1e-6, so a correct sampler fails this test about once in a million seeds)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * h ** 0.5) ** 3


def homogeneity(a: list[int], b: list[int]) -> tuple[float, int]:
    """Pearson's chi-square statistic that two samples come from one distribution, and its degrees of freedom.
    Tokens seen fewer than 10 times in both together share one bin (an expected count under 5 per sample
    would make the statistic's chi-square law a poor fit)."""
    from collections import Counter

    pooled = Counter(a) + Counter(b)
    bin_of = lambda t: t if pooled[t] >= 10 else "rare"  # noqa: E731
    ca, cb = Counter(map(bin_of, a)), Counter(map(bin_of, b))
    bins = ca.keys() | cb.keys()
    stat = 0.0
    for token in bins:
        share = (ca[token] + cb[token]) / (len(a) + len(b))
        for counts, n in ((ca, len(a)), (cb, len(b))):
            stat += (counts[token] - n * share) ** 2 / (n * share)
    return stat, len(bins) - 1


SAMPLES = 600  # requests per engine: each gives one draw of output tokens 1, 2, 3 (token 0 comes from the prefill)


def sampled_outputs(model, speculative, seed0: int) -> tuple[list[list[int]], object]:
    """SAMPLES seeded requests at temperature 0.8 of one prompt: a few tokens and the model's own greedy
    continuation of them, twice over, so that the n-gram proposer proposes tokens the model finds likely (a
    proposal with p(d) near 0.5 is where a wrong rule shows most). Their outputs, and the spec stats."""
    seed = [3, 1, 4, 1, 5]
    greedy = run(engine(model), [(seed, 12)])[0]
    prompt = seed + greedy + seed + greedy[:6]
    e = engine(model, speculative, num_speculative_tokens=2, num_blocks=2048, max_num_seqs=256,
               max_num_batched_tokens=4096)
    params = [SamplingParams(temperature=0.8, seed=seed0 + i, max_tokens=4, ignore_eos=True) for i in range(SAMPLES)]
    out = run(e, [(prompt, 4)] * SAMPLES, params)
    return [out[i] for i in range(SAMPLES)], e.spec_stats


@pytest.fixture(scope="module")
def small_vocab():
    """16 tokens, embeddings 5x the usual scale: next-token distributions with a clear favourite (about 0.7),
    where the tiny model's usual ones are nearly flat and no rule, right or wrong, would show."""
    model = tiny_llama(vocab_size=16)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(5)
    return model


def test_sampled_speculation_keeps_the_target_distribution(small_vocab, monkeypatch):
    """Exactness in distribution, through the whole engine: output tokens 1, 2, 3 of 600 seeded requests with
    n-gram speculation (they come out of verification: accepted proposals, residual draws, bonuses) against
    600 without, a chi-square homogeneity test per position. The same test catches a wrong rule: after a
    rejection, drawing from p itself instead of the residual (the rejected token gets a second chance)."""
    plain, _ = sampled_outputs(small_vocab, None, 0)
    spec, stats = sampled_outputs(small_vocab, "ngram", SAMPLES)
    assert stats.num_drafts >= SAMPLES and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    print(f"\nα = {stats.alpha:.2f} ({stats.num_accepted_tokens} of {stats.num_accepted_tokens + stats.num_rejections}"
          " tested proposals accepted)")
    for pos in (1, 2, 3):
        stat, df = homogeneity([o[pos] for o in plain], [o[pos] for o in spec])
        assert stat < chi2_quantile(df), f"token {pos}: chi-square {stat:.1f} over {df} degrees of freedom"
    from nanoserve.spec_decode import acceptance

    monkeypatch.setattr(acceptance, "residual", lambda p, q: p)  # the wrong rule, through the engine's module
    wrong, _ = sampled_outputs(small_vocab, "ngram", 2 * SAMPLES)
    stats = [homogeneity([o[pos] for o in plain], [o[pos] for o in wrong]) for pos in (1, 2, 3)]
    print("the wrong rule, chi-square over the threshold at tokens 1, 2, 3:",
          " ".join(f"{stat / chi2_quantile(df):.2f}x" for stat, df in stats))
    assert max(stat / chi2_quantile(df) for stat, df in stats) > 1, stats  # rejected at the same 1e-6 level


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "bf16"])
@torch.inference_mode()
def test_speculation_beside_the_native_step_decodes_the_eager_models_greedy_tokens(kv_cache_dtype):
    """On q4 weights chapter 09's native step (kernels/cpu_decode.c) runs every step of up to 16 sequences' one
    token each; a speculative engine keeps it for its steps that verify nothing (no n-gram match) and runs a step that
    verifies k proposals (k + 1 query tokens) through the model's forward. One request at a time, every step is
    batch 1, so both paths run. Each greedy token is the eager q4 model's argmax over the same prefix
    (teacher-forced, no cache) or within a near-tie of it (chapter 09's MARGIN for the pool's dtype). On a float32
    pool the tokens are also the plain engine's (native too); on a bf16 pool, serve's default, the verify step's
    bf16 attention and the C step's float32 attention round unlike each other, so the two engines may part at a
    near-tie and only the bound on the eager model holds."""
    from nanoserve.kernels import cpu_decode
    from tests.test_ch09_native_decode import MARGIN, tiny_q4

    if not cpu_decode.available():
        pytest.skip(f"kernels/cpu_decode.c does not run here ({cpu_decode.build_error()})")
    q4 = tiny_q4()
    q4.native_decode = True  # what LLM(weights="q4", native_decode=True) sets on the model it loads
    plain_q4 = engine(q4) if kv_cache_dtype == "fp32" else None
    spec = engine(q4, "ngram", num_speculative_tokens=3, kv_cache_dtype=kv_cache_dtype)
    widths = set()  # query tokens of the speculative engine's one-sequence decode steps
    for prompt, max_tokens in requests(6):
        got = run(spec, [(prompt, max_tokens)], on_step=lambda so: widths.update(
            so.num_scheduled_tokens[s.seq_id] for s in so.scheduled_seqs if s.num_output_tokens > 0))[0]
        if plain_q4 is not None:
            assert got == run(plain_q4, [(prompt, max_tokens)])[0]
        ids = torch.tensor(prompt + got)
        logits = q4.compute_logits(q4(ids))[len(prompt) - 1:-1]  # row i predicts got[i]
        gap = logits.max(-1).values - logits[torch.arange(len(got)), torch.tensor(got)]
        assert (gap <= MARGIN[kv_cache_dtype] * logits.abs().max(-1).values).all(), gap.tolist()
    runner = spec.executor.workers[0].model_runner
    assert [d for d in runner.native_decoders.values() if d is not None], "the speculative engine never ran natively"
    assert 1 in widths and max(widths) > 1 and spec.spec_stats.num_drafts > 0  # both kinds of step ran


def test_native_decode_on_with_speculation_is_accepted():
    """`--native-decode on` asks for the native step on one-token steps, which a speculative engine still takes
    (the test above): honoured, not refused, and serve's banner says where one-token steps run."""
    import argparse

    from nanoserve.cli import serve
    from nanoserve.cli.batch import check_engine_args
    from nanoserve.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip(f"kernels/cpu_decode.c does not run here ({cpu_decode.build_error()})")
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--weights", "q4", "--speculative", "ngram", "--native-decode", "on"])
    assert check_engine_args(args) is None
    assert "one-token rows in kernels/cpu_decode.c" in serve.serving_format(args)
