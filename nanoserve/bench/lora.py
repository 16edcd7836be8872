"""`python -m nanoserve bench lora`: chapter 19's costs, measured side by side in one run.

  speed   out tok/s of one batch of --num-requests requests spread round robin over 1, 2, 4 and 8 adapters
          (--mixes), against the same batch on one merged model (an adapter merged into the weights, no LoRA
          layers: the base model's speed), at ranks 8, 16 and 64 (--ranks)
  load    one adapter read from disk (read and checked) and copied from memory into a slot, per rank: the
          manager's own timings (LoRAModelManager.load_seconds), median over the adapters. The files were just
          written, so the disk read comes from the OS's page cache; a cold disk is slower
  memory  what max_loras costs: the slots every LoRA layer holds, (max_loras + 1) of max_lora_rank (slot 0 the
          base model's zeros), from the engine's own tensors; and one adapter's copy in memory (max_cpu_loras
          of them), against the model's weights

The adapters are random, written in PEFT's format (adapter_config.json by peft's LoraConfig, the tensors by
safetensors) at each rank on all seven projections: the gather's speed depends on max_lora_rank and the LoRA layers
(LoRAConfig.modules: each gathers at max_lora_rank width whatever parts an adapter adapts), not on the values an
adapter learnt, so random A and B cost what trained ones would.

Per rank, one engine with LoRA layers of that rank (max_lora_rank = the rank: every slot is max_lora_rank wide, a
rank-8 adapter in a rank-64 engine would cost rank 64; max_loras = the largest mix, so no request waits for a
slot) serves every mix, and the merged model's engine serves the same requests: random prompt ids, each request
generating exactly --new-tokens tokens, greedy, EOS ignored, prefix caching off (a later round must not hit an
earlier round's blocks). One untimed warm-up round of every system first (it also fills the slots), then
--rounds rounds interleaved with the order alternating (bench experiment's `interleaved`), each system's figure
its median round, its ratio against the merged model measured in the same minutes.
"""

import copy
import statistics
import tempfile
from pathlib import Path

import torch

from nanoserve.cli.checks import UsageError, positive_int


def register(sub):
    p = sub.add_parser("lora", help="chapter 19: mixes of LoRA adapters vs one merged model per rank; load time; "
                                    "the memory max_loras takes")
    p.add_argument("--ranks", type=positive_int, nargs="+", default=[8, 16, 64])
    p.add_argument("--mixes", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                   help="adapters the batch's requests are spread over, one system each")
    p.add_argument("--num-requests", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="tokens each request generates")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's, = the cores); 1 on a machine busy with other jobs")
    p.set_defaults(func=run)


def write_random_adapter(path: Path, model_config, rank: int, seed: int) -> Path:
    """A rank-`rank` LoRA adapter in PEFT's format on every projection of every layer, A and B random."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    from nanoserve.lora.adapter import module_shapes

    g, tensors = torch.Generator().manual_seed(seed), {}
    for layer in range(model_config.num_hidden_layers):
        for part, (d_in, d_out) in module_shapes(model_config).items():
            block = "mlp" if part in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{part}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5  # (r, in)
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01  # (out, r)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(module_shapes(model_config))).save_pretrained(path)
    return path


def mixed_workload(prompts: list[list[int]], new_tokens: int, adapters: list[str | None]) -> list:
    """bench offline's workload rows, request i under adapters[i % len(adapters)] (None: no adapter)."""
    return [(p, new_tokens, {"lora_name": adapters[i % len(adapters)]}) for i, p in enumerate(prompts)]


def measure(base_model, ranks, mixes, num_requests: int, prompt_len: int, new_tokens: int, rounds: int,
            seed: int = 0) -> dict:
    """{"speed": {rank: {system: {"seconds": [per round], "output_tokens": [...], "steps": [...]}}},
        "load_ms": {rank: {"disk": [...], "slot": [...]}}, "slot_bytes": {rank: bytes per slot},
        "adapter_bytes": {rank: one adapter's bytes in memory}, "model_bytes": the base model's weights}."""
    import random

    from nanoserve.bench.experiment import engine_for, interleaved
    from nanoserve.bench.offline import run_nanoserve
    from nanoserve.engine.config import LoRAConfig
    from nanoserve.lora.adapter import load_adapter
    from nanoserve.lora.merge import merge_adapter

    config, rng = base_model.config, random.Random(seed)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
    settings = dict(num_blocks=num_requests * -(-(prompt_len + new_tokens) // 16) + 8, block_size=16,
                    max_num_seqs=num_requests, enable_prefix_caching=False)
    result = {"speed": {}, "load_ms": {}, "slot_bytes": {}, "adapter_bytes": {},
              "model_bytes": sum(t.numel() * t.element_size() for t in base_model.parameters())}

    def run_round(name, system, r):
        engine, workload = system
        run = run_nanoserve(engine, workload)
        return {"seconds": run.seconds, "output_tokens": sum(rec.output_tokens for rec in run.records), "steps": run.steps}

    with tempfile.TemporaryDirectory(prefix="nanoserve-bench-lora-") as tmp:
        merged = copy.deepcopy(base_model)
        first = write_random_adapter(Path(tmp) / "merged", config, ranks[0], seed)
        merge_adapter(merged, load_adapter("merged", first, config, ranks[0]))
        merged_engine = engine_for(merged, **settings)
        for rank in ranks:
            names = [f"r{rank}-{i}" for i in range(max(mixes))]
            engine = engine_for(copy.deepcopy(base_model), **settings, lora_config=LoRAConfig(
                max_loras=max(mixes), max_lora_rank=rank, max_cpu_loras=max(mixes)))
            for i, name in enumerate(names):
                engine.add_lora(name, write_random_adapter(Path(tmp) / name, config, rank, seed + 1 + i))
            systems = {"merged model": (merged_engine, mixed_workload(prompts, new_tokens, [None]))}
            systems |= {f"{k} adapter{'s' if k > 1 else ''}": (engine, mixed_workload(prompts, new_tokens, names[:k]))
                        for k in mixes}
            for name, system in systems.items():  # warm-up, untimed: it also puts the adapters into their slots
                run_round(name, system, -1)
            result["speed"][rank] = {name: {key: [run[key] for run in runs] for key in runs[0]}
                                     for name, runs in interleaved(rounds, systems, run_round).items()}
            manager = engine.executor.workers[0].lora_manager
            result["load_ms"][rank] = {tier: [s * 1000 for s in times] for tier, times in manager.load_seconds.items()}
            result["slot_bytes"][rank] = manager.slot_bytes() // (max(mixes) + 1)
            result["adapter_bytes"][rank] = manager.cpu[names[0]].nbytes
            engine.close()
        merged_engine.close()
    return result


def median_rate(run: dict) -> float:
    """Output tokens per second of the median round."""
    return statistics.median(tokens / seconds for tokens, seconds in zip(run["output_tokens"], run["seconds"]))


def mib(n: int) -> str:
    return f"{n / 2 ** 20:8.2f} MiB"


@torch.inference_mode()
def run(args):
    from nanoserve.model import load_gguf

    if args.num_requests < max(args.mixes):
        raise UsageError(f"--num-requests {args.num_requests} cannot spread over {max(args.mixes)} adapters "
                         f"(--mixes {' '.join(map(str, args.mixes))}): give at least {max(args.mixes)} requests")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"command: python -m nanoserve bench lora --ranks {' '.join(map(str, args.ranks))} "
          f"--mixes {' '.join(map(str, args.mixes))} --num-requests {args.num_requests} --prompt-len {args.prompt_len} "
          f"--new-tokens {args.new_tokens} --rounds {args.rounds} --seed {args.seed}"
          + (f" --threads {args.threads}" if args.threads else ""), flush=True)
    print(f"threads: {torch.get_num_threads()}; SmolLM2 float32; {args.num_requests} requests of {args.prompt_len} "
          f"random prompt tokens, {args.new_tokens} new tokens each, greedy, EOS ignored; random adapters on all 7 "
          f"projections; median of {args.rounds} interleaved rounds after one warm-up round", flush=True)
    result = measure(load_gguf(), args.ranks, args.mixes, args.num_requests, args.prompt_len, args.new_tokens,
                     args.rounds, args.seed)
    for rank, systems in result["speed"].items():
        merged = median_rate(systems["merged model"])
        print(f"\nrank {rank} (max_lora_rank {rank}, max_loras {max(args.mixes)}):")
        for name, run_ in systems.items():
            rate = median_rate(run_)
            print(f"  {name:14s} {rate:8.1f} out tok/s  {rate / merged:5.2f}x merged   {run_['output_tokens'][0]} "
                  f"tokens in {run_['steps'][0]} steps; rounds: " + " ".join(f"{s:.2f}s" for s in run_["seconds"]))
    print("\nload of one adapter (median over the adapters; the disk read from a warm page cache):")
    for rank, tiers in result["load_ms"].items():
        print(f"  rank {rank:3d}: from disk {statistics.median(tiers['disk']):7.2f} ms ({len(tiers['disk'])} reads), "
              f"from memory into a slot {statistics.median(tiers['slot']):7.2f} ms ({len(tiers['slot'])} copies)")
    print(f"\nmemory (the model's weights: {mib(result['model_bytes']).strip()}):")
    print("  one adapter in memory (each of max_cpu_loras): "
          + ", ".join(f"rank {rank} {mib(n).strip()}" for rank, n in result["adapter_bytes"].items()))
    print("  the slots of every LoRA layer, (max_loras + 1) x max_lora_rank wide:")
    print(f"  {'max_loras':>11s}" + "".join(f"{f'rank {rank}':>14s}" for rank in result["slot_bytes"]))
    for m in sorted({1, 2, 4, 8} | set(args.mixes)):
        print(f"  {m:11d}" + "".join(f"{mib((m + 1) * per_slot):>14s}" for per_slot in result["slot_bytes"].values()))
