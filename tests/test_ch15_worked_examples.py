"""Chapter 15's worked examples, computed by the code: the fair policy's virtual times, the laxity example and the
contended schedule under EDF and least laxity first (SLOPolicy on chapter 06's Scheduler), the swap-or-recompute
arithmetic, a refusal's message, the fairness property at 10:1, the workloads of `bench experiment scheduling` and
`noisy-neighbour`, the alert rules of deploy/prometheus/alerts.yml and `bench bluegreen`'s defaults are built here
from nanoserve/ and must appear in the chapter word for word; the figures it shares with the notebook must be what
the notebook printed, and the claims it draws from its measured tables (which ranges overlap, the ratios, the
differences) are recomputed from those tables."""

import math
import re
from fractions import Fraction

import yaml

from nanoserve.bench import bluegreen, experiment
from nanoserve.bench.scheduling import (BLOCK_SIZE, BUDGET, NOISY_BUDGET, NOISY_SEATS, NUM_BLOCKS, TARGETS_IN_STEPS,
                                        noisy_workload, workload)
from nanoserve.engine.config import SchedulerConfig
from nanoserve.engine.policies import SLOTargets
from nanoserve.engine.policies.base import FCFSPolicy
from nanoserve.engine.policies.fair import FairPolicy
from nanoserve.engine.policies.slo import STEP_S_WEIGHT, SLOPolicy, steps_for
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.kv.block_manager import BlockManager
from nanoserve.memory import kv_bytes_per_token
from nanoserve.metrics import percentile
from nanoserve.model import LlamaConfig
from nanoserve.sampling import SamplingParams
from nanoserve.server.api_server import ServerConfig
from tests.chapter_text import ROOT, chapter, command_defaults, notebook_output, says, table_rows, word

CH = "15"
SMOL = LlamaConfig()


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_the_tenants_file_and_the_defaults():
    assert SchedulerConfig().policy == "priority"
    says(CH, "`priority` (chapter 06's order, still")
    fair = FairPolicy({"chat": 4})
    for tenant in ("chat", "batch"):
        fair.on_scheduled(Sequence(tenant, [1] * 7, 1, tenant=tenant), 7)
    vt = {t: Fraction(v) for t, v in fair.virtual_time.items()}
    says(CH, f"virtual times after one 7-token request per tenant are exactly {vt['chat']} and {vt['batch']}\n"
             f"(weights {7 / vt['chat']} and {7 / vt['batch']})")  # batch: no weight given, 1
    says(CH, f"A tenant's `weight = {fair.weights['chat']}` ({word(fair.weights['chat'])} times the share of a weight-1 "
             f"tenant)")


def test_why_fcfs_fails_under_bursts():
    prompt, burst = len(workload(1024)[0][2]), 6
    says(CH, f"a batch tenant sends {word(burst)} {prompt}-token prompts")
    says(CH, f"the step's token budget ({BUDGET} here) goes to the batch prompts' chunks for ~{burst * prompt // BUDGET} steps")


def test_laxity_takes_the_steps_left():
    llf, edf = SLOPolicy(budget=128, step_s=0.02), SLOPolicy(budget=128, step_s=0.0)
    a = Sequence("A", [1] * 10, 8, arrival_time=0.0, slo=SLOTargets(ttft_ms=1000, tpot_ms=50))
    a.num_computed_tokens = 10
    a.append_token(7, now=1.0)  # the first token at 1.0: the next is due 50 ms later
    b = Sequence("B", [1] * 510, 8, arrival_time=0.3, slo=SLOTargets(ttft_ms=800))
    b.num_computed_tokens = 10
    left = b.num_tokens - b.num_computed_tokens
    da, db = llf.deadline(a), llf.deadline(b)
    says(CH, f"B = {llf.budget}, step_s = {llf.step_s * 1000:.0f} ms, now = 1.00 s")
    says(CH, f"A: a decode due at {da:.2f} laxity {da:.2f} − 1.00 − {steps_for(1, 128)} · 0.02 = {llf.laxity(a, 1.0):.2f}")
    first = llf.order_running([a, b], 1.0)[0].seq_id
    assert edf.order_running([a, b], 1.0)[0].seq_id == "A"
    says(CH, f"B: {left} prompt tokens left, due {db:.2f} laxity {db:.2f} − 1.00 − {steps_for(left, 128)} · 0.02 = "
             f"{llf.laxity(b, 1.0):.2f} → {first} first; EDF would take A")
    says(CH, f"A's one token leaves {llf.budget - 1} of the budget to B")
    out = notebook_output(CH)
    for seq in (a, b):
        assert f"{seq.seq_id}: deadline {llf.deadline(seq):.2f} s" in out
        assert f"laxity {llf.laxity(seq, 1.0) * 1000:.0f} ms" in out
    says(CH, f"moving average\n(weight {STEP_S_WEIGHT:g})")
    assert SLOPolicy(128).step_s == 0  # "Before a step was measured `step_s` is 0"


def contended(step_s: float) -> tuple[list[str], list[str], dict]:
    """Budget 3, steps of 0.1 s: B (2 tokens, due 0.2) and C (5, due 0.25) at t=0, A (1 token, due 0.15) at t=0.1;
    one token wanted from each. The steps as 'B 2, C 1', who was late, and the laxities at t=0."""
    clock, arrivals, seqs, plan = Clock(), {0: [("B", 2, 200), ("C", 5, 250)], 1: [("A", 1, 50)]}, {}, []
    policy = SLOPolicy(3, step_s=step_s)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=3, policy="slo"), BlockManager(32, 4), policy=policy,
                  clock=clock)
    laxity = {}
    while len(plan) < 2 or s.has_unfinished_seqs():
        for rid, n, ttft in arrivals.get(len(plan), []):
            seqs[rid] = Sequence(rid, list(range(100 * len(seqs), 100 * len(seqs) + n)), 1, 0, clock(),
                                 SamplingParams(max_tokens=1), slo=SLOTargets(ttft_ms=ttft))
            s.add_seq(seqs[rid])
        if not plan:
            laxity = {rid: policy.laxity(q, 0.0) for rid, q in seqs.items()}
        out = s.schedule()
        plan.append(", ".join(f"{q.seq_id} {out.num_scheduled_tokens[q.seq_id]}" for q in out.scheduled_seqs))
        for q in s.update_from_output(out, {q.seq_id: 7 for q in out.scheduled_seqs if out.samples(q)}, clock()):
            s.finish_seq(q.seq_id, SequenceStatus.FINISHED_LENGTH)
        clock.t = round(clock.t + 0.1, 10)
    late = [rid for rid, q in seqs.items() if q.first_token_time > q.arrival_time + q.slo.ttft_ms / 1000 + 1e-9]
    return plan, late, laxity


def test_the_contended_budget_edf_and_llf():
    edf, late, _ = contended(0.0)
    a_due = 0.1 + 0.05
    assert late == ["A"] and len(edf) == 3
    says(CH, f"EDF t=0 {edf[0]} t=0.1 {edf[1]} (running first, A waits) t=0.2 {edf[2]} A late (0.2 > {a_due:.2f})")
    llf, late, laxity = contended(0.1)
    assert late == [] and len(llf) == 3
    says(CH, f"LLF t=0 {llf[0]} (laxity {laxity['C']:.2f} < B's {laxity['B']:.1f}) t=0.1 {llf[1]} t=0.2 {llf[2]} "
             f"every deadline met")


def test_swap_or_recompute():
    per_token = kv_bytes_per_token(SMOL, "fp32")
    says(CH, f"2 (K and V) × {SMOL.num_hidden_layers} layers ×\n{SMOL.num_key_value_heads} KV heads × {SMOL.head_dim} "
             f"dims × 4 bytes = {per_token:,} bytes per token in float32")
    says(CH, f"a\nvictim with 400 computed tokens is {400 * per_token / 1e6:.1f} MB each way")
    says(CH, f"⌈400 / 128⌉ = {steps_for(400, 128)} full-budget steps (the notebook prints both)")
    out = notebook_output(CH)
    assert f"= {per_token:,} B per token" in out
    assert f"swap {400 * per_token / 1e6:.1f} MB out and back, or recompute 400 tokens = {steps_for(400, 128)} full " \
           f"steps" in out


def test_a_refusal():
    policy = SLOPolicy(budget=128, reject=True, step_s=0.04)
    seq = Sequence("r", [1] * 20, 4, arrival_time=0.0, slo=SLOTargets(ttft_ms=500))
    reason = policy.reject_reason(seq, 1.2)
    says(CH, f"an HTTP **503 with `Retry-After: {ServerConfig().retry_after_s}`**")
    says(CH, f'OpenAI\'s error body ("{reason}")')


def test_two_tenants_at_ten_to_one_load():
    """The property of test_two_tenants_at_ten_to_one_load_share_the_tokens_equally, with the reference policies."""
    budget = int(re.search(r"two tenants at 10:1 load and a budget of (\d+) tokens a step", chapter(CH))[1])

    def gap(policy):
        clock = Clock()
        s = Scheduler(SchedulerConfig(64, budget), BlockManager(200, 4), policy=policy, clock=clock)
        for i in range(22):
            tenant = "b" if i % 11 == 10 else "a"
            s.add_seq(Sequence(f"{tenant}{i}", list(range(1000 * i, 1000 * i + 4)), 6, 0, i * 1e-3,
                               SamplingParams(max_tokens=6), tenant=tenant))
        served, worst = {"a": 0, "b": 0}, 0
        while s.has_unfinished_seqs():
            busy = {q.tenant for q in s.waiting + s.running}
            out = s.schedule()
            for q in out.scheduled_seqs:
                served[q.tenant] += out.num_scheduled_tokens[q.seq_id]
            if busy == {"a", "b"}:
                worst = max(worst, abs(served["a"] - served["b"]))
            for q in s.update_from_output(out, {q.seq_id: 7 for q in out.scheduled_seqs if out.samples(q)}, clock()):
                if q.num_output_tokens >= q.max_tokens:
                    s.finish_seq(q.seq_id, SequenceStatus.FINISHED_LENGTH)
            clock.t += 0.01
        return worst

    assert gap(FairPolicy()) <= budget + 1
    assert gap(FCFSPolicy()) > 20
    says(CH, "never differ by more than one step's budget + 1; under FCFS the difference passes 20")


def test_the_noisy_neighbour():
    arrivals = noisy_workload(1024)
    flood = [a for a in arrivals if a[4]["tenant"] == "flood"]
    victim = [a for a in arrivals if a[4]["tenant"] == "victim"]
    assert {a[0] for a in flood} == {0} and {len(a[2]) for a in flood} == {32} and {a[3] for a in flood} == {64}
    (prompt,), (out,) = {len(a[2]) for a in victim}, {a[3] for a in victim}
    (every,) = {b[0] - a[0] for a, b in zip(victim, victim[1:])}
    says(CH, f"{len(flood)} requests of\n32 prompt + 64 output tokens at step 0, {word(len(flood) // NOISY_SEATS)} times "
             f"the engine's {NOISY_SEATS} seats — while another sends {len(victim)} requests of\n{prompt} prompt + {out} "
             f"output tokens, one every {every} steps (tiny Llama, budget {NOISY_BUDGET}, "
             f"{word(command_defaults(experiment, 'experiment', 'noisy-neighbour').rounds)} interleaved rounds)")
    says(CH, f"the flood holds all {NOISY_SEATS}")
    rows = {r[0]: [float(x) for x in r[1:]] for r in (line.split() for line in re.findall(
        r"(?:priority|fair) +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+", chapter(CH)))}
    (_, _, prio_steps, _, prio_s), (_, _, fair_steps, _, fair_s) = rows["priority"], rows["fair"]
    says(CH, f"about {prio_steps:.0f} steps to a first token")
    says(CH, f"about {fair_steps:.0f} steps, {prio_steps / fair_steps:.0f}× sooner in one sample each")
    says(CH, f"({fair_s:.0f} against {prio_s:.0f} s)")
    says(CH, f"those ~{fair_steps:.0f} steps")


def test_the_scheduling_workload():
    arrivals = workload(1024)
    batch = [a for a in arrivals if a[4]["tenant"] == "batch"]
    chat = [a for a in arrivals if a[4]["tenant"] == "interactive"]
    (every,) = {b[0] - a[0] for a, b in zip(batch, batch[1:])}
    (prompt,), (batch_out,) = {len(a[2]) for a in batch}, {a[3] for a in batch}
    (chat_prompt,), (chat_out,) = {len(a[2]) for a in chat}, {a[3] for a in chat}
    bursts = {}
    for a in chat:
        bursts[a[0]] = bursts.get(a[0], 0) + 1
    rush = [s for s, n in bursts.items() if n > 6]
    after = min(s for s in bursts if s > rush[-1])  # the bursts of six again
    assert set(bursts.values()) == {6, 12} and rush == list(range(rush[0], after, 6))
    says(CH, f"the batch tenant sends a {prompt}-token prompt every\n{every} steps ({len(batch)} requests, {batch_out} "
             f"output tokens each); the interactive tenant sends bursts of {word(6)} {chat_prompt}-token prompts every\n12 "
             f"steps ({chat_out} output tokens each), and between steps {rush[0]} and {after} a rush — "
             f"{word(12)} every 6 steps")
    says(CH, f"The step budget is {BUDGET} tokens and the pool {NUM_BLOCKS}\nblocks of {BLOCK_SIZE} "
             f"({word(NUM_BLOCKS * BLOCK_SIZE // prompt)} batch requests fill it)")
    (c_ttft, c_tpot), (b_ttft, b_tpot) = TARGETS_IN_STEPS["interactive"], TARGETS_IN_STEPS["batch"]
    says(CH, f"the interactive\ntargets are TTFT {c_ttft:g} steps and TPOT {c_tpot:g} steps, the batch tenant's "
             f"{b_ttft:g} and {b_tpot:g}")
    # the targets quoted from one timed step: one step time must give all four, and it rounds to the step quoted
    step, ttft, tpot, b_ttft_s, b_tpot_ms = re.search(
        r"one full step was timed at (\d+) ms before the runs, so the interactive targets were TTFT (\d+) ms and TPOT "
        r"(\d+) ms, the batch tenant's ([\d.]+) s and (\d+) ms", chapter(CH)).groups()
    lo, hi = 0.0, math.inf
    for quoted, steps, e in ((float(ttft), c_ttft, 0.5), (float(tpot), c_tpot, 0.5), (float(b_ttft_s) * 1000, b_ttft, 50),
                             (float(b_tpot_ms), b_tpot, 0.5)):
        lo, hi = max(lo, (quoted - e) / steps), min(hi, (quoted + e) / steps)
    assert lo < hi and round(lo) <= int(step) <= round(hi)
    s_lo, s_hi, n_lo, n_hi, ms_lo, ms_hi = map(int, re.search(
        r"the runs then took (\d+)–(\d+) s for (\d+)–(\d+) steps, (\d+)–(\d+) ms a step", chapter(CH)).groups())
    assert s_lo / n_hi * 1000 <= ms_lo and ms_hi <= s_hi / n_lo * 1000  # within what the seconds and steps allow
    says(CH, f"against targets {ms_lo / int(step):.0f}–{ms_hi / int(step):.0f}× too tight")
    says(CH, f"every target was {ms_lo / int(step):.0f}–{ms_hi / int(step):.0f}× tighter")


def ranges(cell: str) -> tuple[float, float, float]:
    """'5560 [4235–7736]' -> (5560, 4235, 7736); '0.0' -> (0, 0, 0)."""
    m = re.fullmatch(r"([\d.]+)(?: \[([\d.]+)–([\d.]+)\])?", cell)
    med = float(m[1])
    return (med, float(m[2]), float(m[3])) if m[2] else (med, med, med)


def test_the_measured_policies():
    cols = ["ttft50", "ttft99", "chat_met", "batch_met", "goodput", "rejected", "preempt", "recomp", "tok_s"]
    t = {r[0]: dict(zip(cols, map(ranges, r[1:]))) for r in table_rows(CH, "fcfs|priority|slo|slo \\+ reject|fair")
         if len(r) == 10}
    assert list(t) == ["fcfs", "priority", "slo", "slo + reject", "fair"]

    def apart(col):
        """The pairs of policies whose ranges in `col` do not overlap, as (higher, lower)."""
        return {(p, q) for p in t for q in t if t[p][col][1] > t[q][col][2]}

    def rng(p, col, fmt="{:.2f}"):
        return "–".join(fmt.format(x) for x in t[p][col][1:])

    assert apart("goodput") == {(p, q) for p in ("priority", "slo + reject") for q in ("slo", "fair")}
    says(CH, f"The {word(len(apart('goodput')))} goodput\ndifferences that hold: priority ({rng('priority', 'goodput')}) "
             f"and slo + reject ({rng('slo + reject', 'goodput')}) each above slo ({rng('slo', 'goodput')}) and above\n"
             f"fair ({rng('fair', 'goodput')})")
    says(CH, f"(fcfs {rng('fcfs', 'goodput')}, slo + reject {rng('slo + reject', 'goodput')} req/s)")
    says(CH, f"the refusals lift slo above its own run without them ({rng('slo + reject', 'goodput')} against "
             f"{rng('slo', 'goodput')} req/s)")
    assert ("slo + reject", "fcfs") not in apart("goodput") and ("slo + reject", "priority") not in apart("goodput")
    says(CH, f"chat TTFT p50 {t['slo']['ttft50'][0] / 1000:.1f} s against\npriority's {t['priority']['ttft50'][0] / 1000:.1f} s")
    others = [p for p in t if p not in ("slo", "slo + reject")]
    preempt = sorted(t[p]["preempt"][0] for p in others)
    says(CH, f"**{t['slo']['preempt'][0]:.0f} preemptions** ({rng('slo', 'preempt', '{:.0f}')}) against "
             f"{preempt[0]:.0f}–{preempt[-1]:.0f} for fcfs, priority and fair (slo + reject: "
             f"{rng('slo + reject', 'preempt', '{:.0f}')})")
    says(CH, f"({t['slo']['recomp'][0]} % of all computed tokens, priority {t['priority']['recomp'][0]} %)")
    rej = t["slo + reject"]
    says(CH, f"**slo + reject refuses {rej['rejected'][0]:.0f} % of the requests** ({rng('slo + reject', 'rejected', '{:.0f}')} %)")
    says(CH, f"chat TTFT p50 {rej['ttft50'][0]:.0f} ms\nand p99 {rej['ttft99'][0]:.0f} ms, both ranges below every other "
             f"policy's")
    assert all(("slo + reject", p) not in apart(c) and (p, "slo + reject") in apart(c)
               for c in ("ttft50", "ttft99") for p in t if p != "slo + reject")
    batch = sorted(x for p in t if p != "slo + reject" for x in t[p]["batch_met"][1:])
    assert rej["batch_met"] == (100, 100, 100)
    says(CH, f"(100 % in all\nthree rounds, the others {batch[0]:.0f}–{batch[-1]:.0f} %); preemptions fall to "
             f"{rng('slo + reject', 'preempt', '{:.0f}')} and recomputed tokens to {rng('slo + reject', 'recomp', '{:.0f}')} %")
    refuse_nothing = [p for p in t if t[p]["rejected"][0] == 0]
    assert all(("priority", p) not in apart("ttft99") and (p, "priority") in apart("ttft99")
               for p in refuse_nothing if p != "priority")
    assert t["priority"]["ttft50"][2] >= t["fair"]["ttft50"][1]  # its p50 overlaps fair's
    says(CH, f"(p99 {t['priority']['ttft99'][0] / 1000:.1f} s, its range below theirs; its p50, "
             f"{t['priority']['ttft50'][0] / 1000:.1f} s, overlaps fair's)")
    assert max(t, key=lambda p: t[p]["chat_met"][0]) == "priority"
    overlapping = [p for p in t if p != "priority" and ("priority", p) not in apart("chat_met")
                   and (p, "priority") not in apart("chat_met")]
    assert overlapping == ["fcfs", "slo + reject"]
    says(CH, f"the highest median chat met-SLO share ({t['priority']['chat_met'][0]} %), though its\nrange "
             f"({rng('priority', 'chat_met', '{:.1f}')} %) overlaps fcfs's and slo + reject's")
    says(CH, f"({rng('fair', 'ttft50', '{:.0f}')} ms against {rng('priority', 'ttft50', '{:.0f}')}: overlapping)")
    says(CH, f"(p99 {t['fair']['ttft99'][1] / 1000:.1f}–{t['fair']['ttft99'][2] / 1000:.1f} s against "
             f"{t['priority']['ttft99'][1] / 1000:.1f}–{t['priority']['ttft99'][2] / 1000:.1f} s)")
    assert max(t, key=lambda p: t[p]["ttft50"][0]) == "fcfs"
    says(CH, f"(p50 {t['fcfs']['ttft50'][0] / 1000:.1f} s: the batch prompts' prefill time)")
    recomp = sorted(t[p]["recomp"][0] for p in ("priority", "slo", "fair"))
    says(CH, f"({t['fcfs']['recomp'][0]} %) than priority, slo and fair ({recomp[0]:.0f}–{recomp[-1]:.0f} %)")
    says(CH, f"slo + reject's {rej['recomp'][0]} % ({rng('slo + reject', 'recomp', '{:.1f}')}) is as low")
    assert apart("tok_s") == {("priority", "slo + reject"), ("fair", "slo + reject")}
    says(CH, f"overlaps for every pair of policies but {word(len(apart('tok_s')))}: slo + reject (which served "
             f"{rej['rejected'][0]:.0f} % fewer\nrequests) falls below priority and fair")


def test_the_alert_rules():
    rules = {r["alert"]: r for r in yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"][0]["rules"]}
    rows = {r[0].split()[0]: r for r in table_rows(CH, "Nanoserve.*")}
    assert list(rows) == list(rules)

    def tight(expr):
        return re.sub(r"\s+\)", ")", re.sub(r"\(\s+", "(", " ".join(expr.split())))

    for name, rule in rules.items():
        quoted = rows[name][1].split("`")[1]
        pattern = ".+".join(re.escape(part) for part in tight(quoted).split("…"))
        assert re.fullmatch(pattern, tight(rule["expr"])), name
        assert rows[name][2] == rule["for"], name
    says(CH, f"| NanoserveSLORejectionsHigh ({rules['NanoserveSLORejectionsHigh']['labels']['severity']}) |")
    assert rules["NanoserveHigh5xxRate"]["labels"]["severity"] == "page"
    reject = rules["NanoserveSLORejectionsHigh"]
    share = float(re.search(r"> ([\d.]+)$", reject["expr"].strip())[1])
    page = float(re.search(r"> ([\d.]+)$", rules["NanoserveHigh5xxRate"]["expr"].strip())[1])
    says(CH, f"warns when `--slo-reject` refuses over {share:.0%} of the requests".replace("%", " %"))
    says(CH, f"for {int(reject['for'].rstrip('m'))} minutes — the 40 % of section 6 would trip it")
    # alerts_test.yml's cases, as the chapter lists them: which page, which warn
    fail, quiet, fail2, loud, warn, never = map(int, re.search(
        r"(\d+) % 503s of which (\d+) points are SLO rejections does not page, (\d+) % with (\d+) points of "
        r"rejections does; (\d+) % rejections warn after 15 minutes, (\d+) % never", chapter(CH)).groups())
    assert (fail - quiet) / 100 <= page < (fail2 - loud) / 100 and never / 100 <= share < warn / 100
    ttft = float(re.search(r"> ([\d.]+)$", rules["NanoserveTTFTOverSLO"]["expr"].strip())[1])
    says(CH, f"The TTFT rule's {ttft:g} s is an example target (`--slo-ttft-ms {ttft * 1000:.0f}`)")


def test_the_blue_green_update():
    defaults = command_defaults(bluegreen, "bluegreen")
    says(CH, f"measured with SmolLM2 and {word(defaults.clients)} streaming clients in one process")
    says(CH, f'"warmup_requests": {defaults.warmup_requests}')
    says(CH, f"(One fp32 version, weights and a {defaults.kv_cache_mib} MiB KV pool")
    assert (defaults.from_weights, defaults.to_weights) == ("fp32", "q4")  # the second row's command gives no --to
    says(CH, f"| fp32 → {defaults.to_weights} |")
    load, warm = (float(x) for x in re.search(r'"load_s": ([\d.]+), "warmup_requests": \d+, "warmup_s": ([\d.]+)',
                                               chapter(CH)).groups())
    says(CH, f"| fp32 → q4 | {load:.1f} s + {warm:.1f} s |")
    most = max(int(n) for n in re.findall(r"\| 0 of (\d+) \|", chapter(CH)))
    says(CH, f'a phase\'s "p99" (of at most {most} requests) lies between its two slowest TTFTs')
    assert all(n - 2 < percentile(list(range(n)), 99) < n - 1 for n in range(2, most + 1))
    rows = []
    for cells in table_rows(CH, "fp32 → (fp32|q4)"):
        before, during = (float(x.replace(",", "")) for x in re.findall(r"[\d,]+", cells[2])[:2])
        rss = [float(x.replace(",", "")) for x in re.findall(r"[\d,]{3,}", cells[4])]
        says(CH, f"{cells[2].split(' (')[0]} ({during / before:.1f}×)")
        assert abs(rss[2] - (rss[1] - rss[0])) <= 1  # the bench prints the difference of unrounded samples
        load_s, warm_s = (float(x) for x in re.findall(r"([\d.]+) s", cells[1]))
        rows.append((during / before, load_s + warm_s, rss))
    (r1, t1, fp32), (r2, t2, q4) = rows
    says(CH, f"here {min(r1, r2):.1f}–{max(r1, r2):.0f}× on the\ntail")
    says(CH, f"fp32 → fp32 also ends {fp32[0] - fp32[3]:.0f} MiB\nunder where it started ({fp32[3]:,.0f} MiB")
    says(CH, f"{fp32[3]:,.0f} against q4's {q4[3]:,.0f} MiB: about {fp32[3] - q4[3]:.0f} MiB")
    says(CH, f"{min(t1, t2):.0f}–{max(t1, t2):.0f} s, at +{max(fp32[2], q4[2]) / 1024:.1f} GiB of\nRSS")
