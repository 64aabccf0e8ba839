"""Token ids → text, incrementally: correct across chunk boundaries, for streaming.

A token may hold part of a multi-byte character (byte-level BPE), and some tokenizers decode a
token differently at the start of a text (SentencePiece drops a leading space). So text is never
decoded token by token: each step decodes a short window that starts a few tokens back and emits
what it adds to the text of the window's already-emitted part, holding back a trailing U+FFFD (an
incomplete character) until the next token completes it. An incomplete character is at most 3 bytes,
so only the last 3 tokens are ever held: a run of invalid bytes (a degenerate sampling loop) streams
on, and the window stays short. Special tokens that decoding skips, and ids the tokenizer has no
token for (a model vocabulary padded past the tokenizer's), never enter the window. The
concatenation of all deltas is the text of all tokens (given a `context`, the prompt they
continue: the text they add to the context's), but for invalid UTF-8: a byte-fallback decoder
(SentencePiece's) that sees a run of byte tokens whole may turn more of it into U+FFFD than the
windows, which see it in pieces, do.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

_INCOMPLETE = "\ufffd"
_MAX_HELD_TOKENS = 3  # an incomplete UTF-8 character holds at most 3 bytes, so 3 tokens
_CONTEXT_TOKENS = 4  # the prompt's last tokens a continuation's first delta is decoded after


class IncrementalDetokenizer:
    """Feeds token ids in, gets text deltas out.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens: drop special tokens (e.g. the end-of-turn token) from the text.
        context: the ids the tokens continue (a completion's prompt): the deltas are then the
            text the tokens add to the context's, so that a SentencePiece word's leading space
            survives at the start (decoded alone, " Paris" is "Paris"). Its last few tokens are
            used; none when they end in an incomplete character (their text is no prefix).
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, context: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Tokens the decode drops never reach the window: a run of them (a sampling loop on a
        # special token that is no stop token, or on a padded id) would grow it, and each push's
        # decode, without end.
        self._dropped = _skipped_special_ids(tokenizer) if skip_special_tokens else frozenset()
        # Its last few kept ids, found from the end: a long prompt is not walked whole (this runs
        # on the server's event loop, once per completion).
        ids = map(int, reversed(list(context)))
        context = list(itertools.islice(filter(self._keeps, ids), _CONTEXT_TOKENS))[::-1]
        if context and self._decode(context).endswith(_INCOMPLETE):
            context = []
        self._ids: list[int] = context
        self._prefix = 0  # the window starts here: context for the tokens after `_read`
        self._read = len(context)  # tokens before this have had their text emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that `token_ids` (appended to the earlier ones) add; may be "" while a
        character is incomplete."""
        self._ids.extend(self._kept(token_ids))
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._decode
        emitted = decode(self._ids[self._prefix : self._read])
        text = decode(self._ids[self._prefix :])
        if text.endswith(_INCOMPLETE) and not final:
            return self._before_held_tokens(emitted, text)
        if len(text) <= len(emitted):
            if final:  # nothing printable: still consume the tokens
                self._prefix = self._read = len(self._ids)
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted) :]

    def _before_held_tokens(self, emitted: str, text: str) -> str:
        """The text before the last `_MAX_HELD_TOKENS` tokens, when the window's text starts with
        it: a U+FFFD there is an invalid byte for good, not a character the next token completes."""
        cut = len(self._ids) - _MAX_HELD_TOKENS
        if cut <= self._read:
            return ""
        head = self._decode(self._ids[self._prefix : cut])
        if len(head) <= len(emitted) or not text.startswith(head):
            return ""
        self._prefix, self._read = self._read, cut
        return head[len(emitted) :]

    def _kept(self, ids: Sequence[int]) -> list[int]:
        """`ids` less those the decode drops (`_keeps`)."""
        return [i for i in map(int, ids) if self._keeps(i)]

    def _keeps(self, token_id: int) -> bool:
        """Whether the decode keeps `token_id`: not a special token it skips, nor an id the
        tokenizer has no token for (a model vocabulary padded past the tokenizer's: Qwen3's
        151936 ids hold 151669 tokens; a random target samples the padding)."""
        return (
            token_id not in self._dropped
            and self._tokenizer.convert_ids_to_tokens(token_id) is not None
        )

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


def _skipped_special_ids(tokenizer) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` removes before decoding (the tokenizer's
    special added tokens): leaving them out changes no text."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(
        i
        for i, token in added.items()
        if getattr(token, "special", False) and not tokenizer.decode([i], skip_special_tokens=True)
    )


class StopStrings:
    """Cuts streamed text before the first stop string to appear in it (OpenAI's `stop`): the
    one that ends first, and of those ending together the one that starts first. So the cut
    depends on the text alone, not on how it arrives in deltas (with stops "abcd" and "c", the
    text "abcd" is cut after "ab" whether "d" comes with the rest or later).

    Text that might be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.hit = False

    def feed(self, delta: str) -> str:
        """The part of `delta` (after anything held back) that is safe to emit; sets `hit` when a
        stop string appears (the text up to it is returned, the rest dropped)."""
        if self.hit:
            return ""
        text = self._pending + delta
        found = [(i + len(s), i) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            self.hit, self._pending = True, ""
            return text[: min(found)[1]]
        hold = max((_overlap(text, s) for s in self._stops), default=0)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The held-back text, at the end of the stream."""
        text, self._pending = self._pending, ""
        return "" if self.hit else text


def _overlap(text: str, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that `text` ends with."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
