"""A bounded load on a cluster's gateway for the fault suite: a few client threads sending
streaming and non-streaming chat completions back to back, and a watcher of `/v1/models`.
Every request is recorded (when it was sent and ended, how it ended), so each fault's figures
come from the records of its window."""

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


@dataclass
class Sent:
    stream: bool
    start: float  # time.monotonic()
    end: float | None = None
    outcome: str = ""  # "ok" | "http <status> <code>" | "transport <error>" | "cut" (a stream that began and broke)
    chunks: int = 0
    # A stream's: the instance the gateway sent it to (its x-layercast-instance header), the
    # tokens received so far (a chunk each, the role chunk aside), set at its first token.
    instance: str | None = None
    tokens: int = 0
    generating: threading.Event = field(default_factory=threading.Event)

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def ended(self) -> bool:
        return self.end is not None


class Load:
    def __init__(self, gateway_url: str, api_key: str, model: str, clients: int = 3, streaming: int = 1,
                 max_tokens: int = 8, stream_tokens: int = 24):
        self.url, self.model = gateway_url, model
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.records: list[Sent] = []
        self.listing: list[tuple[float, bool | None]] = []  # (when, model listed; None: gateway unreachable)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i < streaming,), daemon=True,
                                          name=f"load-{i}") for i in range(clients)]
        self._threads.append(threading.Thread(target=self._watch_models, daemon=True, name="load-models"))
        self.max_tokens, self.stream_tokens = max_tokens, stream_tokens

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def streams(self) -> list[Sent]:
        """The streamed requests' records so far, in the order they were sent."""
        with self._lock:
            return [r for r in self.records if r.stream]

    def body(self, stream: bool) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": "Tell me about faults."}],
                "max_tokens": self.stream_tokens if stream else self.max_tokens, "temperature": 0,
                "stream": stream}

    def _client(self, stream: bool) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=httpx.Timeout(90, connect=2)) as http:
            while not self._stop.is_set():
                rec = Sent(stream, time.monotonic())
                with self._lock:
                    self.records.append(rec)
                try:
                    rec.outcome = self._stream(http, rec) if stream else self._plain(http)
                except httpx.TransportError as e:
                    rec.outcome = "cut" if rec.chunks else f"transport {type(e).__name__}"
                rec.end = time.monotonic()
                if not rec.ok:
                    time.sleep(0.2)  # as a client backs off; a refused connection is not a busy loop

    def _plain(self, http: httpx.Client) -> str:
        r = http.post("/v1/chat/completions", json=self.body(False))
        if r.status_code != 200:
            return _http_error(r)
        finish = r.json()["choices"][0]["finish_reason"]
        return "ok" if finish in ("stop", "length") else f"finish {finish}"

    def _stream(self, http: httpx.Client, rec: Sent) -> str:
        with http.stream("POST", "/v1/chat/completions", json=self.body(True)) as r:
            if r.status_code != 200:
                r.read()
                return _http_error(r)
            rec.instance = r.headers.get("x-layercast-instance")
            finish = None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return "ok" if finish in ("stop", "length") else f"finish {finish}"
                chunk = json.loads(data)
                if "error" in chunk:
                    return f"stream error {chunk['error'].get('code')}"
                rec.chunks += 1
                if "role" not in chunk["choices"][0]["delta"]:  # the gateway sends a chunk per token after it
                    rec.tokens += 1
                    rec.generating.set()
                finish = chunk["choices"][0].get("finish_reason") or finish
            return "cut"

    def _watch_models(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=httpx.Timeout(5, connect=1)) as http:
            while not self._stop.is_set():
                try:
                    r = http.get("/v1/models")
                    listed = r.status_code == 200 and self.model in [m["id"] for m in r.json()["data"]]
                    # A gateway starting answers 503 (it has not read the registry): not "unlisted".
                    seen = listed if r.status_code != 503 else None
                except httpx.TransportError:
                    seen = None
                with self._lock:
                    self.listing.append((time.monotonic(), seen))
                self._stop.wait(0.2)

    def window(self, start: float, end: float) -> list[Sent]:
        """The requests in flight at some moment of [start, end)."""
        with self._lock:
            return [r for r in self.records if r.start < end and (r.end is None or r.end >= start)]

    def wait_ended(self, records: list[Sent], timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while any(r.end is None for r in records) and time.monotonic() < deadline:
            time.sleep(0.05)

    def first_success_after(self, t: float) -> float | None:
        """Seconds from `t` to the end of the first request sent after `t` that succeeded."""
        with self._lock:
            ends = [r.end for r in self.records if r.start >= t and r.ok and r.end is not None]
        return min(ends) - t if ends else None

    def unlisted(self, start: float, end: float) -> int:
        """How many times the gateway answered /v1/models without the model in [start, end)."""
        with self._lock:
            return sum(1 for when, seen in self.listing if start <= when < end and seen is False)


def _http_error(r: httpx.Response) -> str:
    try:
        code = r.json()["error"]["code"]
    except Exception:
        code = "?"
    retry = " retry-after" if "retry-after" in r.headers else ""
    return f"http {r.status_code} {code}{retry}"


def measure(load: Load, name: str, kill: Callable[[], None], before_s: float = 1.0, after_s: float = 0.5,
            recovery_timeout_s: float = 30.0, at_first_success: Callable[[], dict] | None = None) -> dict:
    """Run the load `before_s`, `kill()`, wait for a request sent after the kill to succeed, run
    `after_s` more; the figures of that window (every request sent in it, once ended), and those
    `at_first_success()` returns when that success is seen."""
    start = time.monotonic()
    time.sleep(before_s)
    killed_at = time.monotonic()
    kill()
    deadline = killed_at + recovery_timeout_s
    while (first := load.first_success_after(killed_at)) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no request succeeded within {recovery_timeout_s}s of killing {name}")
        time.sleep(0.05)
    extra = at_first_success() if at_first_success is not None else {}
    time.sleep(after_s)
    end = time.monotonic()
    sent = load.window(start, end)
    load.wait_ended(sent)
    outcomes = [r.outcome for r in sent]
    return {
        "fault": name, "sent": len(sent), "succeeded": outcomes.count("ok"),
        "failed": sum(1 for o in outcomes if o not in ("ok", "cut") and not o.startswith("transport")),
        "connection_errors": sum(1 for o in outcomes if o.startswith("transport")),
        "streams_cut": outcomes.count("cut"),
        "first_success_s": round(first, 3),
        "unlisted": load.unlisted(start, end),
        "errors": sorted({o for o in outcomes if o != "ok"}),
        **extra,
    }


def assert_nothing_lost(figures: dict, first_within_s: float) -> None:
    assert figures["failed"] == 0 and figures["connection_errors"] == 0 and figures["streams_cut"] == 0, figures
    assert figures["first_success_s"] <= first_within_s, figures
    assert figures["unlisted"] == 0, figures


def report_figures(config, figures: list[dict], prefix: str = "fault ") -> None:
    """One JSON line per fault on the terminal (CI's log), whatever pytest captures; also printed
    (a failing test's report shows it)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    for line in figures:
        text = prefix + json.dumps(line)
        print(text)
        if capture is None:
            continue
        with capture.global_and_fixture_disabled():  # past the capture of the test's output
            if hasattr(config, "workerinput"):
                # A pytest-xdist worker (`make test`): its terminal is not CI's log, its stderr is.
                os.write(2, (text + "\n").encode())
            elif reporter is not None:
                reporter.ensure_newline()
                reporter.write_line(text)
