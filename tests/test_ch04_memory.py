"""Chapter 04: the memory formula, checked against numbers computed by hand, and the `memory` CLI.

Exercises 4.2 (KV bytes per token and per sequence) and 4.3 (how many sequences fit) are graded here.
"""

import pytest

from nanoserve.cli import main
from nanoserve.kv.naive import NaiveKVCache
from nanoserve.model import LlamaConfig
from nanoserve.model.known_configs import KNOWN_CONFIGS
from nanoserve.student import implementation

memory = implementation("nanoserve.memory")
GiB = 2**30


# --- Exercises 4.2 and 4.3: the memory formula ---------------------------------------------------------

@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("model, dtype, expected", [
    ("smollm2-135m", "fp32", 2 * 30 * 3 * 64 * 4),      # 46,080 B
    ("smollm2-135m", "bf16", 2 * 30 * 3 * 64 * 2),      # 23,040 B
    ("llama-3-8b", "bf16", 2 * 32 * 8 * 128 * 2),       # 131,072 B = 128 KiB
    ("llama-3-70b", "bf16", 2 * 80 * 8 * 128 * 2),      # 327,680 B
    ("qwen2.5-7b", "bf16", 2 * 28 * 4 * 128 * 2),       # 57,344 B: only 4 kv heads
    ("mistral-7b", "fp32", 2 * 32 * 8 * 128 * 4),       # 262,144 B
])
def test_kv_bytes_per_token_by_hand(model, dtype, expected):
    assert memory.kv_bytes_per_token(KNOWN_CONFIGS[model], dtype) == expected


@pytest.mark.exercise("4.2")
def test_kv_bytes_per_sequence_by_hand():
    assert memory.kv_bytes_per_token(LlamaConfig(), "fp32") == 46_080
    assert memory.kv_bytes_per_sequence(KNOWN_CONFIGS["llama-3-8b"], 4096, "bf16") == 536_870_912  # 512 MiB
    assert memory.kv_bytes_per_sequence(LlamaConfig(), 4096, "bf16") == 94_371_840  # 90 MiB


@pytest.mark.exercise("4.2")
def test_kv_bytes_per_sequence_is_what_the_naive_cache_allocates():
    config = LlamaConfig.tiny(num_key_value_heads=1, num_hidden_layers=3)
    assert memory.kv_bytes_per_sequence(config, 100, "fp32") == NaiveKVCache(config, max_len=100).nbytes


@pytest.mark.exercise("4.3")
def test_memory_plan_llama3_8b_on_80_gib_by_hand():
    plan = memory.memory_plan(KNOWN_CONFIGS["llama-3-8b"], 80 * GiB, seq_len=4096, dtype="bf16")
    device = 80 * 2**30                                   # 85,899,345,920
    reserve = device // 10                                # 8,589,934,592
    weights = 8_030_261_248 * 2                           # 16,060,522,496
    activations = 4096 * (2 * 4096 + 48 * 128 + 4096 + 3 * 14336) * 2  # 503,316,480
    assert plan.weights == weights and plan.activations == activations
    assert plan.kv_budget == pytest.approx(device - reserve - weights - activations)  # 60,745,572,352
    assert plan.kv_per_token == 131_072 and plan.kv_per_sequence == 536_870_912
    assert plan.num_sequences == 113  # 60,745,572,352 // 536,870,912


@pytest.mark.exercise("4.3")
def test_memory_plan_reserve_and_what_does_not_fit():
    smol = memory.memory_plan(LlamaConfig(), 80 * GiB, seq_len=4096, dtype="bf16", reserve_fraction=0.0)
    assert smol.num_sequences == int((80 * GiB - 269_030_016 - smol.activations) // 94_371_840)  # 906
    big = memory.memory_plan(KNOWN_CONFIGS["llama-3-70b"], 80 * GiB, seq_len=4096, dtype="bf16")
    assert big.weights > 80 * GiB and big.num_sequences == 0  # 141 GB of weights: needs two devices


@pytest.mark.exercise("4.3")
def test_memory_plan_rejects_seq_len_beyond_context():
    with pytest.raises(ValueError, match=r"(?s)10000.*8192"):
        memory.memory_plan(KNOWN_CONFIGS["llama-3-8b"], 80 * GiB, seq_len=10000)


# --- The registry and the CLI ------------------------------------------------------------------

def test_known_configs_match_published_parameter_counts():
    from nanoserve.memory import parameter_counts

    billions = {name: parameter_counts(c)["total"] / 1e9 for name, c in KNOWN_CONFIGS.items()}
    assert billions["llama-3-8b"] == pytest.approx(8.03, abs=0.01)
    assert billions["llama-3-70b"] == pytest.approx(70.55, abs=0.01)
    assert billions["mistral-7b"] == pytest.approx(7.24, abs=0.01)
    assert billions["qwen2.5-7b"] == pytest.approx(7.62, abs=0.01)
    assert all(c.head_dim == 128 for name, c in KNOWN_CONFIGS.items() if name != "smollm2-135m")


def test_memory_cli_prints_the_breakdown_and_the_answer(capsys):
    main(["memory", "--model", "smollm2-135m", "--device-gb", "80", "--seq-len", "4096", "--dtype", "bf16"])
    out = capsys.readouterr().out
    assert "2 × 30 layers × 3 kv_heads × 64 head_dim × 2 B = 23,040 B" in out
    assert "94,371,840 B" in out and "269,030,016 B" in out
    assert "concurrent sequences of 4096 tokens: 815" in out


def test_memory_cli_says_when_nothing_fits(capsys):
    assert main(["memory", "--model", "llama-3-70b", "--device-gb", "80"]) == 1
    assert "not even one sequence" in capsys.readouterr().out


def test_memory_cli_says_what_mistrals_sliding_window_holds(capsys):
    # Mistral-7B-v0.1's config.json: sliding_window 4096. Past it the plan (full attention) keeps every token
    # and the output says so, with what a window-only cache would hold; within it there is nothing to say.
    main(["memory", "--model", "mistral-7b", "--device-gb", "80", "--seq-len", "32768", "--dtype", "bf16"])
    out = capsys.readouterr().out
    assert "131,072 B × 32768 tokens = 4,294,967,296 B" in out  # the plan itself stays full attention
    budget = 80 * GiB * 0.9 - 7_241_732_096 * 2 - 32768 * (2 * 4096 + 48 * 128 + 4096 + 3 * 14336) * 2
    window = 4096 * 131_072  # 536,870,912 B = 512 MiB
    assert "attend to the last 4096 tokens only (a sliding window)" in out and "keeps all 32768" in out
    assert f"4096 tokens = 536,870,912 B (512.0 MiB) per sequence, {int(budget // window)} sequences" in out  # 109
    main(["memory", "--model", "mistral-7b", "--seq-len", "4096"])
    assert "sliding window" not in capsys.readouterr().out
