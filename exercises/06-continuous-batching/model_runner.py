"""Exercise 6.5 — `ModelRunner.prepare_inputs`: one scheduled step becomes one flat batch.

This file mirrors nanoserve/engine/model_runner.py. Your class inherits the reference ModelRunner
(the forward pass, sampling, the per-request generators), so you write the one method that turns the
scheduler's integers into the index tensors the model and attention read.

What you have:

    out.scheduled_seqs             the sequences of this step, in order
    out.num_scheduled_tokens[id]   how many tokens each computes, from seq.num_computed_tokens on
    out.block_tables[id]           each one's block table (a list of block ids)
    seq.token_ids, seq.num_tokens, seq.num_computed_tokens
    self.block_size, self.device
    self.metadata.build(block_tables, seq_lens, query_lens, block_size)   chapter 05's AttentionMetadata
                                   (yours under --student 05): slot_mapping, the padded block tables and
                                   cu_seqlens_q, worked out from integers

Grade it with `make grade CH=06 EX=6.5`; serve with it: `python -m nanoserve batch --student 06 ...`.
"""

import torch  # noqa: F401  (the index tensors)

from nanoserve.engine.model_runner import ModelInput
from nanoserve.engine.model_runner import ModelRunner as ReferenceModelRunner
from nanoserve.engine.scheduler_output import SchedulerOutput


class ModelRunner(ReferenceModelRunner):
    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput:
        """Exercise 6.5: lay the step's tokens end to end, sequence after sequence, and describe them.

        Sequence `seq` computes positions [start, end), start = seq.num_computed_tokens, end = start +
        out.num_scheduled_tokens[seq.seq_id]. Build, over all scheduled sequences in order:
          input_ids       its tokens at those positions               (num_tokens,) long, on self.device
          positions       start, start + 1, ..., end - 1               (num_tokens,) long, on self.device
          attn_metadata   self.metadata.build(tables, seq_lens, query_lens, self.block_size) with
                          seq_lens[i] = end (keys it attends to: cached + new), query_lens[i] = end - start
          logits_indices  the row of the flat batch holding its last token, for each sequence whose step
                          reaches its last known token (end == seq.num_tokens): a decode, or a prompt's last
                          chunk. A partial prefill chunk samples nothing.   (num_sampled,) long, on the CPU
          sampled_seqs    those sequences, in the same order
        and return them as a ModelInput.
        From chapter 14 on, a sequence may carry k = len(seq.spec_token_ids) proposals to verify: they follow its
        known tokens (its tokens are seq.token_ids + seq.spec_token_ids, end can reach seq.num_tokens + k), and a
        step that reaches its last proposal samples k + 1 rows: its last known token's and each proposal's.
        Example (block size 4): A decodes position 9 with table [2, 5, 7]; B computes the chunk [0, 3) of a 7-token
        prompt with table [1]; C decodes position 4 with table [4, 6]:
          input_ids [a9, b0, b1, b2, c4], positions [9, 0, 1, 2, 4], seq_lens [10, 3, 5], query_lens [1, 3, 1],
          slot_mapping (from the metadata) [7*4+1, 4, 5, 6, 6*4+0], logits_indices [0, 4], sampled_seqs [A, C].
        """
        raise NotImplementedError("Exercise 6.5: write ModelRunner.prepare_inputs (see its docstring and README.md)")
