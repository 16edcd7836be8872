"""Chapter 19: `bench lora` on the tiny model — it runs, and its numbers add up (no timing is asserted: speed is
the benchmark's to measure): every system generated requests × new tokens in the same steps, one disk read and
one slot copy per adapter, and the slot and adapter bytes are r·(in + out) per projection, counted by hand."""

import pytest

from nanoserve.bench.lora import measure
from nanoserve.cli import main
from tests.lora_reference import tiny_llama


def test_bench_lora_numbers_add_up():
    model = tiny_llama()
    result = measure(model, ranks=[2, 4], mixes=[1, 2, 4], num_requests=5, prompt_len=8, new_tokens=3, rounds=2)
    for rank in (2, 4):
        systems = result["speed"][rank]
        assert list(systems) == ["merged model", "1 adapter", "2 adapters", "4 adapters"]
        for run in systems.values():
            assert run["output_tokens"] == [5 * 3] * 2 and len(run["seconds"]) == 2
            assert all(s > 0 for s in run["seconds"])
        assert len({tuple(run["steps"]) for run in systems.values()}) == 1  # the same schedule for every system
        assert [len(result["load_ms"][rank][tier]) for tier in ("disk", "slot")] == [4, 4]  # one each per adapter
        # tiny: hidden 64, q 64, k and v 32, intermediate 128; two layers, float32
        per_layer = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)  # Σ (in + out)
        assert result["slot_bytes"][rank] == result["adapter_bytes"][rank] == 2 * rank * per_layer * 4
    assert result["model_bytes"] == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("argv, words", [
    (["--num-requests", "4", "--mixes", "1", "8"], "cannot spread over 8 adapters"),
    (["--ranks", "0"], "expected an integer > 0"),
])
def test_bench_lora_refuses_bad_settings(argv, words, capsys):
    try:
        status = main(["bench", "lora", *argv])
    except SystemExit as e:  # argparse's own refusal
        status = e.code
    assert status == 2 and words in capsys.readouterr().err


