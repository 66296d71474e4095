"""Tenants at the gateway: who a bearer key belongs to, which models it may use, its rate
limits (decided by libs.planning.ratelimit) and its usage (Prometheus, and the registry in
batches).

Keys from LAYERCAST_API_KEYS ("static" keys) are checked here without the registry: every
model, no limits, usage accounted under "static". Other keys are looked up in the registry by
their SHA-256 and cached for `cache_s`, so a request costs no NATS round trip and a revocation
takes effect within that time (at once on the gateway that revoked it). Rate-limit windows are
kept in this process: with several gateways each one enforces the limits on its own share.
"""

import hashlib
import logging
import math
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass

from faststream.nats import NatsBroker
from prometheus_client import Counter

from libs.bus.broker import RemoteError, call
from libs.planning.ratelimit import Decision, Limits, Window, admit, format_reset, settle
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway.errors import APIError, invalid_key, missing_key

log = logging.getLogger(__name__)

SECRET_PREFIX = "sk-lc-"  # every registry key starts so; other tokens are refused without a lookup
MAX_CACHED = 10_000  # cached lookups (unknown keys too, so guessing costs the registry nothing)

USAGE_TOKENS = Counter("layercast_gateway_usage_tokens_total", "Tokens used per API key (its name) and model",
                       ["key", "model", "kind"])
USAGE_REQUESTS = Counter("layercast_gateway_usage_requests_total",
                         "Generation requests per API key (its name) and model", ["key", "model"])
RATE_LIMITED = Counter("layercast_gateway_rate_limited_total", "Requests refused by a key's rate limit",
                       ["key", "limit"])


@dataclass(frozen=True)
class Caller:
    key_id: str
    name: str  # in metrics and usage reports: never the secret
    models: frozenset[str] | None  # None: every model
    limits: Limits

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


STATIC = Caller(m.STATIC_KEY_ID, m.STATIC_KEY_ID, None, Limits())


def new_secret() -> tuple[str, str]:
    """A new key's secret and its SHA-256 (hex), the only form the registry stores."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    return secret, digest(secret)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _caller(info: m.ApiKeyInfo) -> Caller:
    return Caller(info.key_id, info.name, None if info.models is None else frozenset(info.models),
                  Limits(info.requests_per_minute, info.tokens_per_minute))


def _headers(limits: Limits, d: Decision) -> dict[str, str]:
    """The x-ratelimit-* headers of the limits a key has (OpenAI's names and duration format)."""
    headers = {}
    for kind, limit, remaining, reset in (("requests", limits.requests_per_minute, d.remaining_requests,
                                           d.reset_requests_s),
                                          ("tokens", limits.tokens_per_minute, d.remaining_tokens, d.reset_tokens_s)):
        if limit is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = format_reset(reset)
    return headers


def _no_usage() -> list[int]:
    return [0, 0, 0]  # requests, prompt tokens, completion tokens


class Ticket:
    """An admitted generation request: `finish` it once with what it used."""

    def __init__(self, tenants: "Tenants", caller: Caller, model: str, admitted_at: float, estimate: int,
                 headers: dict[str, str]):
        self.tenants, self.caller, self.model = tenants, caller, model
        self.admitted_at, self.estimate, self.headers = admitted_at, estimate, headers
        self.finished = False

    def finish(self, prompt_tokens: int = 0, completion_tokens: int = 0, accounted: bool = True) -> None:
        """Settle the estimate with the tokens used and account them (`accounted`: False when
        nothing was generated, e.g. no instance took the request)."""
        if self.finished:
            return
        self.finished = True
        self.tenants.settle(self, prompt_tokens + completion_tokens)
        if accounted:
            self.tenants.account(self.caller, self.model, prompt_tokens, completion_tokens)


class Tenants:
    def __init__(self, broker: NatsBroker, static_keys: list[str], cache_s: float = 5.0):
        self.broker, self.static_keys, self.cache_s = broker, static_keys, cache_s
        self._cache: dict[str, tuple[Caller | None, float]] = {}  # key hash -> (caller or unknown, until)
        self._windows: dict[str, Window] = {}  # key id -> its rate-limit window
        self._pending: dict[tuple[str, str], list[int]] = defaultdict(_no_usage)  # not yet recorded

    # --- who is calling -------------------------------------------------------------------------------
    async def authenticate(self, token: str | None) -> Caller:
        if token is None:
            raise missing_key("API")
        if any(secrets.compare_digest(token, k) for k in self.static_keys):
            return STATIC
        if not token.startswith(SECRET_PREFIX):
            raise invalid_key("API")
        key_hash, now = digest(token), time.monotonic()
        cached = self._cache.get(key_hash)
        if cached is None or cached[1] <= now:
            cached = (await self._lookup(key_hash), now + self.cache_s)
            if len(self._cache) >= MAX_CACHED:
                self._cache = {h: c for h, c in self._cache.items() if c[1] > now}
                if len(self._cache) >= MAX_CACHED:
                    self._cache.clear()
            self._cache[key_hash] = cached
        if cached[0] is None:
            raise invalid_key("API")
        return cached[0]

    async def _lookup(self, key_hash: str) -> Caller | None:
        try:
            info = await call(self.broker, subjects.REGISTRY_KEY_LOOKUP, m.LookupApiKey(key_hash=key_hash),
                              m.ApiKeyInfo, timeout=2.0)
        except RemoteError as e:
            if e.code == "not_found":
                return None
            raise APIError(503, f"cannot check the API key: {e.error}", retry_after=2) from e
        except TimeoutError as e:
            raise APIError(503, "cannot check the API key: the registry is not answering", retry_after=2) from e
        return _caller(info)

    def forget(self, key_id: str) -> None:
        """A key revoked through this gateway: refused from its next request on."""
        self._cache = {h: c for h, c in self._cache.items() if c[0] is None or c[0].key_id != key_id}
        self._windows.pop(key_id, None)

    # --- rate limits ----------------------------------------------------------------------------------
    def admit(self, caller: Caller, model: str, tokens: int) -> Ticket:
        """Admit a request that may use `tokens` (prompt + max_tokens) or raise the 429."""
        now = time.monotonic()
        if caller.limits.unlimited:
            return Ticket(self, caller, model, now, tokens, {})
        d, window = admit(caller.limits, self._windows.get(caller.key_id, Window()), now, tokens)
        self._windows[caller.key_id] = window
        headers = _headers(caller.limits, d)
        if d.admitted:
            return Ticket(self, caller, model, now, tokens, headers)
        RATE_LIMITED.labels(caller.name, d.refused_by).inc()
        if d.too_large:
            message = (f"Request too large for key '{caller.name}' on tokens per min (TPM): Limit "
                       f"{caller.limits.tokens_per_minute}, Requested {tokens} (the prompt's tokens and max_tokens). "
                       "Lower max_tokens or shorten the prompt.")
        else:
            which = "requests per min (RPM)" if d.refused_by == "requests" else "tokens per min (TPM)"
            limit = caller.limits.requests_per_minute if d.refused_by == "requests" else caller.limits.tokens_per_minute
            message = (f"Rate limit reached for key '{caller.name}' on {which}: Limit {limit}. "
                       f"Please try again in {format_reset(d.retry_after_s)}.")
        raise APIError(429, message, code="rate_limit_exceeded", type=d.refused_by,
                       retry_after=math.ceil(d.retry_after_s), headers=headers)

    def settle(self, ticket: Ticket, used: int) -> None:
        window = self._windows.get(ticket.caller.key_id)
        if window is not None:
            self._windows[ticket.caller.key_id] = settle(window, ticket.admitted_at, ticket.estimate, used)

    # --- usage ------------------------------------------------------------------------------------------
    def account(self, caller: Caller, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        USAGE_REQUESTS.labels(caller.name, model).inc()
        USAGE_TOKENS.labels(caller.name, model, "prompt").inc(prompt_tokens)
        USAGE_TOKENS.labels(caller.name, model, "completion").inc(completion_tokens)
        counts = self._pending[(caller.key_id, model)]
        counts[0] += 1
        counts[1] += prompt_tokens
        counts[2] += completion_tokens

    async def flush(self, timeout: float = 5.0) -> None:
        """Send the usage counted since the last flush to the registry (kept for the next one if
        it fails: counted at least once)."""
        if not self._pending:
            return
        batch, self._pending = self._pending, defaultdict(_no_usage)
        entries = [m.UsageEntry(key_id=key_id, model=model, requests=r, prompt_tokens=p, completion_tokens=c)
                   for (key_id, model), (r, p, c) in batch.items()]
        try:
            await call(self.broker, subjects.REGISTRY_USAGE_RECORD, m.RecordUsage(entries=entries), m.UsageRecorded,
                       timeout=timeout)
        except BaseException:
            for k, counts in batch.items():
                self._pending[k] = [a + b for a, b in zip(self._pending[k], counts)]
            raise
