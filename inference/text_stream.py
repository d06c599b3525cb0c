"""Token ids to text, piece by piece as a reply streams, with stop strings checked on the text: `TextStream.push`
returns the text that is final (a trailing U+FFFD and any tail that starts a stop string wait); at a stop string
the text ends before it and `stopped` is set. `token_count` is the reply's length for `usage`."""

from __future__ import annotations

from typing import Sequence

from medusa_jax.text import decode_tokens


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text handed out
        self.stopped = False
        self._stop_tokens = 0  # after a stop string: the tokens up to the one that completed it

    def push(self, tokens: Sequence[int]) -> str:
        """The new text that is final after these tokens ('' if none)."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        text = decode_tokens(self.tokenizer, self.ids)
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            self._stop_tokens = self._tokens_through(min(found), text)
            return self._take(text, min(found))
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)
        for s in self.stop:  # a tail that may become a stop string waits
            for n in range(min(len(s) - 1, end), 0, -1):
                if text[:end].endswith(s[:n]):
                    end = min(end, len(text[:end]) - n)
                    break
        return self._take(text, end)

    @property
    def token_count(self) -> int:
        """Tokens of the reply the text stands for: all pushed, or after a stop string those up to its end."""
        return self._stop_tokens if self.stopped else len(self.ids)

    def _tokens_through(self, at: int, text: str) -> int:
        """The fewest leading ids whose text holds the stop string found at character `at` (bisection: a longer
        prefix's text extends a shorter one's)."""
        end = at + min(len(s) for s in self.stop if text.startswith(s, at))
        low, high = 1, len(self.ids)
        while low < high:
            mid = (low + high) // 2
            if len(decode_tokens(self.tokenizer, self.ids[:mid]).rstrip("\ufffd")) >= end:
                high = mid
            else:
                low = mid + 1
        return low

    def finish(self) -> str:
        """The rest of the text once the reply has ended (without a stop string)."""
        if self.stopped:
            return ""
        return self._take(decode_tokens(self.tokenizer, self.ids), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent: end], end
        return piece
