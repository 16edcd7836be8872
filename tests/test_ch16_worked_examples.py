"""Chapter 16's worked examples, computed by the code: the decisions on queues {a: 3, b: 1} and two choices by rank
(cluster/routing.py), the balls-into-bins and hash-ring figures of the notebook (rerun here and compared with what it
printed), the routers' settings and Ray Serve's probing, the routing experiment's workload, hit-rate ceilings and
the prefix policy's decisions on it (bench/routing.py, SmolLM2's tokenizer), the autoscaling trace's settings, the
capacity and Little's-law arithmetic from chapter 09's figures, the vLLM-named gauges and KV events, and the head
splits behind section 8 are built here from nanoserve/ and must appear in the chapter word for word."""

import ast
import inspect
import math
import random
from collections import Counter
from fractions import Fraction

import pytest
from prometheus_client import generate_latest

from nanoserve.bench import experiment, routing as bench_routing
from nanoserve.cluster import policies, routing
from nanoserve.distributed.shard import check_tp_size, split_heads
from nanoserve.model import LlamaConfig
from nanoserve.server.api_server import ServerConfig
from nanoserve.server.kv_events import KVEventPublisher, hash_bytes
from nanoserve.server.metrics import PrometheusStatLogger
from tests.chapter_text import ROOT, command_defaults, notebook_output, says, table_rows, word

CH = "16"


def test_the_decisions_on_two_queues():
    queues = {"a": 3, "b": 1}
    says(CH, "With queue lengths {a: 3, b: 1}")
    turns = ", ".join(routing.round_robin(queues, t) for t in range(4))
    says(CH, f"| round robin (`round-robin`) | {turns}, ... |")
    says(CH, f"| least loaded | {routing.least_loaded(queues)} |")
    assert {routing.power_of_two_choices(queues, random.Random(s)) for s in range(20)} == {"b"}  # two replicas: both drawn
    prompt, out, question, answer = 2000, 500, 20, 5
    says(CH, f"a {prompt}-token prompt with {out} output tokens\nis a hundred times a {question}-token question with {answer}")
    assert (prompt + out) / (question + answer) == 100


def test_two_choices_by_rank():
    n = 4
    shares = [Fraction(n - 1 - k, math.comb(n, 2)) for k in range(n)]
    says(CH, f"for n = {n} that is {', '.join(map(str, shares[:-1]))} and {shares[-1]} — the longest queue never wins")
    rng = random.Random(7)  # the notebook's first cell
    wins = Counter(routing.power_of_two_choices({"a": 0, "b": 1, "c": 2, "d": 3}, rng) for _ in range(6000))
    measured = [wins[k] / 6000 for k in "abcd"]
    says(CH, f"| two choices among queues 0 < 1 < 2 < 3, 6000 requests: share of each | "
             f"{', '.join(map(str, shares[:-1]))}, {shares[-1]} | {', '.join(f'{x:.3f}' for x in measured[:-1])}, "
             f"{measured[-1]:.0f} |")
    assert "rank shares: " + str({k: round(wins[k] / 6000, 3) for k in "abcd"}) in notebook_output(CH)


def test_balls_into_bins():
    def fullest(n, m, seed):  # the notebook's first cell
        rng, names = random.Random(seed), [f"r{i}" for i in range(n)]
        rand, two = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
        for _ in range(m):
            rand[rng.choice(names)] += 1
            two[routing.power_of_two_choices(two, rng)] += 1
        return max(rand.values()), max(two.values())

    ln, out, rows = math.log, notebook_output(CH), table_rows(CH, ".*(requests on|same, two choices).*")
    for n, m, (random_row, two_row) in ((10, 1000, rows[:2]), (1000, 1000, rows[2:4])):
        runs = [fullest(n, m, seed) for seed in range(5)]
        assert (f"{m} requests on {n} replicas (mean {m // n}), fullest over seeds 0-4: random {[r for r, _ in runs]} "
                f"two choices {[t for _, t in runs]}") in out
        over = m // n if n < m else 0  # heavily loaded: the excess over the mean
        lo, hi = min(r for r, _ in runs) - over, max(r for r, _ in runs) - over
        (two,) = {t - over for _, t in runs}
        assert random_row[2] == f"{lo} – {hi}" and two_row[2] == str(two)
        if n < m:
            assert random_row[1] == f"√(2 · {m // n} · ln {n}) ≈ {math.sqrt(2 * m / n * ln(n)):.0f}"
            assert two_row[1] == f"ln ln {n} / ln 2 ≈ {ln(ln(n)) / ln(2):.1f}"
        else:
            assert random_row[1].startswith(f"ln n / ln ln n ≈ {ln(n) / ln(ln(n)):.1f}")
            assert two_row[1] == f"ln ln n / ln 2 ≈ {ln(ln(n)) / ln(2):.1f}"


def test_the_hash_ring():
    moved = sum(h % 3 != h % 4 for h in range(12))  # over a period of both moduli
    says(CH, f"3 → 4 replicas moves\n{Fraction(moved, 12)} of them")
    ring = routing.HashRing(["a", "b", "c"])
    says(CH, f"v = {ring.vnodes}: {1 / math.sqrt(ring.vnodes):.1%})".replace("%", " %"))
    assert inspect.signature(policies.PrefixAffinity).parameters["vnodes"].default == ring.vnodes
    keys = range(10_000)  # the notebook's second cell
    before = {k: ring.lookup(k) for k in keys}
    ring.add("d")
    on_ring = sum(before[k] != ring.lookup(k) for k in keys) / len(keys)
    mod_n = sum(routing.ring_point(str(k)) % 3 != routing.ring_point(str(k)) % 4 for k in keys) / len(keys)
    says(CH, f"{on_ring:.0%} of 10 000 keys move on the ring, {mod_n:.0%} with `mod n`".replace("%", " %"))
    assert f"ring: {on_ring:.1%} of keys move" in notebook_output(CH) and f"hash mod n: {mod_n:.1%} move" in notebook_output(CH)
    assert max(routing.ring_point(str(k)) for k in keys).bit_length() == 64  # "a circle of 2⁶⁴ positions"
    says(CH, "a circle of 2⁶⁴ positions")


def test_the_routers_settings():
    from ray.serve._private import constants as serve

    from nanoserve.cluster.client import MAX_ROUTED_BLOCKS
    from nanoserve.cluster.deploy import fleet
    from nanoserve.cluster.router import PolicyRouter

    says(CH, f"`client.routing_hashes`, at most {MAX_ROUTED_BLOCKS} blocks")
    tries = inspect.signature(PolicyRouter.initialize_state).parameters["owner_tries"].default
    deadline, cap = serve.RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S, serve.RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S
    probes = " + ".join(f"{min(deadline * 2 ** i, cap):g}" for i in range(tries))
    says(CH, f"its first `owner_tries` ({tries}) calls on a request ({probes} s of probing)")
    says(CH, f"an entry with no news for {serve.RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S:g} s is stale")
    says(CH, f"*probing* the replica with a deadline of {deadline:g} s, doubled per retry")
    fleet_defaults = inspect.signature(fleet).parameters
    says(CH, f"| power of two choices (`{fleet_defaults['router'].default}`, the default) |")
    says(CH, f"reserves `--replica-cpus` CPUs (default {fleet_defaults['replica_cpus'].default})")
    says(CH, f"`imbalance`\nis {inspect.signature(policies.PrefixAffinity).parameters['imbalance'].default}")


@pytest.fixture(scope="module")
def prompts():
    """The routing experiment's prompts for its 9 users, and for the default number of users, as token ids."""
    from nanoserve.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf()
    default = command_defaults(experiment, "experiment", "routing").num_users
    return {n: [tokenizer.encode_chat(item["messages"]) for item in bench_routing.workload(n)] for n in (9, default)}


def shared(a: list[int], b: list[int], block_size: int = 16) -> int:
    """The full blocks' tokens two prompts share: what a repeat can hit."""
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return common // block_size * block_size


def test_the_routing_experiments_workload(prompts):
    users, turns = 9, bench_routing.TURNS
    ids = prompts[users]
    (length,) = {len(p) for p in ids}
    (common,) = {shared(ids[u], ids[users + u]) for u in range(users)}
    says(CH, f"it serves {users} users × {turns} turns through each\nsystem, {bench_routing.CONCURRENCY} requests in "
             f"flight, {bench_routing.OUTPUT_LEN} output tokens each, SmolLM2. Every prompt is **{length} tokens** (the "
             f"chat template\nincluded), of which a user's turns share {common // 16} full blocks, **{common} tokens**")
    says(CH, f"warms it up with {bench_routing.WARMUP_REQUESTS} short requests that share nothing with the users")
    ceiling = (turns - 1) * common / (turns * length)
    says(CH, f"so the hit rate's ceiling is {turns - 1} × {common} / ({turns} × {length}) = **{ceiling:.1%}**"
         .replace("%", " %"))
    says(CH, f"a repeat that hits\nprefills {length - common} tokens, not {length}")
    says(CH, f"every engine may batch up to {bench_routing.MAX_NUM_SEQS} sequences, but with "
             f"{bench_routing.CONCURRENCY}\nrequests in flight the one replica batches all {bench_routing.CONCURRENCY} "
             f"while each of two replicas batches about {bench_routing.CONCURRENCY // 2}")
    says(CH, f"with {bench_routing.CONCURRENCY} requests in flight no replica can be more than "
             f"{bench_routing.CONCURRENCY} busier than the other")

    def round_robin_hits(n, offset):
        seen, hit = set(), 0
        for i, p in enumerate(prompts[n]):
            user, replica = i % n, (i + offset) % 2
            hit += shared(p, prompts[n][user]) if (user, replica) in seen else 0
            seen.add((user, replica))
        return hit / sum(map(len, prompts[n]))

    rr = {round(round_robin_hits(users, offset), 4) for offset in (0, 1)}
    assert rr == {round(common / (turns * length), 4)}
    says(CH, f"so only turn 3 hits — {common} / ({turns} × {length}) = **{common / (turns * length):.1%}**"
         .replace("%", " %"))
    default = command_defaults(experiment, "experiment", "routing").num_users
    assert default % 2 == 0 and round(round_robin_hits(default, 0), 4) == round(ceiling, 4)
    says(CH, f"The default of {default} users would fall into it")


def test_the_prefix_policy_on_the_experiment(prompts):
    from nanoserve.cluster.client import routing_hashes

    policy = policies.make_policy("prefix", routing)
    kinds = Counter()
    for p in prompts[9]:
        choice = policy.choose(routing_hashes(p, 16), {"r1": 0, "r2": 0})
        policy.routed(routing_hashes(p, 16), choice.replica)
        kinds[choice.kind] += 1
    says(CH, f"for the users' requests, `new` {kinds['new']} times and\n`owner` {kinds['owner']})")


def test_autoscaling():
    from ray.serve.config import AutoscalingConfig

    says(CH, f"every `metrics_interval_s` ({AutoscalingConfig().metrics_interval_s:g} s by default")
    (tree,) = [f for f in ast.parse((ROOT / "tests/test_ch16_replicas.py").read_text()).body
               if getattr(f, "name", "") == "test_autoscaling_follows_a_burst_and_the_idle_after"]
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Autoscaling"]
    fast = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    (delay,) = [ast.literal_eval(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call)
                for k in n.keywords if k.arg == "step_delay_s"]
    says(CH, f"runs it on the tiny model ({delay:g} s per step) with\nsecond-long delays (target "
             f"{fast['target_ongoing_requests']}, `upscale_delay_s` {fast['upscale_delay_s']:g}, `downscale_delay_s` "
             f"{fast['downscale_delay_s']:g}, `metrics_interval_s` {fast['metrics_interval_s']:g},\n`look_back_period_s` "
             f"{fast['look_back_period_s']:g})")
    trace = inspect.signature(bench_routing.autoscaling_trace).parameters
    clients = trace["clients"].default
    says(CH, f"{word(clients)} clients, each sending its next {trace['max_tokens'].default}-token completion")
    assert trace["interval_s"].default == 0.5  # "sampled every half second"
    wanted = min(fast["max_replicas"], math.ceil(clients / fast["target_ongoing_requests"]))
    says(CH, f"{clients} ongoing / target {fast['target_ongoing_requests']} → {wanted} (the max)")
    rows = [(float(r[0].split()[0]), int(r[1]), int(r[2]), int(r[3].split()[0]))
            for r in table_rows(CH, r"[\d.]+( – [\d.]+)?") if len(r) == 4]  # seconds, running, starting, in flight
    decided = next(s for s, _, starting, _ in rows if starting)
    up = next(s for s, running, _, _ in rows if running == 2)
    idle_from = next(s for s, _, _, flight in rows if s > up and flight == 0)
    down = rows[-1][0]
    assert rows[-1][1] == fast["min_replicas"]
    says(CH, f"{down - idle_from:.1f} s idle: the look-back ({fast['look_back_period_s']:g} s), the down delay "
             f"({fast['downscale_delay_s']:g} s)")
    says(CH, f"The decision took about {decided:.1f} s")
    says(CH, f"the replica took {up - decided:.1f} s more to start")


def test_capacity_and_littles_law():
    (c4,), (c16,) = table_rows("09", r"4 \(\d+\)"), table_rows("09", r"16 \(\d+\)")  # clients (requests)
    rate = float(c4[2])
    ttft_mean, _, _, ttft_p99 = (float(x.replace(",", "")) for x in c4[3].removesuffix(" ms").split(" / "))
    tpot_mean = float(c4[4].split(" / ")[0])
    p99_16 = float(c16[3].removesuffix(" ms").split(" / ")[3].replace(",", ""))
    says(CH, f"(on the Zen 4 VM of chapter 09, at load 3.3–5.2: 4 clients, {rate} requests/s\nat a TTFT p99 of "
             f"{ttft_p99 / 1000:.1f} s; at 16 clients the p99 was {p99_16 / 1000:.1f} s)")
    lam, mu, headroom = 800, 12, 0.3
    per = mu * (1 - headroom)
    says(CH, f"replicas = ceil({lam} / ({mu} × {1 - headroom:g})) = ceil({lam / per:.1f}) = {math.ceil(lam / per)} GPUs at "
             f"peak; at the night\ntrough of 50 requests/s, ceil(50 / {per:.1f}) = {math.ceil(50 / per)}")
    per70 = 4 * (1 - headroom)
    says(CH, f"needs ceil({lam} / {per70:.1f}) = {math.ceil(lam / per70)} replicas = {4 * math.ceil(lam / per70)} GPUs")
    w = 4 / rate
    n_out = 16
    says(CH, f"4 clients in flight at {rate} requests/s is W = 4 / {rate} ≈ {w:.1f} s\na request (its mean TTFT of "
             f"{ttft_mean / 1000:.1f} s plus {n_out - 1} gaps of {tpot_mean / 1000:.2f} s, the mean TPOT, agree with it")
    assert abs(ttft_mean / 1000 + (n_out - 1) * tpot_mean / 1000 - w) < 0.2  # mean E2E = mean TTFT + 15 mean gaps
    assert "num_prompts=max(4, 2 * c)" in inspect.getsource(experiment.concurrency)
    says(CH, f"requests — {max(4, 2 * 4)} of them at 4 clients, `max(4, 2 × concurrency)` per level")
    says(CH, f"a target of 4 ongoing\nrequests per replica, {4 * (1 - headroom):.1f} with 30 % headroom")
    out = notebook_output(CH)
    assert f"W = L / lambda = {w:.1f} s per request" in out and f"= {4 * (1 - headroom):.1f}" in out


def test_what_a_fleet_router_reads():
    name = ServerConfig().model_name
    logger = PrometheusStatLogger(name, compat="vllm")
    lines = [line for line in generate_latest(logger.registry).decode().splitlines() if line.startswith("vllm:")]
    says(CH, "$ curl -s localhost:8000/metrics | grep ^vllm:\n" + "\n".join(sorted(lines, key=lambda l: (
        "running" not in l, "waiting" not in l))))
    assert len(lines) == 3
    says(CH, f"sends them every {inspect.signature(KVEventPublisher).parameters['interval_s'].default * 1000:.0f} ms")
    says(CH, f"sent as {len(hash_bytes(2**255))} bytes")


def test_tensor_parallel_splits():
    def splits(config, check):
        ways = []
        for n in range(1, config.num_attention_heads + 1):
            try:
                check(config, n)
                ways.append(n)
            except ValueError:
                pass
        return ways

    smol, tiny = LlamaConfig(), LlamaConfig.tiny()
    ways, heads = splits(smol, check_tp_size), splits(smol, split_heads)  # the whole model, its heads alone
    assert set(ways) < set(heads)
    says(CH, f"SmolLM2 splits only {', '.join(map(str, ways[:-1]))} or {ways[-1]} ways (its {smol.num_attention_heads} "
             f"heads would split {heads[-1]} ways, its {smol.intermediate_size} MLP features not)")
    assert 3 in ways  # the command's --tensor-parallel-size 3
    assert 2 in splits(tiny, check_tp_size)
    says(CH, f"the tiny model ({tiny.num_attention_heads} heads,\n2 ways)")
