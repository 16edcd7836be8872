"""Chapter 15's worked examples, computed by the code: the fair policy's virtual times, the laxity example and the
contended schedule under EDF and least laxity first (SLOPolicy on chapter 06's Scheduler), the swap-or-recompute
arithmetic, a refusal's message, the fairness property at 10:1, the workloads of `bench experiment scheduling` and
`noisy-neighbour`, the alert rules of deploy/prometheus/alerts.yml and `bench bluegreen`'s defaults are built here
from nanoserve/ and must appear in the chapter word for word; the figures it shares with the notebook must be what
the notebook printed, and the claims it draws from its measured tables (which ranges overlap, the ratios, the
differences) are recomputed from those tables."""

import collections
import contextlib
import inspect
import io
import re
from fractions import Fraction

import yaml

from nanoserve.bench import bluegreen, scheduling
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
from nanoserve.server.versions import version_name
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


def about(quoted: str, printed: float, decimals: int = 1) -> bool:
    """Whether the integer `quoted` ("about 41") is a rounding of the value the bench printed as `printed` with
    `decimals` decimals (40.5 stands for anything in [40.45, 40.55), so 40 and 41 both qualify)."""
    half = 0.5 * 10 ** -decimals
    return printed - half - 0.5 <= int(quoted) <= printed + half + 0.5


def named(text: str) -> set[str]:
    """The policies a sentence lists: "priority's, slo's and slo + reject's" -> {"priority", "slo", "slo + reject"}."""
    return {re.sub(r"'s$", "", name.strip()) for name in re.split(r", | and ", text)}


def test_the_noisy_neighbour():
    arrivals = noisy_workload(1024)
    flood = [a for a in arrivals if a[4]["tenant"] == "flood"]
    victim = [a for a in arrivals if a[4]["tenant"] == "victim"]
    assert {a[0] for a in flood} == {0} and {len(a[2]) for a in flood} == {32} and {a[3] for a in flood} == {64}
    (prompt,), (out,) = {len(a[2]) for a in victim}, {a[3] for a in victim}
    (every,) = {b[0] - a[0] for a, b in zip(victim, victim[1:])}
    says(CH, f"{len(flood)} requests of\n32 prompt + 64 output tokens at step 0, {word(len(flood) // NOISY_SEATS)} times "
             f"the engine's {NOISY_SEATS} seats — while another sends {len(victim)} requests of\n{prompt} prompt + {out} "
             f"output tokens, one every {every} steps (tiny Llama, budget {NOISY_BUDGET})")
    says(CH, f"the flood holds all {NOISY_SEATS}")
    # the printed block: its command, its header and its rows are what the bench prints (print_summary's format)
    (path,) = (ROOT / "chapters").glob(f"{CH}-*.md")
    ((command, printed),) = re.findall(r"```\n(\.venv/bin/python -m nanoserve bench experiment noisy-neighbour "
                                       r"[^\n]*)\n(.*?)```", path.read_text(), re.S)
    rounds = int(re.search(r"--rounds (\d+)", command)[1])  # not the command's default: the block must say it
    says(CH, f"the two policies\ninterleaved over {word(rounds)} rounds, in alternating order; each figure is the median of "
             f"the {word(rounds)} rounds with its range")
    cols = re.findall(r'\("(\w+)", "([^"]+)"\)', inspect.getsource(scheduling.noisy_neighbour))
    cell = r"([\d.]+) \[([\d.]+)-([\d.]+)\]"
    summary = {}
    for line in printed.strip().splitlines()[1:]:
        name = line.split()[0]
        cells = re.findall(cell, line)
        assert len(cells) == len(cols), line
        summary[name] = {key: tuple(map(float, c)) for (key, _), c in zip(cols, cells)}
    assert list(summary) == ["priority", "fair"]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        scheduling.print_summary(summary, cols, rounds)
    assert shown.getvalue().splitlines()[1:] == printed.strip().splitlines()  # header and rows, character for character
    prio, fair = summary["priority"], summary["fair"]
    (prio_steps, prio_lo, prio_hi), (fair_steps, fair_lo, fair_hi) = prio["victim_ttft_p50_steps"], fair["victim_ttft_p50_steps"]
    says(CH, '"p50 / median step" is the victim\'s TTFT p50 divided by the run\'s median step time')
    quoted = re.search(r"behind every flood request that arrived first: about (\d+) steps to a first token", chapter(CH))[1]
    assert about(quoted, prio_steps)
    quoted_fair, sooner = re.search(r"seat: about (\d+) steps, \*\*([\d.]+)× sooner\*\*", chapter(CH)).groups()
    assert about(quoted_fair, fair_steps)
    assert sooner == f"{prio_steps / fair_steps:.1f}"
    assert fair_hi < prio_lo and prio_lo > 5 * fair_hi  # "far apart": more than five times
    says(CH, f"(the ranges,\n{prio_lo:.0f}–{prio_hi:.0f} and {fair_lo:.0f}–{fair_hi:.0f} steps, are far apart)")
    # "the same under both": the flood's TTFT p50 and the run's seconds overlap, the medians as quoted
    for key in ("flood_ttft_p50_ms", "seconds"):
        assert prio[key][1] <= fair[key][2] and fair[key][1] <= prio[key][2], key
    run = {f"{prio['seconds'][0]:.1f}", f"{fair['seconds'][0]:.1f}"}
    assert len(run) == 1
    says(CH, f"the flood's TTFT p50 and the run's length are the same under both\n"
             f"({prio['flood_ttft_p50_ms'][0] / 1000:.2f} and {fair['flood_ttft_p50_ms'][0] / 1000:.2f} s; {run.pop()} s)")
    says(CH, f"What is left — those ~{quoted_fair} steps — is the wait for a seat")


def the_rush(arrivals) -> tuple[int, int]:
    """The scheduling workload's rush: the first step of twelve interactive prompts and the step the bursts of six
    resume, checking that it is twelve every 6 steps in between and six otherwise."""
    bursts = collections.Counter(a[0] for a in arrivals if a[4]["tenant"] == "interactive")
    rush = sorted(s for s, n in bursts.items() if n > 6)
    after = min(s for s in bursts if s > rush[-1])  # the bursts of six again
    assert set(bursts.values()) == {6, 12} and rush == list(range(rush[0], after, 6))
    return rush[0], after


def test_the_scheduling_workload():
    arrivals = workload(1024)
    batch = [a for a in arrivals if a[4]["tenant"] == "batch"]
    chat = [a for a in arrivals if a[4]["tenant"] == "interactive"]
    (every,) = {b[0] - a[0] for a, b in zip(batch, batch[1:])}
    (prompt,), (batch_out,) = {len(a[2]) for a in batch}, {a[3] for a in batch}
    (chat_prompt,), (chat_out,) = {len(a[2]) for a in chat}, {a[3] for a in chat}
    first, after = the_rush(arrivals)
    says(CH, f"the batch tenant sends a {prompt}-token prompt every\n{every} steps ({len(batch)} requests, {batch_out} "
             f"output tokens each); the interactive tenant sends bursts of {word(6)} {chat_prompt}-token prompts every\n12 "
             f"steps ({chat_out} output tokens each), and between steps {first} and {after} a rush — "
             f"{word(12)} every 6 steps")
    says(CH, f"The step budget is {BUDGET} tokens and the pool {NUM_BLOCKS}\nblocks of {BLOCK_SIZE} "
             f"({word(NUM_BLOCKS * BLOCK_SIZE // prompt)} batch requests fill it)")
    (c_ttft, c_tpot), (b_ttft, b_tpot) = TARGETS_IN_STEPS["interactive"], TARGETS_IN_STEPS["batch"]
    says(CH, f"the interactive\ntargets are TTFT {c_ttft:g} steps and TPOT {c_tpot:g} steps, the batch tenant's "
             f"{b_ttft:g} and {b_tpot:g}")
    (priorities,) = {(c[4]["priority"], b[4]["priority"]) for c in chat for b in batch}
    says(CH, f"The `priority` run gives the interactive\ntenant priority {priorities[0]} and the batch tenant "
             f"{priorities[1]}")
    # the targets quoted from one timed step (the bench prints the step with one decimal, the targets in whole ms):
    # some step time that rounds to the quoted one must give all four targets as quoted
    step, ttft, tpot, b_ttft_ms, b_tpot_ms, s_lo, s_hi = re.search(
        r"one full step was timed at ([\d.]+) ms before the runs, so the interactive targets were TTFT ([\d,]+) ms and "
        r"TPOT ([\d,]+) ms, the batch tenant's ([\d,]+) ms and ([\d,]+) ms, and each run took ([\d.]+)–([\d.]+) s",
        chapter(CH)).groups()
    lo, hi = float(step) - 0.05, float(step) + 0.05
    for quoted, steps in ((ttft, c_ttft), (tpot, c_tpot), (b_ttft_ms, b_ttft), (b_tpot_ms, b_tpot)):
        ms = int(quoted.replace(",", ""))
        assert quoted == f"{ms:,}"  # thousands separated as the chapter writes them
        lo, hi = max(lo, (ms - 0.5) / steps), min(hi, (ms + 0.5) / steps)
    assert lo < hi, f"no step time gives all four targets: {lo} >= {hi}"
    assert float(s_lo) <= float(s_hi)


def ranges(cell: str) -> tuple[float, float, float]:
    """'5560 [4235–7736]' -> (5560, 4235, 7736); '**27** [24–31]' -> (27, 24, 31); '1,141 [1,109–1,249]' -> (1141,
    1109, 1249); '0.0' -> (0, 0, 0): a single number is all rounds agreeing."""
    m = re.fullmatch(r"(?:\*\*)?([\d,.]+)(?:\*\*)?(?: \[([\d,.]+)–([\d,.]+)\])?", cell)
    med, lo, hi = (float(x.replace(",", "")) if x else None for x in m.groups())
    assert lo is None or lo <= med <= hi, cell
    return (med, lo, hi) if m[2] else (med, med, med)


def test_the_measured_policies():
    cols = ["ttft50", "ttft99", "chat_met", "batch_met", "goodput", "rejected", "preempt", "recomp", "tok_s"]
    t = {r[0]: dict(zip(cols, map(ranges, r[1:]))) for r in table_rows(CH, "fcfs|priority|slo|slo \\+ reject|fair")
         if len(r) == 10}
    assert list(t) == ["fcfs", "priority", "slo", "slo + reject", "fair"]
    text = chapter(CH)
    rounds = int(re.search(r"bench experiment scheduling --rounds (\d+) --threads 1` runs one workload", text)[1])
    says(CH, f"The policies run interleaved, in alternating\norder, {word(rounds)} rounds; each figure is the median of "
             f"the {word(rounds)} with its range")
    says(CH, f"Median\n[min–max] of {word(rounds)} rounds")

    def apart(col):
        """The pairs of policies whose ranges in `col` do not overlap, as (higher, lower)."""
        return {(p, q) for p in t for q in t if t[p][col][1] > t[q][col][2]}

    def rng(p, col, fmt="{:.1f}"):
        return "–".join(fmt.format(x) for x in t[p][col][1:])

    def span(ps, col, fmt="{:.0f}"):
        """The smallest interval holding the ranges of the policies `ps`."""
        return f"{fmt.format(min(t[p][col][1] for p in ps))}–{fmt.format(max(t[p][col][2] for p in ps))}"

    fcfs, rej, others = t["fcfs"], t["slo + reject"], [p for p in t if p != "fcfs"]
    # fcfs loses the interactive tenant
    assert all(("fcfs", p) in apart("ttft50") for p in others)
    says(CH, f"Its chat TTFT p50 is {fcfs['ttft50'][0]:.0f} ms, where every other policy's range lies within "
             f"{span(others, 'ttft50')} ms; {fcfs['chat_met'][0]:.1f} %\nof chat requests meet their targets against "
             f"{min(t[p]['chat_met'][1] for p in others):.1f} % or more, and its goodput ({rng('fcfs', 'goodput')} req/s) "
             f"is below every\nother policy's range")
    assert all((p, "fcfs") in apart("chat_met") for p in others)
    assert apart("goodput") == {(p, "fcfs") for p in others}  # and no other goodput separates
    assert fcfs["batch_met"] == (100, 100, 100)
    assert min(t, key=lambda p: t[p]["recomp"][0]) == "fcfs"
    says(CH, f"It serves the batch tenant perfectly ({fcfs['batch_met'][0]:.0f} %) and throws away the fewest tokens "
             f"to\npreemption ({fcfs['recomp'][0]:.1f} %: its victim is the latest arrival")
    # among the four others neither goodput nor the chat met-SLO share separates
    for col in ("goodput", "chat_met"):
        assert not {(p, q) for p, q in apart(col) if p in others and q in others}, col
    says(CH, f"**Among the {word(len(others))} others, goodput does not separate** ({span(others, 'goodput', '{:.1f}')} "
             f"req/s, every pair of ranges overlapping), nor\ndoes the chat met-SLO share "
             f"({span(others, 'chat_met', '{:.1f}')} %)")
    (chat_priority,), (batch_priority,) = ({a[4]["priority"] for a in workload(1024) if a[4]["tenant"] == tenant}
                                           for tenant in ("interactive", "batch"))
    says(CH, f"Told the answer (chat {chat_priority}, batch {batch_priority})")
    # slo + reject
    says(CH, f"**slo + reject refuses {rej['rejected'][0]:.0f} % of the requests** ({rng('slo + reject', 'rejected', '{:.0f}')} "
             f"%), and serves what it keeps fastest: chat TTFT p50 {rej['ttft50'][0]:.0f} ms\nand p99 "
             f"{rej['ttft99'][0]:.0f} ms, both ranges below every other policy's")
    assert all(min(t, key=lambda p: t[p][c][0]) == "slo + reject" for c in ("ttft50", "ttft99"))
    assert all({(p, "slo + reject") for p in t if p != "slo + reject"} <= apart(c)
               and not any(p == "slo + reject" for p, _ in apart(c)) for c in ("ttft50", "ttft99"))
    assert rej["batch_met"] == (100, 100, 100) and all(t[p]["rejected"] == (0, 0, 0) for p in t if p != "slo + reject")
    says(CH, f"every batch request met its targets in all {word(rounds)} rounds")
    assert not {pair for pair in apart("goodput") if "slo + reject" in pair and "fcfs" not in pair}
    says(CH, "Its goodput counts the refused requests as missed, and still matches the others'")
    richer = re.search(r"The price is throughput in tokens/s \(([\d,]+)–([\d,]+) against (.+?) ([\d,]+) or more\)", text)
    above = named(richer[3])
    assert (richer[1], richer[2]) == tuple(f"{x:,.0f}" for x in rej["tok_s"][1:])
    assert richer[4] == f"{min(t[p]['tok_s'][1] for p in above):,.0f}"
    assert {(p, "slo + reject") for p in above} <= apart("tok_s")
    # slo preempts most
    lower = [p for p in t if p not in ("slo", "slo + reject")]
    assert max(t, key=lambda p: t[p]["preempt"][0]) == "slo"
    assert {q for p, q in apart("preempt") if p == "slo"} == set(t) - {"slo"}
    says(CH, f"**slo preempts most**: {rng('slo', 'preempt', '{:.0f}')} preemptions against {span(lower, 'preempt')} for "
             f"{', '.join(lower[:-1])} and {lower[-1]} (slo + reject {rng('slo + reject', 'preempt', '{:.0f}')})")
    says(CH, "under the rush (steps {}–{})".format(*the_rush(workload(1024))))
    says(CH, f"as fcfs's ({t['slo']['recomp'][0]:.1f} % against {fcfs['recomp'][0]:.1f} %; priority and fair "
             f"{span(['priority', 'fair'], 'recomp')} %)")
    # fair: the longest chat tail after fcfs, and a batch met-SLO share below three others'
    by_tail = sorted(t, key=lambda p: -t[p]["ttft99"][0])
    assert by_tail[:2] == ["fcfs", "fair"]
    tail = re.search(r"has the longest chat tail after fcfs \(p99 (\d+)–(\d+) ms, above (.+?) ranges\) and a batch "
                     r"met-SLO share \(([\d.]+)–([\d.]+) %\) below (.+?) \(it overlaps (.+?), ([\d.]+)–([\d.]+) %\)", text)
    assert tail[1] + "–" + tail[2] == rng("fair", "ttft99", "{:.0f}")
    assert named(tail[3]) == {q for p, q in apart("ttft99") if p == "fair"} == {"priority", "slo", "slo + reject"}
    assert tail[4] + "–" + tail[5] == rng("fair", "batch_met")
    assert named(tail[6]) == {p for p, q in apart("batch_met") if q == "fair"} == {"slo", "slo + reject", "fcfs"}
    overlapping = {p for p in t if p != "fair" and (p, "fair") not in apart("batch_met")
                   and ("fair", p) not in apart("batch_met")}
    assert named(tail[7]) == overlapping == {"priority"}
    assert tail[8] + "–" + tail[9] == rng("priority", "batch_met")
    # tokens/s: slo + reject's two named above and fcfs above fair, no other pair
    rest = re.search(r"Throughput in tokens/s overlaps for every pair but slo \+ reject's two named above and (\S+) above "
                     r"(\S+) \(([\d,]+)–([\d,]+) against ([\d,]+)–([\d,]+)\)", text)
    assert len(above) == 2
    assert apart("tok_s") == {(p, "slo + reject") for p in above} | {(rest[1], rest[2])}
    assert rest.group(3, 4, 5, 6) == tuple(f"{x:,.0f}" for p in rest.group(1, 2) for x in t[p]["tok_s"][1:])


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
    refused = ranges(next(r for r in table_rows(CH, r"slo \+ reject") if len(r) == 10)[6])[0]
    assert refused / 100 > share  # section 6's refusals are over the warning's threshold
    says(CH, f"for {int(reject['for'].rstrip('m'))} minutes — the {refused:.0f} % of section 6 would trip it")
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
    says(CH, f"(One fp32 version, weights and a {defaults.kv_cache_mib} MiB KV pool")
    assert (defaults.from_weights, defaults.to_weights) == ("fp32", "q4")  # the second row's command gives no --to
    reload = re.search(r'\{"version": "(\S+)", "previous": "(\S+)", "weights": "(\w+)", "model_file": null, "load_s": ([\d.]+), '
                       r'"warmup_requests": (\d+), "warmup_s": ([\d.]+)\}', chapter(CH))
    assert reload.group(1, 2, 3) == (version_name(defaults.to_weights, 2), version_name(defaults.from_weights, 1),
                                     defaults.to_weights)
    assert int(reload[5]) == defaults.warmup_requests
    rows = {}
    for cells in table_rows(CH, "fp32 → (fp32|q4)"):
        to = cells[0].split(" → ")[1]
        assert cells[5] == "`.venv/bin/python -m nanoserve bench bluegreen --threads 1"  \
            + ("" if to == defaults.to_weights else f" --to {to}") + "`"
        before, during = (float(x.replace(",", "")) for x in re.findall(r"[\d,]+", cells[2])[:2])
        says(CH, f"{cells[2].split(' (')[0]} ({during / before:.1f}×)")
        failed = re.fullmatch(r"0 of (\d+)", cells[3])
        assert failed, f"not none failed: {cells[3]}"
        total = int(failed[1])
        rss = [float(x.replace(",", "")) for x in re.findall(r"[\d,]{3,}", cells[4])]
        assert abs(rss[2] - (rss[1] - rss[0])) <= 1  # the bench prints the difference of unrounded samples
        load_s, warm_s = (float(x) for x in re.findall(r"([\d.]+) s", cells[1]))
        rows[to] = dict(ratio=during / before, seconds=load_s + warm_s, rss=rss, total=total, load=load_s, warm=warm_s)
    assert list(rows) == ["fp32", "q4"]
    fp32, q4 = rows["fp32"], rows["q4"]
    # the curl example is the fp32 → q4 row's reload
    assert (f"{q4['load']:.1f}", f"{q4['warm']:.1f}") == (f"{float(reload[4]):.1f}", f"{float(reload[6]):.1f}")
    # a phase's "p99": whatever the split of a row's requests over the phases, no phase has more than the row's
    # total, nor fewer than a third of it at its largest; below 101 values the interpolated p99 lies strictly
    # between the two largest
    most = int(re.search(r'a phase\'s "p99" \(of at most (\d+) requests\) lies between its two slowest TTFTs',
                         chapter(CH))[1])
    assert max(-(-r["total"] // len(bluegreen.PHASES)) for r in rows.values()) <= most <= max(r["total"] for r in rows.values())
    assert all(n - 2 < percentile(list(range(n)), 99) < n - 1 for n in range(2, max(r["total"] for r in rows.values()) + 1))
    ratios = sorted(r["ratio"] for r in rows.values())
    says(CH, f"every request that arrives meanwhile is slower; here {ratios[0]:.0f}–{ratios[-1]:.0f}× on the\ntail")
    assert fp32["rss"][3] < fp32["rss"][0] and q4["rss"][3] > fp32["rss"][3]  # q4's steady state is not smaller
    says(CH, f"fp32 → fp32 ends {fp32['rss'][0] - fp32['rss'][3]:.0f} MiB under where it started\n"
             f"({fp32['rss'][3]:,.0f} MiB: the conversion's and first steps' heap handed back), and q4 ends at "
             f"{q4['rss'][3]:,.0f} MiB, {q4['rss'][3] - fp32['rss'][3]:.0f} MiB above it")
    seconds = sorted(r["seconds"] for r in rows.values())
    says(CH, f"here {seconds[0]:.0f}–{seconds[-1]:.0f} s of load and warm-up at "
             f"+{max(r['rss'][2] for r in rows.values()) / 1024:.1f} GiB of\nRSS")
