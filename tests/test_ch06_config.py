"""The engine's settings grouped by idea (nanoserve/engine/config.py): the flat names LLM and the CLI take land in
the sub-config that owns them, with vLLM's field names."""

import pytest

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, engine_config


def test_flat_settings_land_in_their_sub_configs():
    config = engine_config(block_size=4, num_blocks=32, kv_cache_dtype="bf16", max_num_seqs=8,
                           enable_chunked_prefill=False, scheduling_policy="fair", tenant_weights={"a": 2},
                           speculative="ngram", num_speculative_tokens=3, speculative_disable_by_batch_size=None,
                           attention_backend="torch", compile_mode="buckets")
    assert config == EngineConfig(
        cache_config=CacheConfig(block_size=4, num_blocks=32, kv_cache_dtype="bf16"),
        scheduler_config=SchedulerConfig(max_num_seqs=8, enable_chunked_prefill=False, policy="fair",
                                         tenant_weights={"a": 2}),
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=None),
        attention_backend="torch", compile_mode="buckets")


def test_no_method_means_no_speculation():
    assert engine_config().speculative_config is None
    assert engine_config(speculative=None, num_speculative_tokens=2).speculative_config is None
    assert engine_config() == EngineConfig()


@pytest.mark.parametrize("bad", [{"blok_size": 4}, {"cache_config": CacheConfig()}, {"policy": "fair"}])
def test_a_setting_nobody_owns_is_refused(bad):
    # `policy` is SchedulerConfig's field, but the flat name is scheduling_policy (the CLI's --scheduling-policy)
    with pytest.raises(TypeError, match="unexpected setting"):
        engine_config(**bad)


def test_bounds_are_checked_where_the_setting_lives():
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config(max_num_seqs=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_config(speculative="ngram", num_speculative_tokens=0)
