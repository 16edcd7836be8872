"""Chapter 08's worked examples, computed by the code: the notebook's request in bytes and token ids, the stop-string
hold-back table, the KV a request can pin, the server's limits (protocol.py, limits.py, api_server.py, serve's
flags), the token quota's reservation, the pairwise crossing's size and `bench http`'s workload are built here from
nanoserve/ and must appear in the chapter word for word. The ratios and sums the chapter draws from its quoted runs
are recomputed from those runs, and the figures it quotes from the notebook must be what the committed notebook
printed."""

import argparse
import asyncio
import inspect
import json
import math
import re
from types import SimpleNamespace

import pytest

from nanoserve.bench import http as bench_http
from nanoserve.bench.pairwise import FACTORS, covering_rows
from nanoserve.cli import serve
from nanoserve.kv.paged_attention import TORCH_DTYPE_NAMES, num_blocks_for_budget
from nanoserve.memory import kv_bytes_per_token
from nanoserve.model import LlamaConfig
from nanoserve.sampling import MIN_REPETITION_PENALTY, MIN_TEMPERATURE
from nanoserve.server import protocol
from nanoserve.server.api_server import ServerConfig
from nanoserve.server.limits import Tenant, TenantLimits, TokenBucketLimiter
from nanoserve.server.protocol import APIError, CompletionRequest
from nanoserve.server.streaming import stop_hold_back, text_deltas
from tests.chapter_text import ROOT, chapter, command_defaults, notebook_output, says

CH = "08"
SMOL = LlamaConfig()
# the notebook's request (cell 3)
BODY = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24, "stream": True,
        "stop": [" France is"], "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def spaced(n: int) -> str:
    """65536 -> '65 536', the chapter's way of writing a large integer in running text."""
    return f"{n:,}".replace(",", " ")


def streamed(texts: list[str], stop: list[str]) -> list[str]:
    """What the server sends for an engine's text after each step (the last one finished by a stop string)."""
    async def outputs():
        for i, text in enumerate(texts):
            yield SimpleNamespace(text=text, index=0, finish_reason="stop" if i == len(texts) - 1 else None)

    async def collect():
        return [delta async for delta, _ in text_deltas(outputs(), stop)]

    return asyncio.run(collect())


def test_one_requests_journey(smollm2_tokenizer):
    raw = json.dumps(BODY).encode()
    ids = smollm2_tokenizer.encode_chat(BODY["messages"])
    says(CH, f"a {len(raw)}-byte JSON body becomes {len(ids)} token ids, one prefill step of {len(ids)} tokens")
    says(CH, f"tokenizer [{', '.join(map(str, ids[:3]))}, ...]")
    out = notebook_output(CH)
    assert f"JSON body: {len(raw)} bytes" in out and f"{len(ids)} token ids" in out
    sizes = [int(b) for b in re.findall(r"\d+\.\d+ s +(\d+) B +data:", out)]
    done = len("data: [DONE]")
    assert sizes[-1] == done and round(sum(sizes[:-1]) / len(sizes[:-1]) / 50) * 50 == 250
    says(CH, f"a handful of SSE lines of about 250 bytes each (a {done}-byte `data: [DONE]` last)")


def test_the_hold_back_table():
    stop = ["\nUser:"]
    texts, final = ["Hello", "Hello.\nUs", "Hello.\nUser:"], "Hello."
    sent = streamed(texts[:2] + [final], stop)
    naive = [texts[0], texts[1][len(texts[0]):], texts[2][len(texts[1]):]]
    held = [texts[i][len(texts[i]) - stop_hold_back(texts[i], stop):] for i in (0, 1)]
    show = lambda s: s.replace("\n", "\\n")  # noqa: E731  the table writes a newline as \n
    assert held[0] == ""
    says(CH, f"| 1 | `{texts[0]}` | `{naive[0]}` | | `{sent[0]}` |")
    says(CH, f"| 2 | `{show(texts[1])}` | `{show(naive[1])}` | `{show(held[1])}` (could become `{show(stop[0])}`) | `{sent[1]}` |")
    says(CH, f"| 3 | `{show(texts[2])}` → finished, cut to `{final}` | `{naive[2]}` (too late) | — | `{sent[2]}` "
             f"(and `finish_reason: \"stop\"`) |")
    assert "".join(sent) == final


def test_the_notebooks_stop_string_stream():
    out = notebook_output(CH)
    texts = eval(re.search(r"the engine's text after each of those steps: (\[.*?\])", out)[1])
    sent = streamed(texts, BODY["stop"])
    says(CH, f"with `stop=[\"{BODY['stop'][0]}\"]` the engine's text after each step is "
             + ", ".join(f"`{t}`" for t in texts[:-1]) + f", then `{texts[-1]}` (finished, cut); the client receives "
             + ", ".join(f"`{s}`" for s in sent[:-1]) + " and a last chunk with `finish_reason: \"stop\"`")
    assert sent[-1] == "" and "".join(sent) == texts[-1]
    held = texts[3][len(texts[3]) - stop_hold_back(texts[3], BODY["stop"]):]
    says(CH, f"`{held}` was held back for one step and never sent")


def serve_defaults() -> argparse.Namespace:
    """`serve`'s arguments when none are given, with the format it fills in (q4 weights on a bf16 KV pool)."""
    args = command_defaults(serve, "serve")
    serve.serving_format(args)
    return args


def served_pool_blocks(args: argparse.Namespace) -> int:
    """The KV blocks `serve` with these arguments gives SmolLM2 (--kv-cache-mib in its --kv-cache-dtype)."""
    dtype = {name: t for t, name in TORCH_DTYPE_NAMES.items()}[args.kv_cache_dtype]
    return num_blocks_for_budget(SMOL, args.kv_cache_mib * 2**20, args.block_size, dtype)


def test_what_a_request_can_pin():
    c, args = SMOL, serve_defaults()
    assert args.kv_cache_dtype == "bf16"
    per_token, fp32 = kv_bytes_per_token(SMOL, args.kv_cache_dtype), kv_bytes_per_token(SMOL, "fp32")
    blocks = served_pool_blocks(args)
    says(CH, f"One token of\nSmolLM2 holds 2 (K, V) × {c.num_hidden_layers} layers × {c.num_key_value_heads} KV heads × "
             f"{c.head_dim} dims × 2 bytes = **{per_token:,} bytes** of KV cache in the bf16\npool `make serve` runs "
             f"({fp32:,} in float32); its default pool of {args.kv_cache_mib // 1024} GiB holds {blocks * args.block_size:,} "
             f"tokens ({blocks:,} blocks of {args.block_size})")
    context = c.max_position_embeddings
    assert round(6 * context / (blocks * args.block_size)) == 1
    says(CH, f"A\nrequest allowed to run to the end of an {context:,}-token context can pin a sixth of the pool")


def test_the_servers_limits():
    p = protocol
    args = serve_defaults()
    limiter = inspect.signature(TokenBucketLimiter.__init__).parameters["max_keys"].default
    config = ServerConfig()
    says(CH, f"`stop` (a string or a list of up to {p.MAX_STOP})")
    says(CH, f"a batch of up to {p.MAX_PROMPTS} of either")
    says(CH, f"`serve --default-max-tokens N` ({args.default_max_tokens} from the CLI")
    says(CH, f"while completions default to {CompletionRequest(prompt='x').requested_max_tokens}")
    says(CH, f"`--max-body-bytes` ({args.max_body_bytes // 2**20} MiB)")
    assert args.max_body_bytes == config.max_body_bytes
    says(CH, f"`--shutdown-timeout` ({args.shutdown_timeout:g} s)")
    says(CH, f"`body_timeout` ({config.body_timeout:g} s)")
    says(CH, f"the table is capped at {spaced(limiter)} keys")
    says(CH, f"400 \"nests deeper than {p.MAX_DEPTH} levels\"")
    says(CH, f"400: at most {spaced(p.MAX_LOGIT_BIAS)} biases (ids checked against the vocabulary), {p.MAX_STOP} stops of "
             f"≤ {p.MAX_STOP_CHARS} characters, {p.MAX_TOP_LOGPROBS} top logprobs")
    says(CH, f"400 above `max_request_tokens` ({spaced(config.max_request_tokens)}), `n` ≤ {p.MAX_N}")
    says(CH, f"`top_logprobs` (≤ {p.MAX_TOP_LOGPROBS}), completions' `logprobs: N` (≤ {p.MAX_TOP_LOGPROBS}; OpenAI allows 5)")
    says(CH, f"`0 < temperature < {MIN_TEMPERATURE}` is raised to {MIN_TEMPERATURE} (vLLM's floor), `repetition_penalty` "
             f"≥ {MIN_REPETITION_PENALTY}")
    says(CH, f"`\"seed\": {2**64}` (≥ 2⁶⁴)")
    says(CH, f"# a token bucket (burst = {Tenant('t').burst} unless set)")


def test_the_token_quota_reserves_a_requests_cost():
    quota, n, max_tokens, prompt = 2000, 16, 120, 20
    limits = TenantLimits({"k": Tenant("t", tokens_per_minute=quota)})
    outcomes = []
    for _ in range(3):
        try:
            limits.reserve("t", prompt + n * max_tokens, now=0.0)
            outcomes.append(200)
        except APIError as e:
            outcomes.append(e.status)
    assert outcomes == [200, 429, 429]  # the first runs and the other two are refused
    says(CH, f"three concurrent `n: {n}, max_tokens: {max_tokens}` requests from a {quota:,}-tokens-a-minute tenant would "
             f"all run (3 × {n} × {max_tokens} = {3 * n * max_tokens:,} generated tokens) before the first 429; reserved "
             f"({n * max_tokens:,} + the prompt each), the first runs and the other two are refused")


def test_the_prompt_logprobs_example(smollm2_tokenizer):
    out = notebook_output(CH)
    text = "The capital of France is Paris."
    pieces = [smollm2_tokenizer.decode([i]) for i in smollm2_tokenizer.encode(text)]
    offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    says(CH, f'"tokens": [{", ".join(json.dumps(p) for p in pieces)}]')
    printed = eval(re.search(re.escape(f"perplexity 13.0 {text!r}") + r" (\[.*?\])", out)[1])  # [(token, logprob)]
    assert [t for t, _ in printed] == pieces
    quoted = re.search(r'"token_logprobs": \[(.*?)\]', chapter(CH))[1].split(", ")
    assert quoted == ["null"] + [f"{lp:.2f}" for _, lp in printed[1:]]
    says(CH, f'"text_offset": {offsets}')
    for ppl, shown in re.findall(r"perplexity +([\d.]+) +'([^']*)'", out):
        says(CH, f'perplexity("{shown}") # {ppl}')
    V, H = SMOL.vocab_size, SMOL.hidden_size
    says(CH, f"({spaced(V)} × {H} for SmolLM2), and a chunk's logits at once in memory: 2 048 rows × {spaced(V)} × 4 bytes "
             f"= {2048 * V * 4 / 1e6:.0f} MB at the default `max_num_batched_tokens`")


def test_the_metrics_scrape_is_the_notebooks():
    (path,) = (ROOT / "chapters").glob(f"{CH}-*.md")
    quoted = re.findall(r"^(nanoserve:\S+) ([\d.]+)", path.read_text(), re.M)  # the scrape's lines, before their comments
    assert len(quoted) == 12
    out = notebook_output(CH)
    for name, value in quoted:
        assert f"{name} {value}" in out, name
    ttft = dict(quoted)['nanoserve:time_to_first_token_seconds_count{model_name="SmolLM2-135M-Instruct"}']
    says(CH, f"From the notebook, after {float(ttft):.0f} requests")


def test_bench_http_workload_and_ratios():
    a = command_defaults(bench_http, "http")
    lo, hi = a.prompt_len
    says(CH, f"(= --concurrency {' '.join(map(str, a.concurrency))} --prompt-len {lo} {hi} --output-len {a.output_len} "
             f"--rounds {a.rounds})")
    says(CH, f"random prompt ids of {lo}–{hi} tokens, {a.output_len} output tokens each")
    text, ratios = chapter(CH), []
    for c in a.concurrency:
        offline, http = (float(re.search(rf" {c} {system} +([\d.]+)", text)[1]) for system in ("offline", "HTTP"))
        # the command divides the unrounded rates: its percentage lies within what the printed ones allow
        kept = float(re.search(rf"HTTP keeps ([\d.]+) % of the offline output tokens/s \({a.rounds} rounds of {c} "
                               rf"requests each", text)[1])
        assert 100 * (http - 0.05) / (offline + 0.05) - 0.05 <= kept <= 100 * (http + 0.05) / (offline - 0.05) + 0.05, c
        ratios.append(http / offline)
    earlier = re.search(r"gave ([\d.]+) vs ([\d.]+) tok/s at C = 16 and ([\d.]+) vs ([\d.]+) at C = 32", text).groups()
    earlier = [float(earlier[1]) / float(earlier[0]), float(earlier[3]) / float(earlier[2])]
    says(CH, f"({earlier[0]:.0%} and {earlier[1]:.0%})".replace("%", " %"))
    says(CH, f"at least {min(ratios + earlier):.0%} of offline in every measurement".replace("%", " %"))


def test_bench_http_names_the_format_it_ran_and_the_command_gives_it_back():
    """The quoted run names its weights and KV pool (bench http's defaults), and the `command:` line a run prints
    carries every engine flag given, so that running it again measures the same engine."""
    import shlex

    from nanoserve.cli.batch import command_line

    a = command_defaults(bench_http, "http")
    says(CH, f"weights {a.weights}, KV pool float32 (bench http's defaults")
    argv = ("--weights", "q4", "--kv-cache-dtype", "bf16", "--native-decode", "off", "--compile-mode", "buckets",
            "--concurrency", "1", "--rounds", "3")
    args = command_defaults(bench_http, "http", *argv)
    line = command_line(args, bench_http.add_arguments, "bench http")
    assert line.startswith("python -m nanoserve bench http ")
    for flag, value in zip(argv[::2], argv[1::2]):
        assert f"{flag} {value}" in line, flag
    again = command_defaults(bench_http, "http", *shlex.split(line.removeprefix("python -m nanoserve bench http ")))
    assert vars(again) == vars(args)
    assert "--block-size" not in line  # an engine flag at its default is left out


@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_bench_http_says_which_cpu_it_ran_on(smollm2_tokenizer, monkeypatch, capsys, weights):
    """A run's `threads:` line names the CPU beside the format: torch's capability and the CPU's bf16 instructions,
    read here from the kernel's flags (they set q4's large-step GEMM, chapter 10), as the chapter tells a rerun to
    quote it; on q4 also where its decode steps of one-token rows ran, with the most rows a native step takes
    (cpu_decode.max_rows of the model run: what separates a C = 16 run from a C = 32 one). The run itself: one
    request of a few tokens through both systems, on a tiny random model (q4: its layers quantized, native step on)."""
    import torch

    from nanoserve.cli import batch
    from nanoserve.kernels import cpu_decode
    from nanoserve.llm import LLM
    from tests.tiny_model import tiny_llama

    model = tiny_llama(vocab_size=49152, max_position_embeddings=256)
    if weights == "q4":
        if not cpu_decode.available():
            pytest.skip(f"kernels/cpu_decode.c does not run here ({cpu_decode.build_error()}): install gcc with "
                        "OpenMP on an AVX2 CPU")
        from tests.test_ch09_native_decode import tiny_q4

        model = tiny_q4(model)
        model.native_decode = True  # as LLM(weights="q4") sets it where the C step builds
    monkeypatch.setattr(batch, "llm_from_args", lambda args: LLM(model, num_blocks=16, block_size=16,
                                                                   tokenizer=smollm2_tokenizer))
    bench_http.run(command_defaults(bench_http, "http", "--concurrency", "1", "--rounds", "1", "--output-len", "2",
                                    "--prompt-len", "5", "6", "--weights", weights))
    threads = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("threads: "))
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    bf16 = next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)
    assert f"; CPU: {torch.backends.cpu.get_cpu_capability()}, bf16 instructions: {bf16}; " in threads, threads
    if weights == "fp32":
        assert "; weights fp32, KV pool float32, 16 blocks of 16 tokens per engine;" in threads, threads
    else:
        rows = cpu_decode.max_rows(model)
        assert (f"; weights q4, KV pool float32, 16 blocks of 16 tokens per engine; decode steps of up to {rows} "
                f"one-token row{'s' * (rows > 1)} in kernels/cpu_decode.c (chapter 09), other steps in the model's "
                "forward; server") in threads, threads
    says(CH, "prints the format it ran and the CPU it ran on (torch's capability and the CPU's bf16 instructions) "
             "on its `threads:` line")


def quoted_run(command: str) -> list[str]:
    """The lines of the chapter's code block that starts with `command`, up to its "5xx:" line."""
    (path,) = (ROOT / "chapters").glob(f"{CH}-*.md")
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(command))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("5xx:"))
    return lines[start:end]


def test_the_soaks_sums():
    run = quoted_run(".venv/bin/python -m nanoserve bench soak --duration 600")
    counts = [int(re.match(r"  [a-z_]+: .+? {2,}(\d+)", line)[1]) for line in run if line.startswith("  ")]
    assert len(counts) == 6
    says(CH, f"{sum(counts)} requests by outcome")
    text = chapter(CH)
    start, end = re.search(r"resident memory of the serving process: (\d+) MiB at start, (\d+) MiB at the end", text).groups()
    says(CH, f"grew {int(end) - int(start)} MiB over {spaced(sum(counts))} requests")
    before, after = re.search(r"\((\d+) → (\d+) MiB", text).groups()
    says(CH, f"less than the {int(after) - int(before)} MiB over 556 requests")
    run = quoted_run(".venv/bin/python -m nanoserve bench soak --pairwise --duration 60")
    statuses = [int(re.match(r"  \S.*? {2,}(\d+)$", line)[1]) for line in run if line.startswith("  ") and "run when" not in line]
    assert len(statuses) == 4
    says(CH, f"{sum(statuses)} requests (39 rows of the crossing")
    run = quoted_run(".venv/bin/python -m nanoserve bench soak --duration 60 ")
    hostile = [int(re.match(r"  hostile: \d{3} .+? +(\d+)(?: |$)", line)[1]) for line in run if line.startswith("  hostile")]
    others = [int(n) for n in re.findall(r"(?:good|malformed|cancelled|timed out|limited) (\d+)", run[-1])]
    assert len(hostile) == 8 and len(others) == 5
    says(CH, f"{sum(hostile) + sum(others)} requests by outcome: hostile")


def test_the_pairwise_crossing():
    sizes = [len(v) for v in FACTORS.values()]
    combinations = math.prod(sizes)
    rows = covering_rows()
    says(CH, f"crosses {len(FACTORS)} features")
    says(CH, f"finds {len(rows)} requests in which every pair of values of any two features appears, where all "
             f"combinations would be {combinations / 1e7:.1f}·10⁷")


def test_the_malformed_requests_test_sends_what_the_chapter_counts():
    from tests import test_ch08_server
    from tests.test_ch08_server import MALFORMED

    # besides the MALFORMED bodies the test sends one request per http.post / http.get call, less the one in the
    # loop over MALFORMED and the good request at the end
    source = inspect.getsource(test_ch08_server.test_malformed_requests_get_openai_errors_and_leave_nothing_behind)
    others = len(re.findall(r"http\.(?:post|get)\(", source)) - 2
    says(CH, f"sends {len(MALFORMED) + others} bad requests ({len(MALFORMED)} malformed bodies and {others} more)")


def test_prefix_isolation_compares_prefixes_of_one_length(smollm2_tokenizer):
    """`bench experiment prefix-isolation` times a cross-tenant miss against a cold one: its prefixes must be equally
    long (a prefill's time grows with its length), within the last word's few tokens."""
    import random

    from nanoserve.bench.isolation import PREFIX_TOKENS, words_prefix

    rng = random.Random(32)
    lengths = [len(smollm2_tokenizer.encode(words_prefix(smollm2_tokenizer, rng, PREFIX_TOKENS))) for _ in range(6)]
    assert all(PREFIX_TOKENS <= n <= PREFIX_TOKENS + 6 for n in lengths), lengths
