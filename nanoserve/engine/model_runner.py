"""Chapter 06 — the model runner: one scheduled step becomes ONE forward pass.

The scheduler said "sequence s computes tokens [num_computed_tokens, +n)". The runner lays all
those tokens end to end — prefill chunks and decodes alike — and describes where each one
belongs with chapter 05's metadata:

    A decodes 1 token at position 9, B prefills a 3-token chunk at [0, 3), C decodes at 4
    input_ids     [a9 | b0 b1 b2 | c4]           (num_tokens,) = (5,)
    positions     [ 9 |  0  1  2 |  4]
    cu_seqlens_q  [0, 1, 4, 5]                   where each sequence's queries start/end
    seq_lens      [10, 3, 5]                     keys each sequence attends to (cached + new)
    slot_mapping  [slot of A's 9, B's [0, 3), C's 4]   where the new K/V are written in the pool
    block_tables  (3, max_blocks), padded         the pool blocks of each sequence

Logits are computed only for the rows that complete a sequence's known tokens (a decode, or the
last chunk of a prompt): a partial prefill chunk samples nothing. The LM head of SmolLM2 is
49152 × 576, so skipping the other rows matters.

Attention is the one part that varies (chapter 07): the runner is given the AttentionFn class of
its backend — chapter 05's PagedAttention ("torch") or the Triton kernels ("triton") — and builds
one per step from the step's metadata. The model does not know which one it calls.

Each sequence samples with its own SamplingParams and its own torch.Generator, so a seeded
request draws the same tokens whatever else shares its batch.

Chapter 08, prompt logprobs (`/v1/completions` with echo + logprobs: perplexity): for a sequence whose
request asked for them, the rows of *every* prompt position of the chunk get logits too, appended after
the sampling rows (so the other rows and their tokens are the same as without them). Row p scores the
prompt token at p + 1; the prompt's last row is the sampling row and scores the first generated token.

    B prefills [0, 3) of a 5-token prompt, asks prompt logprobs:  extra rows b0 b1 b2 -> tokens 1, 2, 3
    the next chunk [3, 5):                                         extra row b3 -> token 4; b4 samples
"""

from dataclasses import dataclass

import torch

from nanoserve.distributed.parallel_state import get_tp_group
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence, child_seq_id
from nanoserve.kernels.cpu_decode import NATIVE_DECODE_MAX_ROWS, NativeDecoder
from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache
from nanoserve.engine.sampler import SampleRow, TokenLogprob, sample_rows, token_logprobs
import nanoserve.sampling as reference_sampling
from nanoserve.sampling import make_generator
from nanoserve.spec_decode import acceptance
from nanoserve.spec_decode.verify import verify_and_sample


class SampledTokens(dict):
    """{seq_id: token} — what the scheduler reads — plus, for the sequences whose request asked for them,
    `logprobs`: {seq_id: TokenLogprob} (chapter 08), and `prompt_logprobs`: {seq_id: (first, [TokenLogprob])},
    the entries of prompt tokens first, first + 1, ... this step scored. `failed`: {seq_id: exception} of the
    sequences whose draw raised (they have no token; the engine fails their requests, the batch goes on)."""

    def __init__(self, tokens=(), logprobs: dict[str, TokenLogprob] | None = None,
                 prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] | None = None,
                 failed: dict[str, Exception] | None = None):
        super().__init__(tokens)
        self.logprobs = logprobs or {}
        self.prompt_logprobs = prompt_logprobs or {}
        self.failed = failed or {}


@dataclass
class PromptLogprobRows:
    """One sequence's prompt positions scored this step: logits rows [start, start + len(token_ids)) of
    the step's logits (after the sampling rows) score prompt tokens token_ids, the first at prompt index `first`."""

    seq_id: str
    first: int
    start: int
    token_ids: list[int]
    k: int  # the top alternatives to report


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (num_sampled,) rows of the flat batch whose next token we sample
    sampled_seqs: list[Sequence]
    # chapter 08: with prompt logprobs, logits_indices[:num_sampling_rows] sample and the rest score prompts
    num_sampling_rows: int | None = None


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, attention=PagedAttention, degraded_model=None,
                 metadata=AttentionMetadata, spec_acceptance=acceptance, sampling=reference_sampling):
        """attention: cls(kv_cache, metadata) -> AttentionFn (nanoserve.kernels.backend.attention_class);
        metadata: the class whose build() describes a step (chapter 05's, or the learner's); spec_acceptance:
        chapter 14's acceptance module, whose rules verify proposals (the learner's, exercises 14.2-14.3);
        sampling: chapter 03's module, whose sample_batch draws every token (the learner's, exercise 3.1)."""
        self.model = model
        self.degraded_model = degraded_model  # chapter 10: the quantized copy, for steps under overload
        self.kv_cache = kv_cache
        self.attention = attention
        self.metadata = metadata
        self.spec_acceptance = spec_acceptance
        self.sampling = sampling
        self.device = kv_cache.k_cache[0].device
        self.block_size = kv_cache.block_size
        self.generators: dict[str, torch.Generator | None] = {}  # per live request
        self.tp_group = get_tp_group(model)  # chapter 11: rank 0 sends each step to the other ranks
        self.native_decoders: dict[tuple, NativeDecoder | None] = {}  # chapter 09: (model, pool) -> its C step

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the step into index tensors, built once per step (never per layer)."""
        input_ids, positions, seq_lens, query_lens, logits_indices, sampled_seqs = [], [], [], [], [], []
        for seq in out.scheduled_seqs:
            start = seq.num_computed_tokens
            end = start + out.num_scheduled_tokens[seq.seq_id]
            k = len(seq.spec_token_ids)  # chapter 14: proposals ride after the real tokens
            input_ids += (seq.token_ids + seq.spec_token_ids if k else seq.token_ids)[start:end]
            positions += range(start, end)
            seq_lens.append(end)
            query_lens.append(end - start)
            if end == seq.num_tokens + k:  # the step reaches the last known token: sample the next one
                logits_indices += range(len(input_ids) - 1 - k, len(input_ids))  # k + 1 rows with proposals
                sampled_seqs.append(seq)
        tables = [out.block_tables[seq.seq_id] for seq in out.scheduled_seqs]
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attn_metadata=self.metadata.build(tables, seq_lens, query_lens, self.block_size),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long),
            sampled_seqs=sampled_seqs,
        )

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, degraded: bool = False) -> dict[str, int]:
        """Run the step (on the degraded model's weights if `degraded`); return {seq_id: sampled token}
        for the sequences that sample."""
        for seq_id in out.finished_seq_ids:
            self.generators.pop(seq_id, None)
        # copy-on-write: before anyone writes into the copies. A copy is only ever made for a sequence this
        # step schedules (BlockManager.allocate_slots), so the step below carries it to the other ranks.
        self.kv_cache.copy_blocks(out.blocks_to_copy)
        if not out.scheduled_seqs:
            return {}
        batch = self.prepare_inputs(out)
        prompt_rows = self.add_prompt_logprob_rows(out, batch)  # chapter 08: [] unless a request asked for them
        # the other ranks copy the same blocks and run this step's shard with us (a no-op at TP 1)
        self.tp_group.broadcast_step(batch, out.blocks_to_copy)
        logits = self.execute_model_input(batch, degraded)
        prompt_logprobs = {}
        if prompt_rows:  # split them off first: what follows sees exactly the rows it saw without them
            logits, prompt_logprobs = logits[:prompt_rows[0].start], self.score_prompts(logits, prompt_rows)
        if not batch.sampled_seqs:
            return SampledTokens(prompt_logprobs=prompt_logprobs)
        if logits is not None and len(logits) > len(batch.sampled_seqs):  # chapter 14: some sequences verify proposals
            sampled = verify_and_sample(self, batch.sampled_seqs, logits, out.grammar_bitmask)
        else:
            sampled = self.sample(batch.sampled_seqs, logits, out.grammar_bitmask)
        if prompt_logprobs:
            sampled = SampledTokens(sampled, getattr(sampled, "logprobs", {}), prompt_logprobs,
                                    getattr(sampled, "failed", {}))
        return sampled

    def add_prompt_logprob_rows(self, out: SchedulerOutput, batch: ModelInput) -> list[PromptLogprobRows]:
        """Chapter 08: append to batch.logits_indices the flat-batch rows of the prompt positions whose next
        prompt token a request wants scored (Sequence.needs_prompt_logprobs); what they score, in order.
        The rows of the flat batch follow out.scheduled_seqs, each sequence's scheduled tokens end to end
        (prepare_inputs' layout). The prompt's last position is left out: it is the sampling row."""
        found, offset, extra = [], 0, []
        start = len(batch.logits_indices)
        for seq in out.scheduled_seqs:
            n = out.num_scheduled_tokens[seq.seq_id]
            if getattr(seq, "needs_prompt_logprobs", False):
                begin, end = seq.num_computed_tokens, min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
                if end > begin:
                    extra += range(offset, offset + end - begin)
                    found.append(PromptLogprobRows(seq.seq_id, begin + 1, start, seq.prompt_token_ids[begin + 1:end + 1],
                                                   seq.sampling_params.prompt_logprobs))
                    start += end - begin
            offset += n
        if extra:
            batch.num_sampling_rows = len(batch.logits_indices)
            batch.logits_indices = torch.cat([batch.logits_indices, torch.tensor(extra, dtype=torch.long)])
        return found

    def score_prompts(self, logits: torch.Tensor, found: list[PromptLogprobRows]) -> dict[str, tuple[int, list]]:
        """{seq_id: (first prompt index, [TokenLogprob])}: the log-softmax in float32 of the raw logits (no
        penalty, temperature or filter: nothing samples here), as vLLM's prompt_logprobs."""
        scored = {}
        for f in found:
            rows = torch.log_softmax(logits[f.start:f.start + len(f.token_ids)].float(), dim=-1)
            scored[f.seq_id] = (f.first, token_logprobs(rows, f.token_ids, f.k))
        return scored

    @torch.inference_mode()
    def execute_model_input(self, batch: ModelInput, degraded: bool = False) -> torch.Tensor | None:
        """The forward pass (on the degraded copy of the weights if asked, chapter 10; a q4 step of one-token rows in
        kernels/cpu_decode.c instead where native_decoder says it can run, chapter 09); the logits
        (num_sampled, vocab) of the rows that sample (None when none does, and on tensor-parallel
        ranks > 0, which only help compute them). With prompt logprobs (chapter 08) the prompt rows follow."""
        model = self.degraded_model if degraded else self.model
        native = self.native_decoder(model, batch)  # chapter 09: one-token rows in one C call, where it can run
        if native is not None:
            meta = batch.attn_metadata
            hidden = native.step(batch.input_ids, batch.positions, meta.block_tables, meta.seq_lens, meta.slot_mapping)
            # (B, hidden), row i the step's token i as in the forward's output; the rows asked for (sampling, prompt
            # logprobs) picked as below, in one LM head call: cpu_dot.c computes each row alone, whatever the count
            return native.logits(hidden[batch.logits_indices]) if len(batch.logits_indices) else None
        hidden = model(batch.input_ids, batch.positions, self.attention(self.kv_cache, batch.attn_metadata))
        if not len(batch.logits_indices):
            return None
        rows, k = batch.logits_indices.to(self.device), batch.num_sampling_rows
        # The prompt rows get an LM head call of their own, so the sampling rows' logits are bit for bit what they
        # are without them (a GEMM's rows may round differently at another row count). Not at TP > 1: the other
        # ranks do not know the split and run one gather for all rows, so this rank must run the same one.
        split = k is not None and 0 < k < len(rows) and self.tp_group.size == 1
        parts = [model.compute_logits(hidden[r]) for r in ((rows[:k], rows[k:]) if split else (rows,))]
        if parts[0] is None:
            return None
        return torch.cat([p.cpu() for p in parts]) if split else parts[0].cpu()  # (num_sampled [+ prompt rows], vocab)

    def native_decoder(self, model, batch: ModelInput) -> NativeDecoder | None:
        """Chapter 09: the C decode step (kernels/cpu_decode.py) for this step, or None: the model's forward runs.

        It runs a step whose rows are each one sequence's one token (decodes, or a prompt's one-token last chunk),
        up to the decoder's max_rows of them (NATIVE_DECODE_MAX_ROWS where the model's layers take cpu_dot.c for their
        small steps, else 1: cpu_decode.max_rows), where the model asks for it (`native_decode`, set at load: LLM's
        native_decode) and this runner's pool and attention are what the C code reads (a float32 or bf16
        PagedKVCache with chapter 05's attention). Why there: the C step runs the whole layer loop without Python in
        between, where a small step spends most of its time; its products are cpu_dot.c's, which the layers themselves
        take only up to their crossover (the cap's comment), so a larger step runs the forward, as does any step with a
        longer chunk or spec-decode proposals (more than one row for a sequence). What the C code needs comes from
        the step's metadata (block table rows, positions, slots), so the model never sees the scheduler."""
        llama = getattr(model, "model", model)  # a CompiledModel's Llama (the same weights)
        rows = batch.input_ids.shape[0]
        if (not 1 <= rows <= NATIVE_DECODE_MAX_ROWS or len(batch.attn_metadata.seq_lens) != rows  # one token each
                or not getattr(llama, "native_decode", False) or self.tp_group.size > 1
                or self.attention is not PagedAttention or type(self.kv_cache) is not PagedKVCache):
            return None
        first = next(iter([*llama.layers[0].buffers(), *llama.layers[0].parameters()]))  # a weight of layer 0
        key = (id(llama), first.data_ptr(), self.kv_cache.k_cache[0].data_ptr())
        if key not in self.native_decoders:  # once per model and pool: weights or a pool rebuilt (a wake): anew
            self.native_decoders[key] = (NativeDecoder(llama, self.kv_cache)
                                         if not NativeDecoder.why_not(llama, self.kv_cache) else None)
        decoder = self.native_decoders[key]
        return decoder if decoder is not None and rows <= decoder.max_rows else None

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, grammar_bitmask=None) -> dict[str, int]:
        """{seq_id: token} (a SampledTokens, with the logprobs of those that asked). A prompt with n > 1 samples
        its first token n times from its one row of logits: completion i under child_seq_id(request_id, i),
        with its own generator (the engine forks it). The drawing itself is nanoserve/engine/sampler.py's, which
        hands the rows to chapter 03's sample_batch (self.sampling's).
        grammar_bitmask (chapter 13): the constrained rows' masks, applied first, to those rows only.

        The draw is made sequence by sequence — one sample_batch call per sequence, over its one row, or its n rows
        for a request with n > 1 completions — so that one sequence whose draw raises (its generator, its
        penalties, its numbers) fails alone: it lands in `failed` with no token, and every other sequence of the
        batch gets its token as if it were not there (each row reads only its own logits, params and generator).
        One call for the whole step would lose the tokens of every sequence when one row raised."""
        if grammar_bitmask is not None:
            grammar_bitmask.apply(seqs, logits)  # disallowed tokens -> -inf, before penalties / greedy / temperature
        logits = logits.float()  # once for the step, not once per sequence
        sampled = SampledTokens()
        for row, seq in enumerate(seqs):
            try:
                ids, rows = [], []
                params = seq.sampling_params
                completions = [(seq.seq_id, params)]
                if params.n > 1 and seq.num_output_tokens == 0:
                    completions += [(child_seq_id(seq.request_id, i), params.for_completion(i)) for i in range(1, params.n)]
                for seq_id, p in completions:
                    if seq_id not in self.generators:
                        self.generators[seq_id] = None if p.greedy else make_generator(p)
                    ids.append(seq_id)
                    rows.append(SampleRow(row, p, self.generators[seq_id], seq.prompt_token_ids, seq.output_token_ids))
                tokens, logprobs = sample_rows(logits, rows, self.sampling)
            except Exception as e:  # noqa: BLE001 — this sequence's failure, not the batch's
                sampled.failed[seq.seq_id] = e
                continue
            sampled.update(zip(ids, tokens))
            sampled.logprobs.update({i: lp for i, lp in zip(ids, logprobs) if lp is not None})
        return sampled
