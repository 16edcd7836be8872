"""`python -m nanoserve chat` (what `make chat` runs): chat with the model in the terminal.

Each line you type is a user message; the conversation so far goes to the model and the reply
streams as it is generated. Quit with 'exit', Ctrl-D or Ctrl-C. Lines can also be piped in:

    printf 'Hi!\\nWhat is 2+2?\\n' | python -m nanoserve chat       # greedy (temperature 0) unless --temperature

Two back ends, the same loop:
- local (default): the embedded model in this process, chapter 03's loop with chapter 04's KV
  cache (`--no-cache` shows how slow it is without one);
- `--url http://127.0.0.1:8000/v1`: any OpenAI-compatible server — `make serve` (chapter 08), vLLM,
  llama.cpp — through the official `openai` client, streaming. Every sampling flag goes with the request
  (`--top-k` as the extra field `top_k`, which nanoserve, vLLM and llama.cpp take).
A flag its back end cannot honour is refused: --gguf, --weights and --no-cache set up the local model, which
--url does not run; --model and --api-key are for a server.
"""

import os
import sys

from nanoserve.cli import checks
from nanoserve.cli.checks import UsageError
from nanoserve.cli.generate import add_sampling_args, sampling_params


def register(sub):
    p = sub.add_parser("chat", help="chat in the terminal, with the embedded model or an OpenAI-compatible --url")
    add_sampling_args(p)
    p.add_argument("--url", help="an OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="with --url: the model to ask for (default: the server's first)")
    p.add_argument("--api-key", default=None, help="with --url: the server's API key (default: $NANOSERVE_API_KEY)")
    # greedy by default: the most likely reply ("What is 2+2?" -> "The answer to this classic math problem is 4."),
    # the same every time on the local model's float32 weights (a q4 server behind --url can pick another near-tie
    # token on a repeat: chapter 08, section 10); at generate's 0.7 a 135M model wanders off ("Your math is very
    # important..."). --temperature 0.7 for variety. No default --weights: given with --url, it is refused.
    p.set_defaults(func=run, max_tokens=256, temperature=0.0, weights=None)


def chat_loop(lines, write, reply) -> None:
    """`lines` yields user input, `write` shows text, `reply(messages, write)` streams one answer and
    returns (text, finish_reason). Keeps the conversation."""
    messages = []
    for line in lines:
        line = line.strip()
        if line in ("exit", "quit"):
            return
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        write("assistant> ")
        try:
            text, finish_reason = reply(messages, write)
        except ValueError as e:  # the conversation outgrew the context: start afresh
            write(f"[{e}; starting a new conversation]\n")
            messages = []
            continue
        messages.append({"role": "assistant", "content": text})
        write("\n" if finish_reason == "stop" else " [max tokens]\n")


def chat(model, tokenizer, params, lines, write, use_cache: bool = True) -> None:
    """The loop on a model in this process."""
    chat_loop(lines, write, local_reply(model, tokenizer, params, use_cache))


def local_reply(model, tokenizer, params, use_cache: bool = True):
    """reply() for chat_loop on a model in this process (chapter 03's generate loop)."""
    from nanoserve.generate import generate

    def reply(messages, write):
        out = generate(model, tokenizer.encode_chat(messages), params, tokenizer.eos_token_id, tokenizer,
                       on_text=write, use_cache=use_cache)
        return out.text, out.finish_reason

    return reply


def remote_reply(client, model: str, params):
    """reply() for chat_loop through an OpenAI-compatible server, streaming."""
    import openai

    def reply(messages, write):
        pieces, finish_reason = [], None
        try:
            stream = client.chat.completions.create(
                model=model, messages=messages, stream=True, max_tokens=params.max_tokens,
                temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                extra_body={"top_k": params.top_k} if params.top_k > 0 else None)  # not in OpenAI's API
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        write(choice.delta.content)
                        pieces.append(choice.delta.content)
                    finish_reason = choice.finish_reason or finish_reason
        except openai.BadRequestError as e:  # most likely the context is full
            raise ValueError(e.message) from None
        return "".join(pieces), finish_reason

    return reply


def read_lines(interactive: bool):
    while True:
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive:
            if not line:
                return  # end of piped input
            print(f"you> {line}", end="" if line.endswith("\n") else "\n")
        yield line


def refuse_unused_flags(args) -> None:
    """A UsageError naming the flags given that this back end cannot honour (before anything connects or loads)."""
    if args.url:
        given = [f for f, v in (("--gguf", args.gguf), ("--weights", args.weights), ("--no-cache", args.no_cache)) if v]
        why, fix = "the local model, which --url does not run", "drop {them} or --url"
    else:
        given = [f for f, v in (("--model", args.model), ("--api-key", args.api_key)) if v is not None]
        why, fix = "an OpenAI-compatible server", "give its --url or drop {them}"
    if given:
        one = len(given) == 1
        raise UsageError(f"{', '.join(given)} {'is' if one else 'are'} for {why}: {fix.format(them='it' if one else 'them')}")


def run(args):
    refuse_unused_flags(args)
    params = sampling_params(args)  # a bad value: a UsageError, one line
    interactive = sys.stdin.isatty()

    def write(text):
        print(text, end="", flush=True)

    if args.url:
        import openai

        client = openai.OpenAI(base_url=args.url, api_key=args.api_key or os.environ.get("NANOSERVE_API_KEY") or "none")
        try:
            model = args.model or client.models.list().data[0].id
        except openai.APIError as e:
            print(f"error: cannot reach an OpenAI-compatible server at {args.url}: {e}", file=sys.stderr)
            return 2
        reply = remote_reply(client, model, params)
        banner = f"nanoserve chat: {model} at {args.url}."
    else:
        from nanoserve.model import load_gguf

        tokenizer = checks.load_tokenizer(args.gguf)  # a tokenizer it cannot read: one error line, no model loaded
        if interactive:
            print("loading the model ...", flush=True)
        reply = local_reply(load_gguf(args.gguf, args.weights or "fp32"), tokenizer, params, use_cache=not args.no_cache)
        banner = "nanoserve chat: SmolLM2-135M-Instruct."
    if interactive:
        print(banner + " Type a message; 'exit' or Ctrl-D to quit.")
    try:
        chat_loop(read_lines(interactive), write, reply)
    except KeyboardInterrupt:
        print()
    return 0
