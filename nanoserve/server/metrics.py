"""Chapter 08 — what an operator scrapes from GET /metrics (Prometheus text format).

vLLM's metric names under a `nanoserve:` prefix, so dashboards built for one read the other:

    nanoserve:num_requests_running / num_requests_waiting      gauges: the scheduler's two queues, in sequences
                                                               (an n > 1 request's forked completions count one
                                                               each, like vLLM's child requests)
    nanoserve:kv_cache_usage_perc                              gauge: fraction of KV blocks held (0..1)
    nanoserve:kv_cache_fragmentation                           gauge: slots of held blocks that hold no token,
                                                               over all slots of held blocks (0..1; chapter 15)
    nanoserve:prefix_cache_queries_total / _hits_total         counters, in prompt tokens
    nanoserve:kv_tier_*_total                                  counters: chapter 18's second KV tier (hits in
                                                               tokens, blocks offloaded / loaded, bytes, stalls;
                                                               swap mode: blocks swapped out, sequences swapped
                                                               in, preemptions recomputed for want of room)
    nanoserve:num_preemptions_total                            counter: preemptions (by recompute or by swap)
    nanoserve:prompt_tokens_total / generation_tokens_total    counters
    nanoserve:request_success_total{finished_reason=...}       counter: stop, length, abort
    nanoserve:time_to_first_token_seconds, inter_token_latency_seconds,
    nanoserve:request_time_per_output_token_seconds, e2e_request_latency_seconds,
    nanoserve:request_queue_time_seconds                       histograms
    nanoserve:http_responses_total{status="2xx"|"4xx"|"5xx"}  counter: HTTP responses by status class (chapter 15)
    nanoserve:slo_rejections_total{stream}                     counter: requests --slo-reject refused (chapter 15)
    nanoserve:degraded                                         gauge: 1 while steps run on the degraded
                                                               (q4) copy of the weights (chapter 10), else 0
    nanoserve:spec_decode_num_drafts_total / _num_draft_tokens_total / _num_accepted_tokens_total
                                                               counters (chapter 14): verified proposals, the
                                                               tokens proposed, of them accepted
    nanoserve:generation_tokens_by_precision_total{precision=...}  counter: generated tokens by the weights
                                                               they were computed with ("fp32", "int8", "q4")
    nanoserve:tenant_requests_total{tenant=...,outcome=...}    counter: requests per tenant (--api-keys, chapter 08)
                                                               admitted, rate_limited (429), timed_out (408)
    nanoserve:tenant_tokens_total{tenant=...}                  counter: prompt + generated tokens per tenant

With `compat="vllm"` (`serve --metrics-compat vllm`, chapter 16) the three gauges a fleet's endpoint
picker reads (Kubernetes' Gateway API Inference Extension, llm-d) are also exported under vLLM's own
names: vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc. With LoRA adapters
(chapter 19) also vllm:lora_requests_info, whose labels name the adapters of the running and the waiting
requests (comma-separated) and max_lora, its value the time of the step: the picker routes a request to a
server that already runs its adapter.

The share of tokens served degraded over the last 5 minutes, in PromQL (the degraded copy is always q4,
and a server that degrades never serves q4 otherwise):

    sum(rate(nanoserve:generation_tokens_by_precision_total{precision="q4"}[5m]))
      / sum(rate(nanoserve:generation_tokens_by_precision_total[5m]))

`record` runs in the engine thread after every step (prometheus_client is thread-safe); each
server owns its registry, so two servers in one process (tests, the notebook) do not mix.
"""

import time
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no `_created` twin of every counter: the scrape reads as the table above

PREFIX = "nanoserve:"
# the two queue gauges count sequences, not requests (the server's --max-waiting-requests counts requests)
RUNNING_DOC = "Sequences in the running set (they hold KV blocks): an n > 1 request's completions count one each."
WAITING_DOC = "Sequences waiting to be scheduled, preempted ones too: an n > 1 request counts once until it forks."
# seconds: from a fast decode step on a quiet machine to a long queue under overload
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)


METRICS_COMPAT = ("vllm",)


def kv_fragmentation(running, blocks) -> float:
    """Slots of the running sequences' blocks that hold no token, over all their slots (0 with none held).

    A block is shared after a fork or a prefix-cache hit: it counts once, as full as its fullest holder.
    Blocks allocated ahead for this step's tokens, and the unfilled tail of each last block, are the empty slots:

        block_size 4; A holds 2 blocks with 5 tokens computed, B 1 block with 4   -> 3 of 12 slots empty: 0.25
    """
    filled: dict[int, int] = {}
    for seq in running:
        for j, block in enumerate(blocks.block_table(seq.seq_id)):
            tokens = min(blocks.block_size, max(0, seq.num_computed_tokens - j * blocks.block_size))
            filled[block] = max(filled.get(block, 0), tokens)
    slots = len(filled) * blocks.block_size
    return 1 - sum(filled.values()) / slots if slots else 0.0


class PrometheusStatLogger:
    def __init__(self, model_name: str, compat: str | None = None):
        """compat: None, or "vllm" to also export the queue and KV gauges under vLLM's names."""
        if compat is not None and compat not in METRICS_COMPAT:
            raise ValueError(f"metrics compat must be one of {METRICS_COMPAT}, got {compat!r}")
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, **label).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, **label).labels(model_name)

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, **label).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", RUNNING_DOC)
        self.num_requests_waiting = gauge("num_requests_waiting", WAITING_DOC)
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_cache_fragmentation = gauge("kv_cache_fragmentation",
                                            "Allocated KV slots holding no token / allocated KV slots (0..1).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Preemptions (by recompute, or by swap to the KV tier).")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens of a request.")
        self.tpot = histogram("request_time_per_output_token_seconds", "Mean gap per output token after the first.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.degraded = gauge("degraded", "1 while steps run on the degraded (quantized) copy of the weights, else 0.")
        self.tokens_by_precision = Counter(PREFIX + "generation_tokens_by_precision",
                                           "Generated tokens by the weights they were computed with.",
                                           ["model_name", "precision"], registry=self.registry)
        # chapter 08's tenants (--api-keys): per request and per token, by the tenant of the verified key
        self.tenant_requests = Counter(PREFIX + "tenant_requests", "Requests by tenant and outcome (admitted, "
                                       "rate_limited, timed_out).", ["model_name", "tenant", "outcome"],
                                       registry=self.registry)
        self.tenant_tokens = Counter(PREFIX + "tenant_tokens", "Prompt + generated tokens charged to a tenant.",
                                     ["model_name", "tenant"], registry=self.registry)
        self.spec_counters = {name: counter(f"spec_decode_{name}", doc) for name, doc in (
            ("num_drafts", "Speculative proposals verified (one per sequence and step)."),
            ("num_draft_tokens", "Tokens proposed and verified."),
            ("num_accepted_tokens", "Proposed tokens the target accepted."))}
        # chapter 18: the second KV tier (LLMEngine.kv_tier_stats; absent without one)
        self.tier_counters = {name: counter(f"kv_tier_{name}", doc) for name, doc in (
            ("tier_hit_tokens", "Prompt tokens found in the second KV tier and loaded instead of computed."),
            ("offloaded_blocks", "Evicted prefix-cache blocks written to the second KV tier."),
            ("loaded_blocks", "Blocks loaded from the second KV tier into the pool."),
            ("bytes_written", "Bytes written to the second KV tier."),
            ("bytes_read", "Bytes read from the second KV tier."),
            ("stalls", "Loads that waited for their block's write to the tier to finish."),
            ("swapped_out_blocks", "Preempted sequences' blocks written to the second KV tier (swap mode)."),
            ("swap_ins", "Swapped-out sequences whose blocks were read back into the pool as they resumed."),
            ("swap_fallbacks", "Preemptions recomputed because the second KV tier had no room to swap to."))}
        self.http_responses = Counter(PREFIX + "http_responses", "HTTP responses by status class.",
                                      ["model_name", "status"], registry=self.registry)
        # chapter 15: requests --slo-reject refused: a 503 with Retry-After (stream="false", also in
        # http_responses{5xx}) or an error event in a 200 stream; shedding load on purpose, not a failure
        self.slo_rejections = Counter(PREFIX + "slo_rejections", "Requests refused by the scheduling policy "
                                      "(--slo-reject): their TTFT could not be met.", ["model_name", "stream"],
                                      registry=self.registry)
        for stream in ("false", "true"):  # both series from the start: the 5xx alert subtracts them
            self.slo_rejections.labels(model_name, stream)
        self.model_name = model_name
        # the same values under another server's names: vLLM's, for a fleet's endpoint picker
        self.compat = {} if compat is None else {
            name: Gauge(f"{compat}:{name}", f"{doc} (= nanoserve:{name})", **label).labels(model_name)
            for name, doc in (("num_requests_running", RUNNING_DOC),
                              ("num_requests_waiting", WAITING_DOC),
                              ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)."))}
        self.lora_info = None if compat is None else Gauge(
            f"{compat}:lora_requests_info", "Running and waiting requests' LoRA adapters (value: time of the step).",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        # per engine, its cumulative counts at the last step (the counters get the deltas): during a blue-green
        # update (chapter 15) two engines record, and the new one's counts start at 0
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def record(self, engine, outputs, scheduler_output=None) -> None:
        """Called in the engine thread after every step (with its plan) and every batch of aborts."""
        scheduler, blocks = engine.scheduler, engine.block_manager
        self.num_requests_running.set(len(scheduler.running))
        self.num_requests_waiting.set(len(scheduler.waiting))
        self.kv_cache_usage.set(blocks.usage)
        self.kv_cache_fragmentation.set(kv_fragmentation(scheduler.running, blocks))
        for name, value in (("num_requests_running", len(scheduler.running)),
                            ("num_requests_waiting", len(scheduler.waiting)), ("kv_cache_usage_perc", blocks.usage)):
            if name in self.compat:
                self.compat[name].set(value)
        lora = getattr(engine.config, "lora_config", None)
        if self.lora_info is not None and lora is not None:  # chapter 19: one sample, the current adapters
            names = [",".join(sorted({s.lora_name for s in seqs} - {None})) for seqs in (scheduler.waiting, scheduler.running)]
            self.lora_info.clear()
            self.lora_info.labels(str(lora.max_loras), *names).set(time.time())
        seen = self._seen.setdefault(engine, {"queried": 0, "hit": 0, **{name: 0 for name in self.spec_counters}})
        queried, hit = blocks.stats.queried_tokens, blocks.stats.hit_tokens
        self.prefix_cache_queries.inc(queried - seen["queried"])
        self.prefix_cache_hits.inc(hit - seen["hit"])
        seen["queried"], seen["hit"] = queried, hit
        if scheduler_output is not None:
            self.num_preemptions.inc(len(scheduler_output.preempted_seq_ids))
        for name, metric in self.spec_counters.items():  # chapter 14: the engine's cumulative counts, as deltas
            value = getattr(engine.spec_stats, name)
            metric.inc(value - seen[name])
            seen[name] = value
        tier = engine.kv_tier_stats()
        for name, metric in self.tier_counters.items() if tier else ():  # chapter 18: deltas, like chapter 14's
            metric.inc(tier[name] - seen.get("tier_" + name, 0))
            seen["tier_" + name] = tier[name]
        self.degraded.set(engine.degraded)  # chapter 10: the mode of the step just run
        by_precision = self.tokens_by_precision.labels(self.model_name, engine.precision)
        for out in outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            by_precision.inc(len(out.new_token_ids))
            # its first token: the prompt was prefilled — once for all n completions (the forks share it)
            if out.index == 0 and len(out.token_ids) == len(out.new_token_ids):
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.finished:
                self.record_finished(out)

    def record_finished(self, out) -> None:
        m = out.metrics
        self.request_success.labels(self.model_name, out.finish_reason).inc()
        for histogram, value in ((self.ttft, m.get("ttft")), (self.tpot, m.get("tpot")), (self.e2e, m.get("e2e")),
                                 (self.queue_time, m.get("queue_time"))):
            if value is not None:
                histogram.observe(value)
        for gap in m.get("itl", []):
            self.itl.observe(gap)

    def record_response(self, status_code: int) -> None:
        self.http_responses.labels(self.model_name, f"{status_code // 100}xx").inc()

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
