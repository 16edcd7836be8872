"""Chapter 03: stop conditions (graded: exercise 3.3), the cache-free generate loop, and greedy parity with
transformers."""

import pytest
import torch

from nanoserve.generate import generate
from nanoserve.model import Llama, LlamaConfig
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation
from nanoserve.text.tokenizer import Tokenizer

stop = implementation("nanoserve.text.stop")

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf()


# ---------------------------------------------------------------- check_stop (exercise 3.3)

@pytest.mark.exercise("3.3")
@pytest.mark.parametrize(
    "token_ids,text,params,expected",
    [
        ([5, EOS], "Hi", SamplingParams(), ("stop", "Hi")),
        ([5, EOS], "Hi", SamplingParams(ignore_eos=True), (None, "Hi")),
        ([5, 9], "Hi", SamplingParams(stop_token_ids=[9]), ("stop", "Hi")),
        ([5, 9], "Hi", SamplingParams(max_tokens=2), ("length", "Hi")),
        ([5, 9], "Hi", SamplingParams(max_tokens=3), (None, "Hi")),
        ([5, 9], "Hello.\nUser: more", SamplingParams(stop=["\nUser:"]), ("stop", "Hello.")),
        # a stop string beats max_tokens, as in vLLM: the text is cut either way
        ([5, 9], "Hello.\nUser:", SamplingParams(stop=["\nUser:"], max_tokens=2), ("stop", "Hello.")),
        # the earliest of several stop strings wins
        ([5], "one two three", SamplingParams(stop=["three", "two"]), ("stop", "one ")),
        ([5], "Hi", SamplingParams(stop=["Bye"]), (None, "Hi")),
    ],
)
def test_check_stop(token_ids, text, params, expected):
    assert stop.check_stop(token_ids, text, params, EOS) == expected


@pytest.mark.exercise("3.3")
def test_stop_string_window_covers_strings_that_span_tokens():
    # 'STOP' completed by a token that added only 'P': the search starts len('STOP') - 1 chars before it
    assert stop.check_stop([7], "abc STOP", SamplingParams(stop=["STOP"]), EOS, num_new_chars=1) == ("stop", "abc ")
    # ...and does not rescan old text (where it would already have been found a step earlier)
    assert stop.check_stop([7], "STOP abcdef", SamplingParams(stop=["STOP"]), EOS, num_new_chars=1) == (None, "STOP abcdef")
    # all of the text new (7 chars, or None), and the earliest of two stop strings
    assert stop.find_stop_string("ab STOP", SamplingParams(stop=["STOP"]), num_new_chars=7) == 3
    assert stop.find_stop_string("a\nUser: b", SamplingParams(stop=["b", "\nUser:"])) == 1


@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("token_id,params,expected", [
    (2, SamplingParams(), True),                                # EOS
    (2, SamplingParams(ignore_eos=True), False),                # EOS ignored
    (2, SamplingParams(ignore_eos=True, stop_token_ids=[2]), True),  # ...unless it is also a stop token
    (9, SamplingParams(stop_token_ids=[7, 9]), True),
    (5, SamplingParams(stop_token_ids=[7, 9]), False),
])
def test_is_stop_token(token_id, params, expected):
    assert stop.is_stop_token(token_id, params, EOS) is expected


# ---------------------------------------------------------------- the loop, on a scripted model

class ScriptedModel:
    """Stands in for Llama: always predicts the next id of `script` (by sequence length)."""

    def __init__(self, script):
        self.script = script
        self.config = LlamaConfig()  # SmolLM2's vocabulary and context
        self.seen_lengths = []

    def __call__(self, input_ids):
        self.seen_lengths.append(input_ids.shape[0])
        return input_ids.float()[:, None]  # (num_tokens, 1) "hidden"

    def compute_logits(self, hidden):
        step = len(self.seen_lengths) - 1
        logits = torch.zeros(1, self.config.vocab_size)
        logits[0, self.script[step]] = 10.0
        return logits


def run_script(tok, text_or_ids, params, on_text=None):
    script = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    prompt = tok.encode("Say:")
    model = ScriptedModel(script)
    return generate(model, prompt, params, tok.eos_token_id, tok, on_text=on_text), model


def test_no_cache_recomputes_the_whole_sequence(tok):
    out, model = run_script(tok, "a b c d", SamplingParams(temperature=0, max_tokens=4))
    p = len(out.prompt_token_ids)
    assert model.seen_lengths == [p, p + 1, p + 2, p + 3]
    assert out.finish_reason == "length" and out.text == "a b c d"


def test_eos_ends_the_output_and_is_kept_in_token_ids_only(tok):
    ids = tok.encode("Paris.") + [tok.eos_token_id] + tok.encode(" more")
    out, _ = run_script(tok, ids, SamplingParams(temperature=0, max_tokens=20))
    assert out.finish_reason == "stop" and out.text == "Paris." and out.token_ids[-1] == tok.eos_token_id
    out, _ = run_script(tok, ids, SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True))
    assert out.finish_reason == "length" and out.text == "Paris. more"


def test_stop_token_ids_end_the_output_without_their_text(tok):
    ids = tok.encode("one two three")
    out, _ = run_script(tok, ids, SamplingParams(temperature=0, stop_token_ids=[ids[1]], max_tokens=20))
    assert out.finish_reason == "stop" and out.token_ids == ids[:2] and out.text == "one"


def test_stop_string_cuts_the_text_and_streaming_never_shows_it(tok):
    streamed = []
    out, _ = run_script(tok, "Sure!\nUser: next question", SamplingParams(temperature=0, stop=["\nUser:"], max_tokens=20),
                        on_text=streamed.append)
    assert out.finish_reason == "stop" and out.text == "Sure!"
    assert "".join(streamed) == out.text


def test_streamed_deltas_add_up_to_the_text(tok):
    text = "机器学习 🙂 ok"
    streamed = []
    out, _ = run_script(tok, text, SamplingParams(temperature=0, max_tokens=len(tok.encode(text))),
                        on_text=streamed.append)
    assert "".join(streamed) == out.text == text
    assert all("\ufffd" not in piece for piece in streamed)


def test_terminal_chat_keeps_the_conversation_and_stops_at_exit(tok):
    from nanoserve.cli.chat import chat

    reply = tok.encode("Hello there!") + [tok.eos_token_id]
    model = ScriptedModel(reply + reply)
    shown = []
    chat(model, tok, SamplingParams(temperature=0, max_tokens=10), iter(["hi\n", "\n", "again\n", "exit\n", "never"]),
         shown.append, use_cache=False)  # the scripted model sees whole sequences: no cache
    assert "".join(shown) == "assistant> Hello there!\n" * 2
    # the second prompt held the whole conversation: both user turns and the first reply
    second_prompt_len = model.seen_lengths[len(reply)]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there!"},
                {"role": "user", "content": "again"}]
    assert second_prompt_len == len(tok.encode_chat(messages))


# ---------------------------------------------------------------- the loop, on a tiny real Llama

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny(max_position_embeddings=16)).eval()


def test_prompt_longer_than_the_context_names_both_lengths(tiny):
    with pytest.raises(ValueError, match=r"20 tokens.*context is 16"):
        generate(tiny, list(range(20)), SamplingParams(), eos_token_id=0)
    with pytest.raises(ValueError, match="empty"):
        generate(tiny, [], SamplingParams(), eos_token_id=0)


def test_a_full_context_ends_with_length(tiny):
    out = generate(tiny, list(range(1, 13)), SamplingParams(max_tokens=100, ignore_eos=True, seed=0), eos_token_id=0)
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 16


def test_a_seeded_request_repeats_whatever_ran_in_between(tiny):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    first = generate(tiny, [1, 2, 3], params, eos_token_id=0).token_ids
    generate(tiny, [4, 5], SamplingParams(temperature=1.0, max_tokens=8), eos_token_id=0)  # unseeded, in between
    assert generate(tiny, [1, 2, 3], params, eos_token_id=0).token_ids == first


def test_the_cache_timing_runs_the_same_reply_both_ways(capsys):
    """`bench model --with-cache`'s measurement (section 6), on the tiny model: both paths give the same reply,
    every round runs both, and the positions are counted as the chapter counts them (the times are not checked)."""
    from nanoserve.bench.model import cache_or_not
    from tests.tiny_model import tiny_llama

    cache_or_not(tiny_llama(), list(range(3, 41)), 32, rounds=2)
    out = capsys.readouterr().out
    assert "identical replies: True" in out and out.count("  round ") == 2
    assert "token positions computed: 1,712 without the cache, 69 with it (24.8× fewer)" in out


# ---------------------------------------------------------------- greedy parity with transformers

PROMPTS = [
    "Tell me a short story about a robot.",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain what a CPU does in one sentence.",
    "你好！请介绍一下你自己。",
]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers_generate(smollm2, hf_model, tok, prompt):
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    ours = generate(smollm2, ids, SamplingParams(temperature=0, max_tokens=32), tok.eos_token_id, tok)
    with torch.inference_mode():
        hf = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=32, do_sample=False, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.eos_token_id)
    hf_new = hf[0, len(ids):].tolist()
    if tok.eos_token_id in hf_new:  # transformers pads after EOS; we stop there
        hf_new = hf_new[: hf_new.index(tok.eos_token_id) + 1]
    assert ours.token_ids == hf_new
    assert ours.finish_reason == ("stop" if hf_new[-1] == tok.eos_token_id else "length")
