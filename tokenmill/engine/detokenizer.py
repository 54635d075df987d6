"""Incremental detokenization of one request's output, with stop strings.

Owns `IncrementalDetokenizer`, which turns output tokens, as they arrive one or several at a time,
into text deltas, and `DetokenizerUpdate`, what one call hands back.

Decoding. Only a bounded window of tokens is decoded per call: up to `CONTEXT_TOKENS` already-emitted
tokens (whose text, the prefix text, is known) plus the new ones; the new text is what the window's
text adds to the prefix text. The context keeps decoders that treat the first token specially
(SentencePiece drops its leading space) right, and is seeded from the prompt's last tokens, so the
output reads as the continuation of the prompt. While the window's text ends with U+FFFD (a UTF-8
character split across tokens, not yet complete) only the text before it is passed on; the rest waits
for the tokens that complete it, or for `flush()`, which emits whatever decoding gives. Once more than
`MAX_PENDING_TOKENS` tokens wait, the window moves up to the last token boundary where the text is
clean; if there is none among the last 3 tokens, the bytes are invalid UTF-8 and are emitted as decoded.

Stop strings. The decoded text goes through a second stage that finds stop strings across token
boundaries. Of several stop strings the one that completes first wins (ties: the one starting
first), so the result does not depend on how tokens are grouped. The output ends right before the
stop string (or right after it, with `include_stop_str_in_output`); anything after is dropped. Text
that might be the start of a stop string (the longest tail of the text that is a proper prefix of one,
so at most the longest stop string's length - 1 characters) is held back until the next call decides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.errors import ParamError
from tokenmill.text.tokenizer import Tokenizer

CONTEXT_TOKENS = 4  # emitted tokens decoded again as the window's context
MAX_PENDING_TOKENS = 8  # pending tokens before the window is shrunk (see _reanchor)
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerUpdate:
    text_delta: str  # text for the user since the last update; a stop string only with include_stop_str_in_output
    stop_string: str | None  # the stop string that matched in this update: the request finishes with "stop"


class IncrementalDetokenizer:
    """One request's output tokens -> text deltas. Feed tokens with `add_tokens`; when the request
    ends for another reason than a stop string (EOS, length, abort), `flush()` returns the rest."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            raise ParamError("stop", "stop: expected a tuple of strings, got a single string")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ParamError(f"stop[{i}]", f"stop[{i}]: stop strings must be non-empty strings, got {s!r}")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # window = context tokens (text emitted, or the prompt's) + pending tokens (text not yet passed on)
        self._window: list[int] = []
        self._num_context = 0
        self._prefix_text = ""  # decoded text of the context tokens
        self._sent = 0  # characters of the window's text beyond the prefix text already passed on
        self._set_context(self._kept(prompt_token_ids)[-CONTEXT_TOKENS:])
        self._held = ""  # decoded text held back: it may be the start of a stop string
        self._incomplete = False  # the pending tokens end inside a character (its bytes not all here)
        self._pieces: list[str] = []
        self._finished = False
        self._num_tokens = 0  # tokens given to add_tokens
        self._num_settled = 0  # of those, the leading ones whose text has all been passed on

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def num_settled_tokens(self) -> int:
        """How many of the tokens added so far have had all their text passed on (and no text of a
        later token is needed to finish theirs): a stream sends a token's logprob only then."""
        return self._num_settled

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `flush()` was called; no more tokens are accepted."""
        return self._finished

    def add_tokens(self, token_ids: Sequence[int], check_stop: bool = True) -> DetokenizerUpdate:
        """Append newly generated tokens (one, or several at once) and return the text they add.
        With `check_stop` False (before `min_tokens`), stop strings are neither matched nor held."""
        if self._finished:
            raise RuntimeError("add_tokens: this request's output is finished (stop string matched or flush() called)")
        self._window.extend(self._kept(token_ids))
        self._num_tokens += len(token_ids)
        delta, stop_string = self._scan(self._take_decoded(final=False), final=False, check_stop=check_stop)
        if self._finished or (not self._held and not self._incomplete):
            self._num_settled = self._num_tokens
        return DetokenizerUpdate(text_delta=delta, stop_string=stop_string)

    def flush(self) -> str:
        """The text still held back (an undecided stop-string prefix, an incomplete character as
        decoding gives it). Finishes the output; calling it again returns ''."""
        if self._finished:
            return ""
        delta, _ = self._scan(self._take_decoded(final=True), final=True)
        self._finished = True
        self._num_settled = self._num_tokens
        return delta

    def _kept(self, token_ids: Sequence[int]) -> list[int]:
        """The ids that produce text: special tokens go when they are skipped anyway."""
        if not self.skip_special_tokens:
            return list(token_ids)
        special = self.tokenizer.info.all_special_ids
        return [t for t in token_ids if t not in special]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _set_context(self, context: list[int]) -> None:
        """Start a new window whose context is `context`, whose text is all passed on."""
        text = self._decode(context)
        if text.endswith(REPLACEMENT_CHAR):  # not a clean prefix: later bytes could rewrite its end
            context, text = [], ""
        self._window = context
        self._num_context = len(context)
        self._prefix_text = text
        self._sent = 0

    def _take_decoded(self, final: bool) -> str:
        """New decoded text of the pending tokens, up to any incomplete character at the end."""
        pending = len(self._window) - self._num_context
        if pending == 0:
            return ""
        text = self._decode(self._window)
        start = len(self._prefix_text) + self._sent
        self._incomplete = not final and text.endswith(REPLACEMENT_CHAR)
        if final or not text.endswith(REPLACEMENT_CHAR):
            self._set_context(self._window[-CONTEXT_TOKENS:])
            return text[start:]
        fresh = text.rstrip(REPLACEMENT_CHAR)[start:]
        self._sent += len(fresh)
        if pending > MAX_PENDING_TOKENS and not self._reanchor():
            # no clean token boundary among the last tokens: invalid UTF-8, passed on as decoded
            self._set_context(self._window[-CONTEXT_TOKENS:])
            self._incomplete = False
            return text[start:]
        return fresh

    def _reanchor(self) -> bool:
        """Shrink a window whose text keeps ending with an incomplete character: the context moves up
        to the last token boundary where the text is clean. In valid UTF-8 the incomplete character
        (at most 3 bytes) starts in one of the last 3 tokens. False if there is no such boundary."""
        end = len(self._window)
        for j in range(end - 1, max(self._num_context, end - 4), -1):
            context = self._window[max(0, j - CONTEXT_TOKENS) : j]
            prefix_text = self._decode(context)
            if not prefix_text.endswith(REPLACEMENT_CHAR):
                self._window = context + self._window[j:]
                self._num_context = len(context)
                self._prefix_text = prefix_text
                # what was passed on ends where the window's text now ends, before the incomplete character
                self._sent = len(self._decode(self._window).rstrip(REPLACEMENT_CHAR)) - len(prefix_text)
                return True
        return False

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match in `text` that ends first (ties: starts first), if any."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _scan(self, fresh: str, final: bool, check_stop: bool = True) -> tuple[str, str | None]:
        """Pass decoded text through the stop-string stage: (text to emit, matched stop string)."""
        text = self._held + fresh
        match = self._find_stop(text) if check_stop else None
        if match is not None:
            start, stop_string = match
            end = start + len(stop_string) if self.include_stop_str_in_output else start
            delta = text[:end]
            self._held = ""
            self._finished = True
        else:
            stop_string = None
            hold = 0 if final or not check_stop else self._partial_stop_len(text)
            delta, self._held = text[: len(text) - hold], text[len(text) - hold :]
        if delta:
            self._pieces.append(delta)
        return delta, stop_string
