"""Chapter 03's worked examples, computed by the code: each phrase the chapter quotes is built here from what
the tokenizer, the detokenizer, the sampler, the stop check and the cost formula return, and must appear in the
text word for word. The figures the chapter quotes from the notebook must be what the committed notebook printed.
"""

import math
import re

import pytest
import torch

from nanoserve.engine.config import CacheConfig
from nanoserve.model import LlamaConfig
from nanoserve.model.gguf_loader import embedded_gguf_path, gguf_metadata, open_gguf
from nanoserve.sampling import MIN_TEMPERATURE, SamplingParams, probabilities
from nanoserve.text.detokenizer import IncrementalDetokenizer
from nanoserve.text.stop import check_stop
from nanoserve.text.tokenizer import Tokenizer
from tests.chapter_text import ROOT, normalise, notebook_output, says, table_rows

CH = "03"
PARIS = "'The capital of France is'"  # how the notebook labels its second prompt


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf()


def dec(x: float) -> str:
    """.644, the chapter's way of writing a probability."""
    return f"{x:.3f}".removeprefix("0")


def test_gguf_metadata_table():
    reader = open_gguf(embedded_gguf_path())
    merges = gguf_metadata(reader, "tokenizer.ggml.merges")
    types = gguf_metadata(reader, "tokenizer.ggml.token_type")
    says(CH, f"| `tokenizer.ggml.tokens` | {len(gguf_metadata(reader, 'tokenizer.ggml.tokens')):,} strings")
    says(CH, f"| `tokenizer.ggml.merges` | {len(merges):,} merge rules, " + ", ".join(f'`"{m}"`' for m in merges[:3]))
    says(CH, f"3 = control: {sum(t == 3 for t in types)} special tokens")
    says(CH, f"| `tokenizer.ggml.pre` | `{gguf_metadata(reader, 'tokenizer.ggml.pre')}`")
    says(CH, f"| {gguf_metadata(reader, 'tokenizer.ggml.bos_token_id')} / {gguf_metadata(reader, 'tokenizer.ggml.eos_token_id')}; "
             f"`add_bos_token` is {gguf_metadata(reader, 'tokenizer.ggml.add_bos_token')}")


def test_tokens_per_text_table(tok):
    rows = table_rows(CH, r"`.*`")
    rows = [r for r in rows if len(r) == 4 and r[1].isdigit()]  # | text | chars | UTF-8 bytes | tokens |
    assert len(rows) == 5
    for text, chars, nbytes, tokens in rows:
        text = text.strip("`").replace("\\n", "\n")
        assert (len(text), len(text.encode()), len(tok.encode(text))) == (int(chars), int(nbytes), int(tokens.split()[0])), text


def test_a_chinese_character_in_two_tokens_and_the_detokenizer_table(tok):
    ids = tok.encode(" 你")
    pieces = [tok.tokens[i] for i in ids]
    says(CH, f"(`你` = {'你'.encode().hex(' ').upper()} = `{pieces[1]}` + `{pieces[2]}`)")
    d = IncrementalDetokenizer(tok)
    for i, piece in zip(ids, pieces):
        emitted = d.add(i)
        says(CH, f"| `{piece}` | {tok.id_to_bytes[i].hex(' ').upper()} | {d.pending.hex(' ').upper()} | `{emitted!r}` "
                 f"| `{tok.decode([i])!r}` |".replace("|  |", "| |"))


def test_the_digit_trap_ours(tok):
    for text, shown in (("a  123", "`a  123`"), ("\n\n7", "`\\n\\n7`")):
        says(CH, f"| {shown} | " + " ".join(f"`{tok.tokens[i]}`" for i in tok.encode(text)) + " |")


def test_the_parity_corpus_size():
    from tests.test_ch03_tokenizer import CORPUS

    says(CH, f"The parity test runs a corpus of {len(CORPUS)} strings")


def test_bytes_without_a_token(tok):
    single = {b[0] for b in tok.id_to_bytes if len(b) == 1}
    missing = [b for b in range(256) if b not in single]
    assert [b for b in missing if b >= 0xF1] == [0xF1, 0xF2, *range(0xF5, 0x100)]
    assert [b for b in missing if 0x80 <= b < 0xF1] == [0xC0, 0xC1]
    ascii_controls = [b for b in missing if b < 0x20]
    assert len(ascii_controls) == len(missing) - 15
    says(CH, f"{len(missing)} byte values have no token in this vocabulary (F1, F2, F5–FF, C0, C1 and "
             f"{['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven'][len(ascii_controls)]} ASCII control bytes)")
    # U+40000 .. U+BFFFF are exactly the code points whose UTF-8 starts with F1 or F2
    assert "\U00040000".encode()[0] == 0xF1 and "\U000BFFFF".encode()[0] == 0xF2 and "\U000C0000".encode()[0] == 0xF3
    says(CH, "U+40000–U+BFFFF")


def test_the_chat_template_prompt_length(tok):
    question = "What is the capital of France?"
    n, total = len(tok.encode(question)), len(tok.encode_chat([{"role": "user", "content": question}]))
    says(CH, f"the {n}-token question becomes a **{total}-token** prompt: {total - n} tokens of the prompt are formatting")
    # what two chats share: their common prefix (whole blocks of it are cached) and their common end (never shared)
    a, b = (tok.encode_chat([{"role": "user", "content": q}]) for q in (question, "Tell me a story."))
    prefix = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    suffix = next(i for i, (x, y) in enumerate(zip(a[::-1], b[::-1])) if x != y)
    says(CH, f"prefix caching shares the leading {prefix} of them")
    assert prefix // CacheConfig().block_size == 1  # "one block of 16 at the default block size"
    says(CH, f"one block of {CacheConfig().block_size} at the default block size")
    says(CH, f"The {suffix} after the question")


def test_the_sampling_worked_example():
    z = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = torch.softmax(z, -1).tolist()
    says(CH, f"`z = [2, 1, 0, −1]`: `softmax = [{', '.join(dec(x) for x in p)}]`")
    k2 = probabilities(z, SamplingParams(top_k=2)).tolist()
    says(CH, f"With `top_k = 2`: `[{dec(k2[0])}, {dec(k2[1])}, 0, 0]`")
    p9 = probabilities(z, SamplingParams(top_p=0.9)).tolist()
    says(CH, f"`{dec(p[0])} + {dec(p[1])} = {dec(p[0] + p[1])} < .9`, so the third token is still needed "
             f"(reaching `{dec(sum(p[:3]))}`), the fourth is cut: `[{dec(p9[0])}, {dec(p9[1])}, {dec(p9[2])}, 0]`")
    assert p9[3] == 0
    logits = torch.zeros(LlamaConfig().vocab_size)
    says(CH, f"a `({logits.numel()},)` float32 vector, {logits.numel() * logits.element_size():,} bytes")


def test_the_temperature_floor():
    assert SamplingParams(temperature=MIN_TEMPERATURE / 10).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0).greedy
    says(CH, f"A temperature in (0, {MIN_TEMPERATURE}) is raised to {MIN_TEMPERATURE}")
    ratio = math.exp(-0.1 / MIN_TEMPERATURE)  # a logit 0.1 below the best, at the floor
    says(CH, f"a logit 0.1 below the best one is e⁻¹⁰ ≈ {ratio:.1e}".replace("e-05", "·10⁻⁵") + " times as likely")


def test_the_stop_string_example():
    text = "Hello.\nUser: more"
    reason, cut = check_stop([5], text, SamplingParams(stop=["\nUser:"]), eos_token_id=2)
    assert reason == "stop"
    says(CH, f'`"Hello.\\nUser: more"` with `stop=["\\nUser:"]` returns `"{cut}"`')


def test_the_cost_of_no_cache(tok):
    P = len(tok.encode_chat([{"role": "user", "content": "Tell me a story about a dragon."}]))  # the notebook's
    n = 32
    work, cached = n * P + n * (n - 1) // 2, P + n - 1
    says(CH, f"For the notebook's {P}-token story prompt and a {n}-token reply that is **{work:,} vs {cached} "
             f"positions, {round(work / cached)}× fewer** with the cache")
    # the notebook's timing of that very reply, both ways, counted the same positions
    assert normalise(f"token positions computed: {work:,} without the cache, {cached} with it") in notebook_output(CH)
    vocab, hidden = LlamaConfig().vocab_size, LlamaConfig().hidden_size
    says(CH, f"`(1, {vocab})` float32 = {vocab * 4 // 1024} KiB per step")
    says(CH, f"{256 * vocab * 4 // 2**20} MiB at 256 tokens")
    says(CH, f"plus {round(vocab * hidden / 1e6)}M multiply-adds per extra position for the LM head")


def test_the_quoted_notebook_figures_are_what_the_notebook_printed():
    out = notebook_output(CH)

    def after(marker: str, before: str, start: str = "") -> str:
        """The printed text between `marker` and `before`, in the notebook output from `start` on."""
        text = out[out.index(start):] if start else out
        return text.split(normalise(marker), 1)[1].split(before, 1)[0].strip()

    # section 2: the probability of <|im_end|> next, after a missing and after a wrong template
    missing = after("next token: '<|im_end|>' ", ",", "--- no template")
    wrong = after("next token: '<|im_end|>' ", ",", "--- [INST] template")
    says(CH, f"(probability {missing} and {wrong})")
    # section 4: what top-p keeps, and the most likely next tokens, after the story and the Paris prompts
    story = eval(after("tokens kept by top_p", ";", "story opening"))  # {0.5: 4, 0.9: 23, 0.99: 375}
    paris = eval(after("tokens kept by top_p", ";", PARIS))
    says(CH, f"`top_p = 0.9` keeps **{paris[0.9]}** token")
    says(CH, f"`top_p = 0.9` keeps **{story[0.9]}** tokens (`top_p = 0.5` keeps {story[0.5]}, `top_p = 0.99` keeps "
             f"{story[0.99]}; after the Paris prompt, 0.99 keeps {paris[0.99]})")

    def prob(word: str, start: str) -> str:  # "' Paris' 0.951" -> ".951"
        return re.search(re.escape(repr(word)) + r" 0(\.\d+)", out[out.index(start):]).group(1)

    says(CH, f'" Paris" has probability {prob(" Paris", PARIS)}')
    openings = ", ".join(f'"{word}" {prob(word, "story opening")}' for word in ("The", "There", "One", "Once"))
    says(CH, f"({openings}, …)")
    # section 6: one forward pass over 1 and over 16 tokens, and the load the notebook printed with them
    one, sixteen = (after(f"one forward pass over {n:3d} tokens:", " ms") for n in (1, 16))
    load = after("load average", ",", "interleaved rounds;")
    says(CH, f"in its saved run (2026-12-03, load {load}, on a VM it did not record, on that day's code), a pass "
             f"over 16 tokens took {sixteen} ms, less than twice the {one} ms of a pass over one")
    assert float(sixteen) < 2 * float(one)


def test_the_exercise_readme_quotes_the_same_probabilities():
    e = [math.exp(x) for x in (2, 1, 0, -1)]
    readme = normalise((ROOT / "exercises/03-tokens-and-sampling/README.md").read_text())
    assert f"probabilities `[{', '.join(dec(w / sum(e)) for w in e)}]`" in readme
