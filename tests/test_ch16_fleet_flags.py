"""Chapter 16 — `serve --replicas N` honours every engine flag or refuses it, without starting Ray.

A replica builds its engine from `ReplicaSpec.engine_kwargs`, which `spec_from_args` takes from the very function
one process uses (cli/batch.py's engine_kwargs); LLM groups them into the engine's EngineConfig with the pure
`engine_config` (engine/config.py). Each flag class is checked on the EngineConfig (and the parts built from it) of
the engine a replica would build, `LLM(model, **spec.engine_kwargs)` with the tiny model in place of SmolLM2, against
hand-written expectations; a flag a fleet cannot
honour is refused at start-up with one `error:` line and exit status 2, before Ray or the model is touched."""

import argparse

import psutil
import pytest
import torch

from nanoserve.cli import main, serve
from nanoserve.cluster.cli import spec_from_args
from nanoserve.engine.policies import SLOTargets

TINY = {"vocab_size": 49152, "max_position_embeddings": 1024}
# a tenant's weight is read by the fair policy only, its SLO targets by slo only (a setting the policy would not
# read is refused, chapter 15): one file for each
TENANT_WEIGHTS = """
[keys."sk-big"]
tenant = "big"
weight = 4
[keys."sk-small"]
tenant = "small"
"""
TENANT_SLOS = """
[keys."sk-big"]
tenant = "big"
[keys."sk-strict"]
tenant = "strict"
ttft_slo_ms = 250
tpot_slo_ms = 40
"""


def replica_spec(*flags: str):
    """The ReplicaSpec `serve --replicas 2 FLAGS` deploys: serve's own argument handling (run() does the same),
    then spec_from_args (ReplicaSpec lives beside the Ray Serve deployment: it needs Ray installed)."""
    pytest.importorskip("ray.serve", reason="a replica's spec is Ray Serve's deployment argument: pip install 'ray[serve]'")
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--replicas", "2", "--num-blocks", "32", *flags])
    serve.serving_format(args)
    assert serve.check_args(args) is None
    return spec_from_args(args)


@pytest.fixture
def replica_engine(smollm2_tokenizer):
    """flags -> the LLMEngine a replica builds from that spec: `LLM(model, **spec.engine_kwargs)`, as
    ReplicaSpec.build_llm does, with the tiny model for SmolLM2 and the session's tokenizer (loaded once)."""
    from nanoserve.llm import LLM
    from tests.tiny_model import tiny_llama

    def build(*flags: str):
        spec = replica_spec("--weights", "fp32", *flags)
        return LLM(tiny_llama(**TINY), tokenizer=smollm2_tokenizer, **spec.engine_kwargs).engine

    return build


def test_speculative_decoding_reaches_the_replicas(replica_engine):
    spec = replica_engine("--speculative", "ngram", "--num-speculative-tokens", "3").config.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)


def test_the_scheduling_policy_and_its_slo_targets_reach_the_replicas(replica_engine):
    engine = replica_engine("--scheduling-policy", "slo", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--slo-reject")
    config = engine.config.scheduler_config
    assert (config.policy, config.slo_ttft_ms, config.slo_tpot_ms, config.slo_reject) == ("slo", 500, 50, True)
    assert type(engine.scheduler.policy).__name__ == "SLOPolicy"


def test_the_kv_cache_dtype_reaches_the_replicas(replica_engine):
    engine = replica_engine("--kv-cache-dtype", "bf16")
    assert engine.config.cache_config.kv_cache_dtype == "bf16"
    assert engine.executor.workers[0].model_runner.kv_cache.k_cache[0].dtype == torch.bfloat16


def test_swap_preemption_reaches_the_replicas(replica_engine):
    """Chapter 18: each replica gets the mode and a KV tier of its own (a temporary file: --kv-tier-path is refused
    with replicas, below)."""
    engine = replica_engine("--kv-tier-blocks", "64", "--preemption-mode", "swap")
    try:
        assert engine.config.scheduler_config.preemption_mode == "swap"
        assert engine.block_manager.tier.capacity == 64 and engine.executor.workers[0].kv_tier is not None
    finally:
        engine.close()


def test_the_tenants_weights_and_slos_reach_the_replicas(tmp_path, replica_engine):
    keys = tmp_path / "keys.toml"
    keys.write_text(TENANT_WEIGHTS)
    engine = replica_engine("--api-keys", str(keys))
    config = engine.config.scheduler_config
    assert config.policy == "fair"  # serve's default with tenants (chapter 15)
    assert config.tenant_weights == {"big": 4, "small": 1.0}
    assert engine.scheduler.policy.weights == {"big": 4, "small": 1.0}
    keys.write_text(TENANT_SLOS)
    engine = replica_engine("--api-keys", str(keys), "--scheduling-policy", "slo")
    config = engine.config.scheduler_config
    assert config.tenant_slos == {"strict": SLOTargets(ttft_ms=250, tpot_ms=40)}
    assert engine.scheduler.policy.tenant_slos == {"strict": SLOTargets(ttft_ms=250, tpot_ms=40)}


def test_degrade_under_load_reaches_the_replicas():
    """It loads a q4 copy of the GGUF beside the weights, so it is checked on the spec (the tiny model has no GGUF):
    the replica's LLM gets degrade_under_load, and fp32 weights (serve's default under it, as in one process)."""
    kwargs = replica_spec("--degrade-under-load", "8").engine_kwargs
    assert (kwargs["degrade_under_load"], kwargs["weights"]) == (8, "fp32")


def test_serve_defaults_reach_the_replicas_as_in_one_process():
    """No flags: SmolLM2's own q4 on a bf16 KV pool (serve's serving format), the priority policy."""
    kwargs = replica_spec().engine_kwargs
    assert (kwargs["weights"], kwargs["kv_cache_dtype"], kwargs["scheduling_policy"]) == ("q4", "bf16", "priority")
    assert kwargs["num_blocks"] == 32 and kwargs["speculative"] is None


@pytest.mark.parametrize("flags, named", [
    (["--max-waiting-requests", "4"], "--max-waiting-requests"),
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size"),
    (["--kv-events-endpoint", "tcp://127.0.0.1:5557"], "--kv-events-endpoint"),
    (["--admin-key", "sk-admin"], "--admin-key"),
    (["--kv-tier-blocks", "64", "--kv-tier-path", "/tmp/kv.tier"], "--kv-tier-path"),
])
def test_a_flag_a_fleet_cannot_honour_is_refused_in_one_line(flags, named, capsys):
    assert main(["serve", "--replicas", "2", "--port", "0", *flags]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], err
    assert "starting" not in out  # refused before Ray: no raylet among this process's children
    assert not any("raylet" in p.name() for p in psutil.Process().children(recursive=True))


def serve_args(*flags: str):
    """`serve FLAGS` as serve's own argument handling reads it (run() does the same), without starting anything."""
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--port", "0", *flags])
    serve.serving_format(args)
    return args


@pytest.mark.parametrize("flags, named", [
    # a fleet flag without a fleet would be ignored: refused
    (["--router", "prefix"], "--router"),
    (["--replica-cpus", "2"], "--replica-cpus"),
    (["--ray-num-cpus", "4"], "--ray-num-cpus"),
    # an autoscaling setting without autoscaling, even with a fixed fleet
    (["--target-ongoing-requests", "3"], "--target-ongoing-requests"),
    (["--replicas", "2", "--upscale-delay-s", "5"], "--upscale-delay-s"),
    (["--replicas", "2", "--downscale-delay-s", "5"], "--downscale-delay-s"),
    # a joined cluster has its own CPUs
    (["--ray-address", "auto", "--ray-num-cpus", "4"], "--ray-num-cpus"),
    # the autoscaling range
    (["--replicas", "2", "--max-replicas", "3"], "--replicas"),
    (["--min-replicas", "2"], "--max-replicas"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is above --max-replicas 2"),
    (["--max-replicas", "2", "--target-ongoing-requests", "0"], "--target-ongoing-requests must be > 0"),
    (["--max-replicas", "2", "--upscale-delay-s", "-1"], "--upscale-delay-s"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be > 0"),
    (["--kv-events-allow-remote"], "--kv-events-allow-remote needs --kv-events-endpoint"),
])
def test_fleet_flags_that_cannot_be_honoured_are_refused(flags, named):
    problem = serve.check_args(serve_args(*flags))
    assert problem is not None and named in problem, problem


@pytest.mark.parametrize("flags", [
    ["--replicas", "2", "--router", "prefix", "--replica-cpus", "2", "--ray-num-cpus", "4"],
    ["--ray-address", "auto", "--router", "round-robin"],
    ["--min-replicas", "1", "--max-replicas", "3", "--target-ongoing-requests", "1", "--upscale-delay-s", "2",
     "--downscale-delay-s", "10"],
    [],
])
def test_fleet_flags_in_their_mode_are_accepted(flags):
    assert serve.check_args(serve_args(*flags)) is None
