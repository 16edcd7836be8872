"""Chapter 09 — the course's prompt set: written here, drawn from a seed, the same on every machine (no download).

`course_prompts(n, seed)` mixes three kinds of request, each with its own length distribution:

  kind        share  what it is                                           prompt (SmolLM2 tokens)  output tokens
  chat        50 %   a short user turn, after 0-2 earlier turns           34-167, mean 96          uniform 32..128
  document    25 %   8-48 sentences of prose, then a question about them  190-888, mean 522        uniform 16..64
  system      25 %   SHARED_SYSTEM_PROMPT, then a short user turn         186-190 (174 shared)     uniform 32..96

(prompt lengths: the chat template rendered and tokenized, over course_prompts(400, seed=0).)
A fourth kind, "grounded" (chapter 14), is drawn only when asked for (kinds=["grounded"]): a task that
answers *from a given text* — repeat, rewrite, extract — so the answer copies spans of its prompt, which
is what n-gram speculation feeds on. Output 48..96 tokens.
Every "system" request opens with the same 174 tokens (the system turn and the user turn's opening): what
prefix caching saves.
Any OpenAI-compatible server gets the same messages (its own chat template renders them).

`random_prompts` draws random token ids of exact lengths and decodes them (like `vllm bench serve
--dataset-name random`), and `load_prompts` reads a JSONL file of {"messages" or "prompt", "output_len"}.
"""

import json
import random

SHARED_SYSTEM_PROMPT = (
    "You are the help desk assistant of a small public library. Answer in plain, friendly English and keep "
    "every answer short: two or three sentences unless the reader asks for more. The library opens at nine in "
    "the morning and closes at six in the evening from Monday to Friday, and at one in the afternoon on "
    "Saturday; it is closed on Sunday. Members may borrow up to eight books, four films and two games at a "
    "time, for three weeks, and may renew each loan twice unless someone else has reserved it. Late returns "
    "cost ten cents a day per item, never more than five dollars. The reading room on the first floor is "
    "silent; the group rooms on the second floor can be booked for two hours at a time. If you do not know "
    "the answer, say so and suggest asking at the front desk."
)

TOPICS = ["the moon", "bread", "volcanoes", "rivers", "honey bees", "chess", "the printing press", "glaciers",
          "coffee", "lighthouses", "octopuses", "paper", "bicycles", "thunderstorms", "maps", "the violin",
          "penguins", "clocks", "salt", "the alphabet", "bridges", "tea", "deserts", "whales", "windmills"]

QUESTIONS = ["What is {t}?", "Tell me one surprising fact about {t}.", "Explain {t} to a child.",
             "Write a short poem about {t}.", "Why do people care about {t}?", "List three things about {t}.",
             "How would you describe {t} in one sentence?", "What is the history of {t}?"]

SENTENCES = [
    "The harbour town woke slowly, as the fishing boats came back with the tide.",
    "Most of the houses on the hill were built of grey stone and roofed with slate.",
    "A new road had reached the valley ten years ago, and with it came the first shop.",
    "The river floods every spring, and the meadows along it stay green all summer.",
    "In the old mill, the wheel still turns, although it no longer grinds any grain.",
    "The school has forty pupils, two teachers and a garden where they grow beans.",
    "Every Thursday a market fills the square with cheese, apples and second-hand books.",
    "The lighthouse keeper kept a diary of the weather for more than thirty years.",
    "Winters are long and dark, so the library stays open late and lends lamps as well as books.",
    "A storm in the autumn of that year tore the roof off the church and sank three boats.",
    "The town council voted to repair the bridge before building anything new.",
    "Children learn to swim in the cold lake, which is never warmer than eighteen degrees.",
    "The baker starts work at four in the morning and sells out before noon.",
    "Trains stop at the station twice a day, once going north and once going south.",
    "An old map in the museum shows the coast as it was before the sea moved inland.",
    "The forest to the east is home to deer, foxes and a great many noisy crows.",
    "When the mine closed, half of the young people moved to the city to find work.",
    "A festival of music and lanterns is held on the longest night of the year.",
    "The doctor visits on Mondays, and the pharmacy opens only in the afternoons.",
    "Most families keep a few hens, and eggs are traded for vegetables and wood.",
]

DOCUMENT_QUESTIONS = ["What happened to the church?", "How often do the trains stop?", "What does the baker do?",
                      "Summarise the text in one sentence.", "What is the weather like in winter?",
                      "Why did young people leave the town?"]

KINDS = [("chat", 0.5), ("document", 0.25), ("system", 0.25)]
OPT_IN_KINDS = [("grounded", 1.0)]  # only with kinds=[...]: the default mix stays what chapter 09 measured

GROUNDED_TASKS = ["Copy the text above exactly, word for word.",
                  "Rewrite the text above as a numbered list, one sentence per item, keeping the words.",
                  "Extract every sentence of the text above that mentions a place or a building.",
                  "Summarise the text above, reusing its own sentences.",
                  "Repeat the text above, but in the past tense."]


def _chat(rng: random.Random) -> dict:
    messages = []
    for _ in range(rng.randint(0, 2)):  # earlier turns of the conversation
        topic = rng.choice(TOPICS)
        messages += [{"role": "user", "content": rng.choice(QUESTIONS).format(t=topic)},
                     {"role": "assistant", "content": f"Here is something about {topic}: "
                                                      + " ".join(rng.sample(SENTENCES, 2))}]
    messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(t=rng.choice(TOPICS))})
    return {"kind": "chat", "messages": messages, "output_len": rng.randint(32, 128)}


def _document(rng: random.Random) -> dict:
    text = " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(8, 48)))
    question = rng.choice(DOCUMENT_QUESTIONS)
    return {"kind": "document", "output_len": rng.randint(16, 64),
            "messages": [{"role": "user", "content": f"Read this text.\n\n{text}\n\n{question}"}]}


def _system(rng: random.Random) -> dict:
    question = rng.choice(["Can I renew a film?", "When do you open on Saturday?", "How much is a late fee?",
                           "Can I book a group room for the afternoon?", "How many books can I take home?",
                           "Is the library open on Sunday?", "Where can I read in silence?"])
    return {"kind": "system", "output_len": rng.randint(32, 96),
            "messages": [{"role": "system", "content": SHARED_SYSTEM_PROMPT}, {"role": "user", "content": question}]}


def _grounded(rng: random.Random) -> dict:
    text = " ".join(rng.sample(SENTENCES, rng.randint(4, 8)))
    return {"kind": "grounded", "output_len": rng.randint(48, 96),
            "messages": [{"role": "user", "content": f"{text}\n\n{rng.choice(GROUNDED_TASKS)}"}]}


def course_prompts(num_prompts: int, seed: int = 0, kinds=None) -> list[dict]:
    """`num_prompts` requests [{"kind", "messages", "output_len"}], the same for the same seed.

    kinds: restrict to some of "chat", "document", "system", "grounded" (their shares renormalised);
    None: the first three (grounded is opt-in).
    """
    table = [(k, w) for k, w in KINDS + OPT_IN_KINDS if (k in kinds if kinds is not None else (k, w) in KINDS)]
    if not table:
        raise ValueError(f"no known kind in {kinds}; known: {[k for k, _ in KINDS + OPT_IN_KINDS]}")
    make = {"chat": _chat, "document": _document, "system": _system, "grounded": _grounded}
    rng = random.Random(seed)
    names, weights = zip(*table)
    return [make[rng.choices(names, weights)[0]](rng) for _ in range(num_prompts)]


def random_prompts(tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> list[dict]:
    """Random token ids of `input_len` decoded to text (its re-encoding may differ by a few tokens: the
    server's `usage` reports the real count). Only ordinary vocabulary: no special tokens."""
    rng = random.Random(seed)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids]
    return [{"kind": "random", "output_len": output_len,
             "messages": [{"role": "user", "content": tokenizer.decode([rng.choice(vocab) for _ in range(input_len)])}]}
            for _ in range(num_prompts)]


def load_prompts(path: str) -> list[dict]:
    """A JSONL file, one request a line: {"messages": [...]} or {"prompt": "..."}, and optionally "output_len"."""
    items = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON: {e}") from None
            if not isinstance(obj, dict) or ("messages" in obj) == ("prompt" in obj):
                raise ValueError(f'{path}:{n}: expected an object with exactly one of "messages" or "prompt"')
            if "prompt" in obj:
                obj = {**obj, "messages": [{"role": "user", "content": obj.pop("prompt")}]}
            items.append({"kind": obj.get("kind", "file"), "messages": obj["messages"], "output_len": obj.get("output_len")})
    if not items:
        raise ValueError(f"{path}: no requests in it")
    return items
