"""Chapter 17's worked examples, computed by the code: the KV bytes per token and per prompt (chapter 04's
kv_bytes_per_token), the links' transfer times and the prefill's KV rate, the connector's two halves, the receiving
side's plan (disagg/receive.py), the transfer settings and the proxy's prefill request, the index and the KV-aware
score (disagg/kv_index.py), the kv-routing experiment's settings and hit-rate ceiling (SmolLM2's tokenizer) and the
interference experiment's workload are built here from nanoserve/ and must appear in the chapter word for word; the
tables of section 2 must be what the committed notebook printed."""

import inspect
import re

from nanoserve.bench import experiment, kv_routing
from nanoserve.bench.experiment import INTERFERENCE_DEFAULTS
from nanoserve.bench.interference import LONG_OUTPUT, STREAM_OUTPUT, STREAM_PROMPT
from nanoserve.bench.routing import TURNS, workload
from nanoserve.disagg import receive
from nanoserve.disagg.connector import SharedMemoryConnectorScheduler, SharedMemoryConnectorWorker
from nanoserve.disagg.kv_index import KVIndex, choose_replica
from nanoserve.disagg.proxy import prefill_body
from nanoserve.engine.config import KVTransferConfig
from nanoserve.memory import kv_bytes_per_token
from nanoserve.model import LlamaConfig
from nanoserve.server.kv_events import KVEventPublisher
from tests.chapter_text import chapter, command_defaults, normalise, notebook_output, says, table_rows, word

CH = "17"
# the notebook's configurations (cell 7): name -> (config, KV dtype, bytes per value, parameters)
MODELS = {
    "SmolLM2-135M (fp32 here)": (LlamaConfig(), "fp32", 4, None),
    "Llama-3-8B": (LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
                   "bf16", 2, 8e9),
    "Llama-3-70B": (LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
                    "bf16", 2, 70e9),
}
LINKS = {"100 Gb/s Ethernet / RDMA": 12.5e9, "PCIe Gen4 x16": 32e9, "400 Gb/s RDMA (one NIC)": 50e9,
         "NVLink 4 (H100, one direction)": 450e9}
H100 = 495e12  # the assumed FLOP/s: half an H100's dense bf16 peak


def size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def test_what_moves():
    out = notebook_output(CH)
    for name, (c, dtype, nbytes, _) in MODELS.items():
        b = kv_bytes_per_token(c, dtype)
        says(CH, f"| {name} | 2 · {c.num_hidden_layers} · {c.num_key_value_heads} · {c.head_dim} · {nbytes} = {b:,} | "
                 f"{size(4096 * b)} |")
        assert normalise(f"{b:,.0f} {14 * b / 1e6:.2f} MB {1024 * b / 1e6:.1f} MB {4096 * b / 1e6:.1f} MB") in out
    says(CH, "The KV of one token is chapter 04's formula, 2 · layers · kv_heads · head_dim · bytes")


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.1f} ms"


def test_how_fast_it_must_move():
    rows = {r[0]: r for r in table_rows(CH, "|".join(map(re.escape, LINKS)))}
    out = notebook_output(CH)
    per_token = {m: kv_bytes_per_token(MODELS[m][0], "bf16") for m in ("Llama-3-8B", "Llama-3-70B")}
    for link, bw in LINKS.items():
        times = [4096 * per_token[m] / bw for m in per_token]
        assert rows[link][1:] == [f"{bw / 1e9:g} GB/s", *map(fmt_ms, times)], link
        assert f"{times[0] * 1e3:.1f} ms {times[1] * 1e3:.1f} ms" in out
    rates = {}
    for m, b in per_token.items():
        params, gpus = MODELS[m][3], 1 if m == "Llama-3-8B" else 8
        s = 2 * params / (gpus * H100)
        rates[m] = b / s
        assert f"{s * 1e6:.0f} us per prefill token -> {rates[m] / 1e9:.1f} GB/s of KV" in out
    s8, s70 = 2 * 8e9 / H100, 2 * 70e9 / (8 * H100)
    says(CH, f"at an assumed {H100 / 1e12:.0f} TFLOP/s per H100 (half its dense bf16 peak). Llama-3-8B\n"
             f"({8e9 * 2 / 1e9:.0f} GB in bf16) fits one H100: 2 · 8·10⁹ / {H100 / 1e12:.0f}·10¹² = {s8 * 1e6:.0f} µs per "
             f"token, and {per_token['Llama-3-8B']:,} B / {s8 * 1e6:.0f} µs = **{rates['Llama-3-8B'] / 1e9:.1f} GB/s**")
    says(CH, f"({70e9 * 2 / 1e9:.0f} GB of bf16 weights against 80 GB): take a tensor-parallel node of 8 H100s,\n"
             f"8 · {H100 / 1e12:.0f} = {8 * H100 / 1e12:,.0f} TFLOP/s, so 2 · 70·10⁹ / {8 * H100 / 1e12:,.0f}·10¹² = "
             f"{s70 * 1e6:.0f} µs per token, and {per_token['Llama-3-70B']:,} B / {s70 * 1e6:.0f} µs = "
             f"**{rates['Llama-3-70B'] / 1e9:.1f} GB/s** of\nKV")
    ethernet = LINKS["100 Gb/s Ethernet / RDMA"]
    says(CH, f"100 Gb/s Ethernet ({ethernet / 1e9:g} GB/s) keeps up with the 8B GPU with a "
             f"{ethernet / rates['Llama-3-8B']:.0f}× margin and with the 70B node with only\n{ethernet / 1e9:g} / "
             f"{rates['Llama-3-70B'] / 1e9:.1f} ≈ **{ethernet / rates['Llama-3-70B']:.1f}×**")
    assert MODELS["Llama-3-70B"][0].num_attention_heads == 64  # "a model without grouped-query attention (64 KV heads, not 8)"
    says(CH, f"({MODELS['Llama-3-70B'][0].num_attention_heads} KV heads, not {MODELS['Llama-3-70B'][0].num_key_value_heads})")


def test_the_connectors_two_halves():
    for name, half in (("get_num_new_matched_tokens", SharedMemoryConnectorScheduler),
                       ("update_state_after_alloc", SharedMemoryConnectorScheduler),
                       ("build_connector_meta", SharedMemoryConnectorScheduler),
                       ("request_finished", SharedMemoryConnectorScheduler),
                       ("start_load_kv", SharedMemoryConnectorWorker), ("wait_for_layer_load", SharedMemoryConnectorWorker),
                       ("save_kv_layer", SharedMemoryConnectorWorker), ("wait_for_save", SharedMemoryConnectorWorker)):
        assert callable(getattr(half, name))
        says(CH, f"`{name}(")


def test_where_received_kv_lands():
    prompt, remote, hit, table, bs = 10, 10, 4, [7, 2, 5], 4
    n = receive.num_tokens_to_receive(prompt, remote, hit)
    says(CH, f"prompt {prompt} tokens, remote computed {remote}, local prefix hit {hit} (one block of {bs})\n"
             f"receive {prompt} - 1 - {hit} = {n} tokens, positions [{hit}, {hit + n}); our table {table}: slots "
             f"{receive.receive_slots(table, hit, n, bs)}")


def test_the_transfer_settings_and_the_proxy():
    config = KVTransferConfig()
    says(CH, f"`KVTransferConfig` ({config.kv_release_timeout_s:.0f} s by default)")
    says(CH, f"`kv_role`:\n`{KVTransferConfig().kv_role}` or `{KVTransferConfig('kv_consumer').kv_role}`")
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "n": 2, "logprobs": 3}
    first = prefill_body(body)
    assert {"stream", "n", "logprobs"}.isdisjoint(first) and first["prompt"] == "hi"
    params = ", ".join(f'"{k}": {str(v).lower()}' for k, v in first["kv_transfer_params"].items())
    says(CH, f'with `max_tokens: {first["max_tokens"]}` and `kv_transfer_params: {{{params}}}`, its `stream`, `n` and '
             f'`logprobs` fields\ndropped')


def test_the_index_and_the_score():
    index = KVIndex()
    h0, h1, h2 = 101, 102, 103
    index.apply("a", ["BlockStored", [h0, h1, h2], None, [], 16, None, "GPU", None])
    index.apply("b", ["BlockStored", [h0, h1], None, [], 16, None, "GPU", None])
    matches = index.longest_prefix([h0, h1, h2], ["a", "b"])
    queues, cost = {"a": 3, "b": 0}, kv_routing.LOAD_COST
    scores = {r: matches[r] - cost * queues[r] for r in matches}
    says(CH, f"-> matches {{a: {matches['a']}, b: {matches['b']}}}")
    says(CH, f"score = matches - {cost:g} · queue: queues {{a: 3, b: 0}} -> a: {scores['a']:g}, b: {scores['b']:g} -> "
             f"{choose_replica(matches, queues, load_cost=cost)}")


def test_the_kv_routing_experiment(smollm2_tokenizer):
    args = command_defaults(experiment, "experiment", "kv-routing")
    says(CH, f"under {word(len(kv_routing.ROUTERS))} routers")
    every = inspect.signature(KVEventPublisher).parameters["interval_s"].default
    says(CH, f"the KV-aware router on its events as published (every {every * 1000:.0f} ms)")
    says(CH, f"{args.replicas} replicas of {args.num_blocks} blocks, {args.num_users} users × {TURNS} turns")
    says(CH, f"outlasts the {every * 1000:.0f} ms publishing interval")
    prompts = [smollm2_tokenizer.encode_chat(item["messages"]) for item in workload(args.num_users)]
    hit = 0
    for u in range(args.num_users):
        first, second = prompts[u], prompts[args.num_users + u]
        common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // 16 * 16
        hit += (TURNS - 1) * common
    ceiling = f"{hit / sum(map(len, prompts)):.1%}".replace("%", " %")
    says(CH, f"{ceiling} is this workload's ceiling")
    says(CH, f"which\nfor these prompts comes to {ceiling}")
    for router in ("prefix (chapter 16)", "KV-aware (events as published)"):
        says(CH, f"| {router} | {ceiling} | 0 |")
    command_defaults(experiment, "experiment", "kv-routing", "--workload", "per-user", "--replicas", "2", "--num-blocks",
                     "48", "--num-users", "6")


def test_the_shared_prompts_workload(smollm2_tokenizer):
    """Section 6's shared-prompts workload, in SmolLM2's tokens: the blocks every user shares, and what a user's
    later turns find of their earlier ones."""
    assert next(iter(kv_routing.WORKLOADS)) == "shared-prompts" and command_defaults(
        experiment, "experiment", "kv-routing").workload is None  # no --workload: the first one
    says(CH, "(`--workload shared-prompts`, the default)")
    users = command_defaults(experiment, "experiment", "kv-routing").num_users
    prompts = [smollm2_tokenizer.encode_chat(item["messages"]) for item in kv_routing.shared_prompts(users)]

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    shared = min(common(prompts[0], p) for p in prompts[1:users])
    says(CH, f"its system prompt, {shared // 16} full blocks, is every user's")
    found = [common(prompts[i], prompts[i + users]) // 16 for i in range(len(prompts) - users)]
    says(CH, f"so turns 2 and 3 find {min(found)} to {max(found)} blocks cached")


def test_the_interference_experiment():
    d = INTERFERENCE_DEFAULTS
    says(CH, f"{d['streams']} clients stream one request after another (a {STREAM_PROMPT}-token prompt, {STREAM_OUTPUT} "
             f"output tokens, greedy, EOS\nignored) while {d['long_prompts']} prompts of {d['long_len']:,} tokens arrive, "
             f"one every {d['long_every']:g} s, each asking {LONG_OUTPUT} tokens")
    budgets = d["budgets"]
    says(CH, f"at chapter 06's budgets, {budgets[0]}, {budgets[1]} and {budgets[2]:,} tokens per step")
    says("06", f"budgets {budgets[0]}, {budgets[1]} and {budgets[2]} and chunking off")  # its full-size prefill-budget run
    assert budgets[-1] >= d["long_len"]
    says(CH, f"{budgets[-1]:,} tokens put a whole {d['long_len']:,}-token prompt in one step")
    per_token = kv_bytes_per_token(LlamaConfig(), "fp32")
    says(CH, f"({per_token:,} B per token in float32: {d['long_len'] * per_token / 1e6:.0f} MB for {d['long_len']:,} tokens")


def test_the_interference_table_and_its_reading():
    """Section 7's ratios, recomputed from its own table."""
    rows = {name.strip(): [float(x) for x in cells.split()[::2][:4]] + [float(cells.split()[-2])]
            for name, cells in re.findall(r"((?:colocated, budget \d+|disaggregated, 1 \+ 1 threads)) +"
                                          r"((?:\d+ ms +){4}[\d.]+ +\d+)", chapter(CH))}
    pair = rows.pop("disaggregated, 1 + 1 threads")  # ITL p50, p99, TTFT p50, p99, out tok/s
    assert len(rows) == 3
    co = list(rows.values())
    says(CH, f"its p99 is {pair[1]:.0f} ms: {min(c[1] for c in co) / pair[1]:.1f}× lower than the smallest budget's, "
             f"{max(c[1] for c in co) / pair[1]:.1f}× lower than the largest's")
    says(CH, f"{pair[0]:.0f} ms against {min(c[0] for c in co):.0f}–{max(c[0] for c in co):.0f}")
    says(CH, f"an undisturbed decode step is {pair[0] / max(c[0] for c in co):.1f}× slower")
    says(CH, f"{pair[2] / 1000:.1f} s at p50 against {min(c[2] for c in co) / 1000:.1f}–{max(c[2] for c in co) / 1000:.1f} s, "
             f"{pair[2] / max(c[2] for c in co):.1f}–{pair[2] / min(c[2] for c in co):.1f}× longer")
    assert 0.04 < max(abs(pair[4] / c[4] - 1) for c in co) <= 0.05  # "within 5 %" (and not within 4 %)
    small, large = rows["colocated, budget 256"], rows["colocated, budget 2048"]
    says(CH, f"ITL\n  p99 {large[1] / small[1]:.1f}× worse, TTFT p50 {small[2] / large[2]:.1f}× better")


def test_the_transfer_timeline():
    """Section 2's overlap figures are what notebook 17's transfer timeline cell printed, and its bytes are chapter
    04's formula."""
    out = notebook_output(CH)
    c, n = LlamaConfig(), 512
    machine = re.search(r"machine: (.+?), (\d+) cores, load average ([\d.]+), torch threads (\d+)", out)
    per_layer = re.search(r"per layer \(mean of (\d+)\): compute ([\d.]+) ms, save ([\d.]+) ms", out)
    step = re.search(r"the prefill step: ([\d,]+) ms; the layers' compute [\d,]+ ms, the saves ([\d.]+) ms = "
                     r"([\d.]+)% of the prefill", out)
    overlap = re.search(r"a perfect layer-wise overlap hides the saves of layers 0-\d+: ([\d.]+) ms = ([\d.]+)% of", out)
    assert machine and per_layer and step and overlap, "notebook 17 printed the transfer timeline"
    layer_bytes = 2 * c.num_key_value_heads * c.head_dim * 4 * n
    assert layer_bytes * c.num_hidden_layers == n * kv_bytes_per_token(c, "fp32")
    assert f"= {layer_bytes:,} B (the segment's layer: True); per request {layer_bytes * c.num_hidden_layers:,} B" in out
    table = [(float(cm), float(sv)) for _, cm, sv in re.findall(rf"(\d+) +([\d.]+) +([\d.]+) +{layer_bytes:,}", out)]
    assert len(table) == c.num_hidden_layers
    hidden = sum(sv for _, sv in table[:-1])  # what overlap hides: every save but the last, from the table's rows
    assert abs(hidden - float(overlap[1])) <= 0.01 * len(table) and hidden <= float(step[2])
    sooner = float(re.search(r"overlapped [\d,.]+ ms \(([\d.]+) ms sooner\)", out)[1])
    assert abs(sooner - float(overlap[1])) <= 0.05  # the drawn timeline gains exactly the hidden saves
    says(CH, f"Notebook 17's transfer timeline cell measures it on SmolLM2 in float32 ({machine[1]}, {machine[2]} cores, "
             f"load average {machine[3]}, torch threads {machine[4]}): a {n}-token prompt saves {layer_bytes:,} B per "
             f"layer, 2 · {c.num_key_value_heads} · {c.head_dim} · 4 · {n} as chapter 04's formula says, "
             f"{layer_bytes * c.num_hidden_layers:,} B per request")
    says(CH, f"A layer computes for {per_layer[2]} ms and its save takes {per_layer[3]} ms; the {per_layer[1]} saves are "
             f"{step[2]} ms of a {step[1]} ms prefill, {step[3]} %, and a perfect layer-wise overlap would hide all but "
             f"the last, {overlap[1]} ms or {overlap[2]} % of the prefill")
