"""Chapter 06 — one step's plan, the scheduler's output: which sequences compute how many tokens, their block
tables, and the copies and transfers the worker does first. Plain data, in its own module (vLLM v1's
vllm/v1/core/sched/output.py), so that both sides of the step import it: the scheduler, which writes it, and the
executor, the worker and the model runner, which read it without importing the scheduler (chapter 00's layering:
imports only point down)."""

from dataclasses import dataclass, field

from nanoserve.engine.sequence import Sequence


@dataclass
class SchedulerOutput:
    """One step's plan. The worker computes, for each scheduled sequence, tokens
    [num_computed_tokens, num_computed_tokens + num_scheduled_tokens[seq_id]), in this order."""

    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # the worker cannot see the BlockManager
    preempted_seq_ids: list[str] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)  # since the last step: workers drop their state
    rejected_seqs: list[Sequence] = field(default_factory=list)  # refused by the policy this step (reject_reason)
    # (src, dst) whole-block copies the worker does before the forward pass: copy-on-write of a shared
    # last block after a fork (BlockManager.take_copies; vLLM v0's blocks_to_copy)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # chapter 18: ("offload", block, slot) / ("load", slot, block), and in swap mode ("swap_out", block, slot) /
    # ("swap_in", slot, block), in order, for the second tier (set by the engine from
    # TieredBlockManager.take_tier_ops, like blocks_to_copy)
    kv_tier_ops: list[tuple[str, int, int]] = field(default_factory=list)
    # chapter 13: the token masks of the constrained sequences that sample (a GrammarBitmask, set by the
    # engine like blocks_to_copy; the scheduler never looks at it), applied by ModelRunner.sample
    grammar_bitmask: object = None
    # chapter 17: the KV connector's loads and saves for this step (a KVConnectorMetadata, set by the engine
    # like blocks_to_copy from the connector's scheduler side; the worker side carries them out)
    kv_connector_metadata: object = None
    # chapter 14: the proposals each sequence verifies this step, after its one known token (set by the engine
    # like blocks_to_copy, once the budget has trimmed them; vLLM's name): what the step computes, kept past
    # the verification that clears seq.spec_token_ids
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def blocks_to_swap_out(self) -> list[tuple[int, int]]:
        """vLLM v0's name: this step's (pool block, tier slot) swap-outs (in kv_tier_ops, which keeps the order)."""
        return [(block, slot) for op, block, slot in self.kv_tier_ops if op == "swap_out"]

    @property
    def blocks_to_swap_in(self) -> list[tuple[int, int]]:
        """vLLM v0's name: this step's (tier slot, pool block) swap-ins."""
        return [(slot, block) for op, slot, block in self.kv_tier_ops if op == "swap_in"]

    def samples(self, seq: Sequence) -> bool:
        """Does this step reach the sequence's last known token (so a new token is sampled)?
        False for a partial prefill chunk; True for a verification too (chapter 14: it computes past the last
        known token, through its k proposals). Ask before update_from_output advances the sequence."""
        return seq.num_computed_tokens + self.num_scheduled_tokens[seq.seq_id] >= seq.num_tokens
