"""Chapter 06 — the model runner's flat batch (exercise 6.5: `ModelRunner.prepare_inputs`).

Hand-computed flat batches (input ids, positions, slot mapping, query and sequence lengths, which
sequences sample), then the batch driving a tiny random model through chunked prefills and decodes,
row for row equal to chapter 02's no-cache forward pass over each whole sequence.
"""

import pytest
import torch

from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.kv.block_manager import BlockManager
from nanoserve.kv.paged_attention import PagedKVCache
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation
from tests.tiny_model import tiny_llama

pytestmark = pytest.mark.exercise("6.5")
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def runner_for(model, num_blocks=16):
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, num_blocks, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, torch.float32)
    return implementation("nanoserve.engine.model_runner").ModelRunner(model, cache)


def seq(seq_id, tokens, num_prompt, computed):
    """A sequence holding `tokens` (the first num_prompt of them its prompt), `computed` of them in the cache."""
    s = Sequence(seq_id, tokens[:num_prompt], 8)
    s.output_token_ids = tokens[num_prompt:]
    s.num_computed_tokens = computed
    return s


def plan(*entries) -> SchedulerOutput:
    """SchedulerOutput from (sequence, tokens scheduled, block table) triples, in order."""
    return SchedulerOutput(scheduled_seqs=[e[0] for e in entries],
                           num_scheduled_tokens={e[0].seq_id: e[1] for e in entries},
                           block_tables={e[0].seq_id: e[2] for e in entries})


def test_decodes_and_a_prefill_chunk_in_one_flat_batch(tiny):
    a = seq("A", list(range(10, 20)), 6, computed=9)  # 10 tokens, 9 cached: decodes position 9
    b = seq("B", list(range(30, 37)), 7, computed=0)  # a 7-token prompt: chunk [0, 3), samples nothing
    c = seq("C", list(range(40, 45)), 3, computed=4)  # decodes position 4
    batch = runner_for(tiny).prepare_inputs(plan((a, 1, [2, 5, 7]), (b, 3, [1]), (c, 1, [4, 6])))
    assert batch.input_ids.tolist() == [19, 30, 31, 32, 44]
    assert batch.positions.tolist() == [9, 0, 1, 2, 4]
    assert batch.input_ids.dtype == batch.positions.dtype == torch.long
    m = batch.attn_metadata
    assert m.cu_seqlens_q.tolist() == [0, 1, 4, 5] and m.seq_lens.tolist() == [10, 3, 5]
    # position p of a sequence goes to slot table[p // 4] * 4 + p % 4
    assert m.slot_mapping.tolist() == [7 * 4 + 1, 4, 5, 6, 6 * 4 + 0]
    assert m.block_tables.tolist() == [[2, 5, 7], [1, 0, 0], [4, 6, 0]]  # padded with block 0
    assert batch.logits_indices.tolist() == [0, 4] and batch.sampled_seqs == [a, c]


def test_the_last_chunk_after_a_prefix_hit_samples(tiny):
    b = seq("B", list(range(50, 61)), 11, computed=8)  # 8 tokens hit in the prefix cache: computes [8, 11)
    d = seq("D", list(range(70, 76)), 6, computed=0)  # a whole 6-token prompt
    batch = runner_for(tiny).prepare_inputs(plan((d, 6, [3, 9]), (b, 3, [0, 1, 5])))
    assert batch.input_ids.tolist() == [70, 71, 72, 73, 74, 75, 58, 59, 60]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    m = batch.attn_metadata
    assert m.cu_seqlens_q.tolist() == [0, 6, 9] and m.seq_lens.tolist() == [6, 11]
    assert m.slot_mapping.tolist() == [12, 13, 14, 15, 36, 37, 20, 21, 22]
    assert batch.logits_indices.tolist() == [5, 8] and batch.sampled_seqs == [d, b]


def test_a_step_of_partial_chunks_samples_nothing(tiny):
    a = seq("A", list(range(10, 30)), 20, computed=4)
    batch = runner_for(tiny).prepare_inputs(plan((a, 4, [0, 1])))
    assert batch.positions.tolist() == [4, 5, 6, 7] and batch.attn_metadata.seq_lens.tolist() == [8]
    assert batch.logits_indices.tolist() == [] and batch.sampled_seqs == []


def test_proposals_ride_after_the_known_tokens_and_each_gets_a_row(tiny):
    """Chapter 14: A decodes position 5 carrying proposals [91, 92]: 3 tokens, 3 rows of logits (the last known
    token's and each proposal's); B's prompt completes beside it."""
    a = seq("A", list(range(10, 16)), 5, computed=5)
    a.spec_token_ids = [91, 92]
    b = seq("B", list(range(30, 33)), 3, computed=0)
    batch = runner_for(tiny).prepare_inputs(plan((a, 3, [2, 5]), (b, 3, [1])))
    assert batch.input_ids.tolist() == [15, 91, 92, 30, 31, 32]
    assert batch.positions.tolist() == [5, 6, 7, 0, 1, 2]
    assert batch.attn_metadata.seq_lens.tolist() == [8, 3]
    assert batch.attn_metadata.slot_mapping.tolist() == [5 * 4 + 1, 22, 23, 4, 5, 6]  # table[p // 4] * 4 + p % 4
    assert batch.logits_indices.tolist() == [0, 1, 2, 5] and batch.sampled_seqs == [a, b]


@torch.inference_mode()
def test_the_flat_batch_computes_what_the_no_cache_forward_does(tiny):
    """Three greedy requests, a 5-token budget: prefill chunks, decodes and both in one step. Every sampled row's
    logits equal the last row of chapter 02's forward pass over the whole sequence so far (no cache)."""
    runner = runner_for(tiny, num_blocks=24)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=5), BlockManager(24, BLOCK_SIZE))
    for i, prompt in enumerate([[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2], [42, 17]]):
        scheduler.add_seq(Sequence(str(i), prompt, 4, arrival_time=float(i),
                                   sampling_params=SamplingParams(temperature=0, max_tokens=4)))
    mixed = checked = 0
    while scheduler.has_unfinished_seqs():
        out = scheduler.schedule()
        batch = runner.prepare_inputs(out)
        logits = runner.execute_model_input(batch)
        counts = out.num_scheduled_tokens.values()
        mixed += 1 in counts and max(counts) > 1
        sampled = {}
        for row, s in enumerate(batch.sampled_seqs):
            expected = tiny.compute_logits(tiny(torch.tensor(s.token_ids))[-1:])[0]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
            sampled[s.seq_id] = int(logits[row].argmax())
            checked += 1
        for s in scheduler.update_from_output(out, sampled, now=0.0):
            if s.num_output_tokens == s.max_tokens:
                scheduler.finish_seq(s.seq_id, SequenceStatus.FINISHED_LENGTH)
    assert checked == 3 * 4 and mixed > 0  # every token checked; some step mixed decodes with a prefill chunk
