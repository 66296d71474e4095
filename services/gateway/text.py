"""Turning token ids back into text for clients: incremental detokenization and
stop sequences (the stop text itself is never sent, as in the OpenAI API)."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the newly decodable text (may be empty while a
        multi-byte character is incomplete)."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta

    def finish(self) -> str:
        """At the end, whatever is left, undecodable bytes included (as U+FFFD)."""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        delta, self.text = text[len(self.text):], text
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
