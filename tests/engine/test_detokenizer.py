"""Tokenizer wrapper and incremental detokenizer: UTF-8 across tokens, stop strings, special tokens,
chat template, bounded decode windows."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from tokenmill.engine.detokenizer import CONTEXT_TOKENS, MAX_PENDING_TOKENS, DetokenizerUpdate, IncrementalDetokenizer
from tokenmill.text.tokenizer import Tokenizer
from tokenmill.tools.make_model import make_model

TEXTS = [
    "naïve café → 日本語 🎉 emoji",
    'def f(x):\n    return {"ключ": x ** 2}  # 注释 ✓\n',
    "🎉👨\u200d👩\u200d👧 e\u0301 and plain ascii, then ½ ≠ ∞",
    "plain ascii text, nothing special.",
]
CHATML = "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("llama", "tiny", tmp_path_factory.mktemp("detok-llama"), seed=1)


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer(folder)


def groups_of(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """`ids` one at a time (rng None) or in random-sized groups of 1..5."""
    if rng is None:
        return [[i] for i in ids]
    out: list[list[int]] = []
    pos = 0
    while pos < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[pos : pos + n])
        pos += n
    return out


def stream(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None
) -> tuple[list[DetokenizerUpdate], str]:
    """Feed `ids` until a stop string matches; (updates, flush text)."""
    updates: list[DetokenizerUpdate] = []
    for group in groups_of(ids, rng):
        updates.append(detok.add_tokens(group))
        if updates[-1].stop_string is not None:
            break
    return updates, detok.flush()


def run_stop(tok: Tokenizer, text: str, stop: tuple[str, ...], include: bool = False, seed: int | None = None) -> str:
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    updates, rest = stream(
        detok, tok.encode(text, add_special_tokens=False), None if seed is None else random.Random(seed)
    )
    assert "".join(u.text_delta for u in updates) + rest == detok.output_text
    return detok.output_text


# --- round trip and UTF-8 across tokens ----------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_round_trip(tok: Tokenizer, text: str, seed: int | None) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "say it"}])
    for prompt_ids in ([], prompt):
        detok = IncrementalDetokenizer(tok, prompt_ids)
        updates, rest = stream(detok, ids, None if seed is None else random.Random(seed))
        deltas = [u.text_delta for u in updates]
        assert "".join(deltas) + rest == tok.decode(ids) == text
        assert detok.output_text == text
        assert not any("\ufffd" in d for d in deltas)
        assert rest == ""  # valid text: nothing is left over for flush
        assert all(u.stop_string is None for u in updates)


def test_character_split_across_tokens_is_held_until_complete(tok: Tokenizer) -> None:
    split = [c for text in TEXTS for c in text if len(tok.encode(c, add_special_tokens=False)) >= 2]
    assert split, "no character of the test texts is split across tokens: the UTF-8 path is not exercised"
    for c in split:
        ids = tok.encode(c, add_special_tokens=False)
        assert all("\ufffd" in tok.decode([i]) for i in ids), f"{c!r}: every piece alone is an incomplete character"
        detok = IncrementalDetokenizer(tok, [])
        deltas = [detok.add_tokens([i]).text_delta for i in ids]
        assert deltas == [""] * (len(ids) - 1) + [c]
    assert max(len(tok.encode(c, add_special_tokens=False)) for c in split) >= 3  # e.g. a CJK character, 3 bytes


def test_text_before_an_incomplete_character_is_not_delayed(tok: Tokenizer) -> None:
    head = tok.encode("ab ", add_special_tokens=False)
    tail = tok.encode("日", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    update = detok.add_tokens(head + tail[:1])  # one call: complete text, then the first byte of 日
    assert update.text_delta == "ab "
    assert [detok.add_tokens([i]).text_delta for i in tail[1:]] == [""] * (len(tail) - 2) + ["日"]


@pytest.mark.parametrize("group", [4, 5, 7, 8])
def test_groups_ending_mid_character(tok: Tokenizer, group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group ends inside a character for several calls in a row: the window must shrink
    (past MAX_PENDING_TOKENS) without emitting a replacement character."""
    text = "日本語" * 6
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 3 * len(text)  # each character is three one-byte tokens
    sizes: list[int] = []
    decode = tok.decode

    def recording(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        sizes.append(len(ids))
        return decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", recording)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_tokens(ids[i : i + group]).text_delta for i in range(0, len(ids), group)]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert max(sizes) <= CONTEXT_TOKENS + MAX_PENDING_TOKENS + group


def test_invalid_utf8_is_emitted_as_decoded(tok: Tokenizer) -> None:
    lead = tok.hf.convert_tokens_to_ids("æ")  # byte 0xE6 alone: the lead byte of a 3-byte character
    assert isinstance(lead, int)
    ids = [lead] * 3 * MAX_PENDING_TOKENS + tok.encode(" ok", add_special_tokens=False) + [lead]
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_tokens([i]).text_delta for i in ids]
    assert "".join(deltas[: 2 * MAX_PENDING_TOKENS]), "an endless incomplete character must not stall the stream"
    rest = detok.flush()
    assert rest == "\ufffd"
    assert "".join(deltas) + rest == tok.decode(ids)


def test_decode_window_is_bounded(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    decode = tok.decode

    def recording(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        sizes.append(len(ids))
        return decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", recording)
    ids = tok.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    assert len(ids) > 300
    detok = IncrementalDetokenizer(tok, list(range(5, 500)), stop=("never appears",))
    for i in ids:
        detok.add_tokens([i])
    detok.flush()
    assert max(sizes) <= CONTEXT_TOKENS + 4  # context + at most one character's bytes pending
    assert len(sizes) <= 2 * len(ids) + 2


# --- stop strings --------------------------------------------------------------------------------


def test_stop_string_split_across_tokens(tok: Tokenizer) -> None:
    text, stop = "hello world", "lo wor"  # tokens 'hel' 'lo' ' w' 'or' 'ld': the stop spans three, ends mid-token
    pieces = [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]
    assert not any(stop in p for p in pieces)
    detok = IncrementalDetokenizer(tok, [], stop=(stop,))
    updates, rest = stream(detok, tok.encode(text, add_special_tokens=False))
    assert updates[-1].stop_string == stop
    assert all(u.stop_string is None for u in updates[:-1])
    assert detok.output_text == "hel"  # right before the stop string; 'ld' after it, in the same token, is gone
    assert not any(stop[:2] in u.text_delta for u in updates)  # the stop string's start was held, never emitted
    assert rest == ""
    assert detok.finished
    with pytest.raises(RuntimeError, match="finished"):
        detok.add_tokens([5])


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
def test_stop_string_any_grouping(tok: Tokenizer, seed: int | None) -> None:
    text = "Hello world, stop here please"
    assert run_stop(tok, text, ("stop here",), seed=seed) == "Hello world, "
    assert run_stop(tok, text, ("stop here",), include=True, seed=seed) == "Hello world, stop here"
    assert run_stop(tok, TEXTS[0], ("本語",), seed=seed) == "naïve café → 日"  # within split characters
    assert run_stop(tok, TEXTS[0], ("本語",), include=True, seed=seed) == "naïve café → 日本語"


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    assert run_stop(tok, "hello world", ("world", "lo w")) == "hel"
    assert run_stop(tok, "hello world", ("lo w", "world")) == "hel"
    # the one that completes first wins, whatever the tokens' grouping: 'bc' ends before 'abcd'
    for seed in (None, 0, 1):
        assert run_stop(tok, "xabcdx", ("abcd", "bc"), seed=seed) == "xa"
        assert run_stop(tok, "xabcdx", ("abcd", "bc"), include=True, seed=seed) == "xabc"


def test_stop_string_at_the_very_start(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    updates, rest = stream(detok, tok.encode("STOP and more", add_special_tokens=False))
    assert updates[-1].stop_string == "STOP"
    assert [u.text_delta for u in updates] == ["", ""]  # 'ST', then 'OP'
    assert rest == "" and detok.output_text == ""
    assert run_stop(tok, "STOP and more", ("STOP",), include=True) == "STOP"


def test_partial_stop_prefix_is_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("the end.",))
    updates = [detok.add_tokens([i]) for i in tok.encode("so the end", add_special_tokens=False)]
    assert all(u.stop_string is None for u in updates)
    assert detok.output_text == "so "  # 'the end' could still become the stop string
    assert detok.flush() == "the end"
    assert detok.output_text == "so the end"
    assert detok.flush() == ""
    # a prefix that later stops being one is released by add_tokens itself
    detok = IncrementalDetokenizer(tok, [], stop=("the end.",))
    updates, rest = stream(detok, tok.encode("so the end, really", add_special_tokens=False))
    assert "".join(u.text_delta for u in updates) == "so the end, really" and rest == ""


def test_bad_stop_strings(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        IncrementalDetokenizer(tok, [], stop=("ok", ""))
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, [], stop="a single string")  # type: ignore[arg-type]


# --- special tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Tokenizer, skip: bool) -> None:
    bos, eos, im_end = 0, 1, 4
    ids = [bos, *tok.encode("hi 日本", add_special_tokens=False), im_end]
    ids += [*tok.encode(" there", add_special_tokens=False), eos]
    for seed in (None, 0):
        detok = IncrementalDetokenizer(tok, [3], skip_special_tokens=skip)
        updates, rest = stream(detok, ids, None if seed is None else random.Random(seed))
        expected = "hi 日本 there" if skip else "<s>hi 日本<|im_end|> there</s>"
        assert "".join(u.text_delta for u in updates) + rest == tok.decode(ids, skip_special_tokens=skip) == expected


# --- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_info(tok: Tokenizer) -> None:
    info = tok.info
    assert info.eos_token_ids == (1, 4)  # generation_config.json lists </s> and <|im_end|>
    assert info.bos_token_id == 0
    assert info.vocab_size == 4096
    assert info.all_special_ids == frozenset({0, 1, 2, 3, 4})
    assert info.has_chat_template
    assert tok.convert_ids_to_tokens([0, 4]) == ["<s>", "<|im_end|>"]
    assert tok.encode("hi")[0] == 0 and tok.encode("hi", add_special_tokens=False)[0] != 0


def test_apply_chat_template(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == tok.encode(CHATML[len("<s>") :])  # the post-processor's BOS + the rest
    assert ids[0] == tok.info.bos_token_id and ids.count(tok.info.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=False) == CHATML
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == CHATML[: -len("<|im_start|>assistant\n")]


def test_bad_messages(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"messages\[1\]: missing 'content'"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant"}])
    with pytest.raises(ValueError, match=r"messages\[0\]: 'content' must be a string"):
        tok.apply_chat_template([{"role": "user", "content": None}])  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([])


def test_folder_errors_and_fallbacks(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-such-folder"):
        Tokenizer(tmp_path / "no-such-folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty.*tokenizer\.json"):
        Tokenizer(empty)

    # tokenizer files only: EOS from the tokenizer itself, and no chat template
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder / "tokenizer.json", bare)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain = Tokenizer(bare)
    assert plain.info.eos_token_ids == (1,)
    assert not plain.info.has_chat_template
    with pytest.raises(ValueError, match=r"messages: .* no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])

    (bare / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ValueError, match=r"generation_config\.json: field 'eos_token_id'"):
        Tokenizer(bare)
    (bare / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert Tokenizer(bare).info.eos_token_ids == (7,)


def test_settled_tokens_wait_for_their_whole_text(tok: Tokenizer) -> None:
    """A token counts as settled (its logprob may be streamed) only once all its text has gone out."""
    head = tok.encode("ab ", add_special_tokens=False)
    tail = tok.encode("日", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    detok.add_tokens(head)
    assert detok.num_settled_tokens == len(head)
    for i, t in enumerate(tail[:-1]):  # the character's first bytes: no text yet
        detok.add_tokens([t])
        assert detok.num_settled_tokens == len(head), i
    detok.add_tokens(tail[-1:])
    assert detok.num_settled_tokens == len(head) + len(tail)
    # a possible stop string holds text back, and the tokens that made it
    ids = tok.encode("x = 10", add_special_tokens=False)
    held = IncrementalDetokenizer(tok, [], stop=("= 10!",))
    settled = []
    for t in ids:
        held.add_tokens([t])
        settled.append(held.num_settled_tokens)
    assert held.output_text == "x " and settled[-1] < len(ids)
    held.flush()
    assert held.num_settled_tokens == len(ids) and held.output_text == "x = 10"
