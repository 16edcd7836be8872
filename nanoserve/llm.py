"""Chapter 06 — the offline API: many prompts in, one output per prompt, as fast as the engine goes.

    from nanoserve import LLM, SamplingParams
    llm = LLM()                                            # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is",
                         [{"role": "user", "content": "Say hi"}],       # a chat: the template applies
                         {"prompt_token_ids": [504, 3458, 282]}],
                        SamplingParams(temperature=0, max_tokens=32))
    outs[1].text, outs[1].finish_reason, outs[1].metrics["ttft"]

Everything is submitted at once and the engine batches it continuously; outputs come back in
input order. The tokenizer lives here, above the engine: the engine sees token ids only.

    with LLM(tensor_parallel_size=3) as llm:              # chapter 11: 2 worker processes + this one
        llm.generate(...)                                  # leaving the block stops the workers
"""

import sys
from pathlib import Path

from nanoserve.engine.config import LoRAConfig, engine_config
from nanoserve.engine.llm_engine import LLMEngine, RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.student import StudentCode, check_engine_selection


def _is_chat(item) -> bool:
    return isinstance(item, list) and all(isinstance(m, dict) and "role" in m for m in item) and bool(item)


class LLM:
    def __init__(self, model=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int = 1 << 30, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                 student: bool | str | list[str] = False, tokenizer=None, attention_backend: str | None = None,
                 weights: str | None = None, degrade_under_load: int | None = None,
                 tensor_parallel_size: int = 1, kernel_crossover_tokens: int | None = None,
                 large_step_weights: str | None = None, speculative: str | None = None, num_speculative_tokens: int = 4,
                 scheduling_policy: str = "priority", slo_ttft_ms: float | None = None,
                 slo_tpot_ms: float | None = None, slo_reject: bool = False, tenant_weights: dict | None = None,
                 tenant_slos: dict | None = None, kv_cache_dtype: str = "auto",
                 compile_mode: str = "eager", kv_tier_blocks: int = 0, kv_tier_path: str | None = None,
                 preemption_mode: str = "recompute", enable_lora: bool = False, max_loras: int = 4, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, lora_modules: dict | None = None,
                 kv_transfer_config=None, integer_dot: bool | None = None, native_decode: bool | None = None):
        """model: None (the embedded GGUF), a path to a GGUF file, or an already loaded Llama
        (its tokenizer is then the embedded one). student: run your finished exercises instead of the
        reference (True: every chapter; ["05"] or "05,06": those), see nanoserve/student.py.
        tokenizer: one already loaded (default: the model file's). attention_backend: "torch" or "triton"
        (chapter 07; on a CPU "triton" needs TRITON_INTERPRET=1), None for the device's default — checked
        before the model loads. weights: "fp32" (default), "int8" or "q4" (chapter 10), how the weights are
        kept when the model is loaded here. LLM() stays float32 because it is the reference every chapter and
        parity test checks against; `serve` without --weights serves the GGUF's own q4 (cli/serve.py).
        degrade_under_load: with this many requests waiting, steps run on a q4 copy of the weights loaded beside
        them (chapter 10; 161.5 MB more for SmolLM2).
        tensor_parallel_size > 1 starts that many − 1 worker processes, each holding a shard of the weights
        and KV heads (chapter 11); what they cannot run is refused before any starts
        (EngineConfig.check_tensor_parallel), and a failure after they started stops them; call close() after (or
        use `with LLM(...) as llm:`).
        kernel_crossover_tokens: int8 / q4 layers use their integer kernel on steps of up to this many tokens,
        a GEMM beyond (default quant.KERNEL_CROSSOVER_TOKENS: a default, the crossover is the CPU's), in bf16 where
        the CPU multiplies bf16 natively, else float32 (quant.LARGE_STEP_DTYPE); large_step_weights (None: "copy"):
        keep a "copy" of each quantized weight for those steps (2 bytes per weight more in bf16: SmolLM2 q4 holds
        161.5 MB + 269.0 MB; 4 in float32) or "dequantize" it per step (no memory added; then the default crossover is
        64), see quant.py. Both apply to int8 / q4 weights loaded here, and are refused otherwise (fp32 and bf16
        have no integer kernel; a model given keeps what quant.set_kernel_crossover made of it).
        integer_dot: int8 / q4 small steps in kernels/cpu_dot.c's integer products (True) or torch's kernels (False);
        None: quant.default_integer_dot() (chapter 10). Refused where it cannot be honoured (other weights, a model
        given, tensor parallelism, no build); a learner's exercise 10.2 / 10.3 code keeps torch's int4 kernel.
        native_decode: q4 steps of one token per sequence (up to cpu_decode.max_rows sequences: 16 where the layers take
        cpu_dot.c for their small steps, 1 elsewhere) run every layer in one C call (kernels/cpu_decode.c, chapter 09
        section 5) instead of the model's forward; None: cpu_decode.default_native_decode() (on for q4 unless
        integer_dot=False, and off where it cannot run). True is refused where it cannot be honoured (other weights,
        integer_dot=False, a model given, tensor parallelism, LoRA, an int8 / fp8 KV pool, the triton attention
        backend, a learner's chapter 02, 05 or 10 code selected in `student`, no build: cpu_decode.native_decode_blocker).
        speculative: "ngram" or "draft" with num_speculative_tokens proposals per step (chapter 14).
        scheduling_policy: "fcfs", "priority" (default), "slo" or "fair" (chapter 15), with the slo policy's
        default targets slo_ttft_ms / slo_tpot_ms and slo_reject (refuse a request whose TTFT is lost);
        tenant_weights (tenant -> its fair share) and tenant_slos (tenant -> SLOTargets): the server's tenants file.
        kv_cache_dtype: "auto" (the model's parameters', float32 here), "fp32" or "bf16" (half the bytes per
        token: twice the blocks, half the bytes a decode step gathers; the attention then runs in bf16), "int8" or
        "fp8" (chapter 18: 8-bit codes and a bf16 scale per token and kv head, dequantized in the gather).
        kv_tier_blocks: a second KV tier of that many blocks in a file (kv_tier_path, None: a temporary one) that
        evicted prefix blocks go to and are loaded back from (chapter 18); call close() after.
        preemption_mode: "recompute" (chapter 06) or "swap" (chapter 18: a preempted sequence's blocks wait in that
        tier and come back when it resumes; it needs kv_tier_blocks).
        enable_lora (chapter 19): LoRA layers on the projections, `max_loras` adapters per step of rank up to
        `max_lora_rank`, `max_cpu_loras` kept in memory; lora_modules: {name: PEFT adapter directory} loaded now
        (implies enable_lora); generate(..., lora_name=...) picks one per input.

        kv_transfer_config: a KVTransferConfig (chapter 17, nanoserve/engine/config.py): this engine is the
        prefill (kv_producer) or the decode (kv_consumer) half of a disaggregated pair; close() after."""
        from nanoserve.kernels.backend import resolve_attention_backend
        from nanoserve.model import load_gguf
        from nanoserve.kernels.cpu_decode import check_native_decode, default_native_decode, native_decode_blocker
        from nanoserve.model.quant import check_crossover, check_integer_dot, check_weight_format
        from nanoserve.student import parse_selection
        from nanoserve.text.tokenizer import Tokenizer

        path = model if isinstance(model, (str, Path)) else None
        if weights is not None:
            check_weight_format(weights)  # before the model loads
        if integer_dot is not None:
            if model is not None and path is None:
                raise ValueError("integer_dot applies to the weights LLM loads from a GGUF; a model given keeps what "
                                 "quantize_model(..., integer_dot=...) made of it")
            check_integer_dot(integer_dot, weights or "fp32", tensor_parallel_size)
        # chapter 09: where one-token steps may run in kernels/cpu_decode.c; refused for True where they cannot
        native_settings = (weights or "fp32", integer_dot, tensor_parallel_size, bool(enable_lora or lora_modules),
                           kv_cache_dtype, attention_backend, parse_selection(student))
        if native_decode is not None:
            if model is not None and path is None:
                raise ValueError("native_decode applies to the weights LLM loads from a GGUF; a model given runs its "
                                 "one-token steps native where its `native_decode` attribute says so")
            check_native_decode(native_decode, *native_settings)
        if kernel_crossover_tokens is not None or large_step_weights is not None:  # given: they must apply
            if model is not None and path is None:
                raise ValueError("kernel_crossover_tokens and large_step_weights apply to the weights LLM loads from a "
                                 "GGUF; a model given keeps what quant.set_kernel_crossover made of it")
            if weights not in ("int8", "q4"):
                raise ValueError(f"kernel_crossover_tokens and large_step_weights choose between the integer kernel "
                                 f"and the GEMM of int8 / q4 weights; weights={weights or 'fp32'!r} has no integer kernel")
        large_step_weights = "copy" if large_step_weights is None else large_step_weights
        check_crossover(kernel_crossover_tokens, large_step_weights)  # before the model loads
        # the flat keyword arguments above (vLLM's EngineArgs), grouped by idea (nanoserve/engine/config.py): a bad
        # setting is refused here, before any model loads or worker process starts
        config = engine_config(
            block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
            scheduling_policy=scheduling_policy, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
            slo_reject=slo_reject, tenant_weights=tenant_weights, tenant_slos=tenant_slos, speculative=speculative,
            num_speculative_tokens=num_speculative_tokens, student=student, attention_backend=attention_backend,
            degrade_under_load=degrade_under_load, compile_mode=compile_mode, kv_tier_blocks=kv_tier_blocks,
            kv_tier_path=kv_tier_path, preemption_mode=preemption_mode,
            lora_config=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora or lora_modules else None,
            kv_transfer_config=kv_transfer_config)
        if tensor_parallel_size > 1:  # the engine checks too, but only once every worker has loaded its shard
            config.check_tensor_parallel(weights or "fp32", model if path is None else None, parse_selection(student))
        check_engine_selection(student)  # the engine checks too, but only once the model has loaded
        config.check_student(parse_selection(student))  # the engine checks too, but only once the model has loaded
        code = StudentCode(student)  # one record of whose code runs, for the model and the engine
        self.workers = None  # chapter 11: the worker processes of ranks 1 .. n-1

        def load():
            """The model from its GGUF: here, and again on a wake from sleep level 2 (chapter 19)."""
            # with chapter 10 selected in `student`, the weights come from YOUR quantizer (exercises/10), and with
            # chapter 02 the model from YOUR blocks and norms (exercises/02), once finished
            quantizer = code.module("nanoserve.model.quant") if weights in ("int8", "q4") else None
            loaded = load_gguf(path, weights or "fp32", quantizer, code.module, integer_dot)
            if weights in ("int8", "q4"):
                from nanoserve.model.quant import set_kernel_crossover

                set_kernel_crossover(loaded, kernel_crossover_tokens, large_step_weights)
            # chapter 09: one-token steps in kernels/cpu_decode.c (the runner reads this)
            loaded.native_decode = (default_native_decode(weights or "fp32", integer_dot)
                                    and not native_decode_blocker(*native_settings)
                                    if native_decode is None else native_decode)
            return loaded

        loader = None
        if tensor_parallel_size > 1:
            from nanoserve.distributed.multiproc import start_workers

            self.workers, self.model = start_workers(model, tensor_parallel_size, student, code)
        elif model is None or path is not None:
            resolve_attention_backend(attention_backend, "cpu")  # a GGUF loads on the CPU: fail fast, before the load
            self.model, loader = load(), load
        elif weights is not None and weights != getattr(model, "weight_format", "fp32"):
            raise ValueError(f"weights={weights!r} but the model given is already loaded as "
                             f"{getattr(model, 'weight_format', 'fp32')!r}: use load_gguf(..., weights={weights!r})")
        else:
            self.model = model
        try:  # from here on a failure stops the workers started above
            degraded = None
            if degrade_under_load is not None:
                if not (model is None or path is not None) or (weights or "fp32") == "q4":
                    raise ValueError("degrade_under_load loads a q4 copy of the GGUF beside fp32 or int8 weights: "
                                     "give a GGUF path (or none) and weights 'fp32' or 'int8'")
                degraded = load_gguf(path, "q4", integer_dot=integer_dot)
            self.tokenizer = tokenizer or Tokenizer.from_gguf(path)
            self.engine = LLMEngine(self.model, config, self.tokenizer, degraded_model=degraded, student=code,
                                    model_loader=loader)
            for name, adapter_path in (lora_modules or {}).items():
                self.engine.add_lora(name, adapter_path)
        except BaseException:
            self.close()
            raise
        self._next_id = 0

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, chapter 17's KV connector and chapter 18's tier writer;
        idempotent."""
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if self.workers is not None:
            self.workers.shutdown()

    def sleep(self, level: int = 1) -> dict:
        """Chapter 19, vLLM's LLM.sleep: release the weights (level 1: to a file; level 2: dropped, rebuilt from the
        GGUF on wake) and the KV pool until wake_up(); LLMEngine.sleep."""
        return self.engine.sleep(level)

    def wake_up(self) -> dict:
        return self.engine.wake_up()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prompt_token_ids(self, item) -> list[int]:
        """One input -> prompt ids: a string, a chat (list of {"role", "content"}), or a dict with
        "prompt_token_ids", "prompt" or "messages"."""
        if isinstance(item, str):
            return self.tokenizer.encode(item)
        if _is_chat(item):
            return self.tokenizer.encode_chat(item)
        if isinstance(item, dict):
            if "prompt_token_ids" in item:
                return item["prompt_token_ids"]  # the engine checks the ids
            if "messages" in item:
                if not _is_chat(item["messages"]):
                    raise ValueError('"messages" must be a non-empty list of {"role": ..., "content": ...}')
                return self.tokenizer.encode_chat(item["messages"])
            if isinstance(item.get("prompt"), str):
                return self.tokenizer.encode(item["prompt"])
        raise ValueError(
            f"an input must be a string, a list of chat messages, or a dict with 'prompt_token_ids', 'prompt' or "
            f"'messages'; got {type(item).__name__}: {str(item)[:80]}"
        )

    def add_request(self, item, sampling_params: SamplingParams, priority: int = 0, lora_name: str | None = None) -> str:
        """Tokenize one input and queue it; returns its request id."""
        if sampling_params.n > 1:  # run() keeps one final output per request
            raise ValueError(f"n={sampling_params.n}: LLM returns one output per input; for parallel sampling "
                             "step LLMEngine or ask the server")
        request_id = str(self._next_id)
        self.engine.add_request(request_id, self.prompt_token_ids(item), sampling_params, priority, lora_name=lora_name)
        self._next_id += 1
        return request_id

    def run(self, request_ids: list[str], use_tqdm: bool = True, on_finished=None) -> dict[str, RequestOutput]:
        """Step the engine until it is idle; the final output of each request by id
        (and each one passed to `on_finished` the step it finishes)."""
        from tqdm.auto import tqdm

        from nanoserve.distributed.parallel_state import WorkerError

        finished = {}
        with tqdm(total=len(request_ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
            num_tokens = 0
            while self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except WorkerError as e:  # a tensor-parallel rank died: the group is gone, fail what is in flight
                    failed = [rid for rid in request_ids if rid not in finished]
                    for request_id in failed:
                        self.engine.abort_request(request_id)
                    self.close()
                    raise WorkerError(f"requests {failed} failed: {e}") from e
                for out in outputs:
                    num_tokens += len(out.new_token_ids)
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                        if on_finished is not None:
                            on_finished(out)
                bar.set_postfix(out_tok_s=f"{num_tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}", refresh=False)
        if self.engine.student:
            print(self.engine.student_proof(), file=sys.stderr)
        return finished

    def generate(self, inputs, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_name: str | list[str | None] | None = None) -> list[RequestOutput]:
        """One output per input, in input order (see the module docstring for the input forms). lora_name: the
        adapter of every input, or one per input (None: the base model), chapter 19."""
        if isinstance(inputs, (str, dict)) or _is_chat(inputs):
            inputs = [inputs]
        inputs = list(inputs)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(inputs)
        priority = priority or [0] * len(inputs)
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(inputs)
        if not len(params) == len(priority) == len(loras) == len(inputs):
            raise ValueError(f"{len(inputs)} inputs but {len(params)} sampling params, {len(priority)} priorities "
                             f"and {len(loras)} adapters")
        for i, p in enumerate(params):  # before anything is queued: a bad one must not leave the others behind
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params {i}: expected a SamplingParams, got {type(p).__name__}")
        ids = []
        for i, (item, p, prio, lora) in enumerate(zip(inputs, params, priority, loras)):
            try:
                ids.append(self.add_request(item, p, prio, lora))
            except ValueError as e:
                for request_id in ids:  # leave the engine as we found it
                    self.engine.abort_request(request_id)
                raise ValueError(f"input {i}: {e}") from e
        finished = self.run(ids, use_tqdm)
        return [finished[request_id] for request_id in ids]
