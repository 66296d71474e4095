"""Turning token ids back into text for clients: incremental detokenization and
stop sequences (the stop text itself is never sent, as in the OpenAI API)."""


class IncrementalDetokenizer:
    """Streams the text of generated ids with O(1) decoding work per token (vLLM's window).

    Only two short windows are decoded at each token: ids[prefix_offset:read_offset] (text
    already sent, decoded again as context) and ids[prefix_offset:] (the same plus the new
    ids); the new text is the difference. Context matters: some decoders (SentencePiece's)
    drop the leading space of a window's first token, and both windows drop it alike. The
    offsets move on only once the text does not end in U+FFFD, so a UTF-8 character split
    over tokens is sent whole, and every offset stays on a character boundary: the deltas
    add up to `decode(all ids)`. (A run of tokens that keeps ending in U+FFFD, invalid
    bytes, keeps the window growing until a whole character comes, as in vLLM.)"""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window (already sent)
        self._read_offset = 0  # end of what has been sent
        self._sent: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._sent)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _window(self) -> tuple[str, str]:
        """(text already sent of the window, the window's whole text)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return prefix, self._decode(self._ids[self._prefix_offset:])

    def add(self, token_id: int) -> str:
        """Append a token; return the newly decodable text (may be empty while a
        multi-byte character is incomplete)."""
        self._ids.append(token_id)
        prefix, text = self._window()
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # nothing printable yet (a special token, an incomplete character)
        delta = text[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._sent.append(delta)
        return delta

    def finish(self) -> str:
        """At the end, whatever is left, undecodable bytes included (as U+FFFD)."""
        prefix, text = self._window()
        delta = text[len(prefix):]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._sent.append(delta)
        return delta


class StopMatcher:
    """Finds stop sequences in streamed text; holds back text that may be the
    start of a stop sequence so it is never sent and then taken back."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Returns the text that is safe to send now."""
        if self.stopped:
            return ""
        buf = self._pending + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._pending = True, ""
            return buf[:cut]
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(buf)) + 1)
                    if buf.endswith(s[:k])), default=0)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of generation, whatever was held back is real text."""
        out, self._pending = self._pending, ""
        return out
