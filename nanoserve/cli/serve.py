"""`python -m nanoserve serve` (what `make serve` runs): chat with the embedded model in the terminal.

Each line you type is a user message; the conversation so far is rendered with the chat template,
and the reply streams as it is generated (chapter 03's loop with chapter 04's KV cache;
`--no-cache` shows how slow it is without one). Quit with 'exit', Ctrl-D or Ctrl-C. Lines can also be piped in:

    printf 'Hi!\\nWhat is 2+2?\\n' | python -m nanoserve serve --temperature 0

Chapter 08 replaces this with an HTTP server.
"""

import sys

from nanoserve.cli.generate import add_sampling_args, sampling_params


def register(sub):
    p = sub.add_parser("serve", help="chat with the embedded model in the terminal (HTTP comes in chapter 08)")
    add_sampling_args(p)
    p.set_defaults(func=run, max_tokens=256)


def chat(model, tokenizer, params, lines, write, use_cache: bool = True) -> None:
    """The chat loop: `lines` yields user input, `write` shows text. Keeps the conversation."""
    from nanoserve.generate import generate

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
            out = generate(model, tokenizer.encode_chat(messages), params, tokenizer.eos_token_id, tokenizer,
                           on_text=write, use_cache=use_cache)
        except ValueError as e:  # the conversation outgrew the context: start afresh
            write(f"[{e}; starting a new conversation]\n")
            messages = []
            continue
        messages.append({"role": "assistant", "content": out.text})
        write("\n" if out.finish_reason == "stop" else " [max tokens]\n")


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


def run(args):
    from nanoserve.model import load_gguf
    from nanoserve.tokenizer import Tokenizer

    params = sampling_params(args)
    interactive = sys.stdin.isatty()
    if interactive:
        print("loading the model ...", flush=True)
    tokenizer, model = Tokenizer.from_gguf(args.gguf), load_gguf(args.gguf)
    if interactive:
        print("nanoserve chat: SmolLM2-135M-Instruct. Type a message; 'exit' or Ctrl-D to quit.")

    def write(text):
        print(text, end="", flush=True)

    try:
        chat(model, tokenizer, params, read_lines(interactive), write, use_cache=not args.no_cache)
    except KeyboardInterrupt:
        print()
    return 0
