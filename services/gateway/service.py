"""Gateway core: model table, routing, dispatch to workers over NATS, token
streams back. The HTTP layer (app.py) only translates to and from OpenAI JSON."""

import asyncio
import itertools
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram
from transformers import AutoTokenizer

from libs.checkpoint.format import CheckpointIndex
from libs.planning.sharing import sharing_setting
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import NoResponders, RemoteError, call, on_event, publish
from libs.telemetry import tracer
from services.common.runner import EndedInstances, Service
from services.gateway.errors import APIError
from services.gateway.logprobs import TokenLogprob, TokenStrings
from services.gateway.routing import ModelRoutes, Route
from services.gateway.structured import template_renders_tools
from services.gateway.text import IncrementalDetokenizer, StopMatcher
from services.gateway.workers import NatsWorkerClient, WorkerClient

log = logging.getLogger(__name__)
_tracer = tracer("gateway")

SLOW_MODEL_LOAD_S = 2.0  # a tokenizer and index read slower than this is logged as a warning
# Prompts up to this many UTF-8 bytes are tokenized on the event loop (about a millisecond):
# they never wait behind large prompts for a tokenizer thread.
INLINE_TOKENIZE_BYTES = 4096
# Templating one chat message costs about as much as tokenizing this many bytes (50 us a message,
# measured: 233,000 empty messages took 11.9 s), so many short messages are not "small".
MESSAGE_COST_BYTES = 64
# A token covers at most its longest string's bytes of input, times this for normalizers that
# compose several input characters into one (NFC makes one syllable of three Hangul jamo).
NORMALIZER_SLACK = 4

TTFT = Histogram("layercast_gateway_ttft_seconds", "Time to first token", ["model"],
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
ITL = Histogram("layercast_gateway_inter_token_seconds", "Time between streamed tokens", ["model"],
                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2))
QUEUE_DEPTH = Gauge("layercast_gateway_queue_depth", "Requests waiting for an instance slot", ["model"])
IN_FLIGHT = Gauge("layercast_gateway_in_flight_requests", "Requests dispatched to instances", ["model"])
INSTANCES = Gauge("layercast_gateway_instances", "Ready instances routed to", ["model"])
HANDOVERS = Counter("layercast_gateway_handovers_total",
                    "Requests moved to another instance mid-generation (theirs failed or stopped)", ["model"])
GENERATED = Counter("layercast_gateway_completion_tokens_total", "Completion tokens streamed", ["model"])
BUSY_REFUSALS = Counter("layercast_gateway_busy_refusals_total",
                        "Requests a shared worker refused as busy (taking them would break an SLO); "
                        "each went to another instance or waited", ["model"])
TOKENIZER_RUNS = Counter("layercast_gateway_tokenizer_runs_total",
                         "Requests' tokenizer work (chat templating, tokenizing, decoding ids) by the thread "
                         "it ran in: the event loop's (small inputs only) or a tokenizer thread", ["thread"])
RECONNECTS = Counter("layercast_gateway_nats_reconnects_total",
                     "NATS reconnections; each hands over the streams in flight (tokens may have been lost)")
UNANSWERED = Counter("layercast_gateway_unanswered_dispatches_total",
                     "Requests a worker did not accept or refuse in time (overloaded, or hung); that "
                     "attempt was cancelled there and the request went to another instance or waited",
                     ["model"])


@dataclass
class ModelEntry:
    info: m.ModelInfo
    tokenizer: object
    context_len: int
    eos_ids: list[int]
    routes: ModelRoutes
    max_prompt_bytes: int  # a longer prompt cannot fit the context, whatever it tokenizes to
    ttft_samples: list[float] = field(default_factory=list)
    # Since the last metrics report, for the load-monitor's demand (libs.planning.demand).
    tpot_samples: list[float] = field(default_factory=list)
    tokens_generated: int = 0
    queued_tokens: int = 0  # output tokens (max_tokens x n) of the requests waiting for a slot (a level)

    @cached_property
    def token_strings(self) -> TokenStrings:
        """Token ids to the strings and bytes logprobs show (made on the first request that asks)."""
        return TokenStrings(self.tokenizer)

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template writes `tools` itself (structured.py describes them if not)."""
        return template_renders_tools(self.tokenizer)


@dataclass
class GatewayConfig:
    gateway_id: str = field(default_factory=lambda: f"gw-{uuid.uuid4().hex[:8]}")
    queue_timeout_s: float = 120.0
    first_token_timeout_s: float = 120.0
    token_timeout_s: float = 60.0
    # A worker that neither takes nor refuses a request within this is passed over (that attempt
    # cancelled there); the request waits on within queue_timeout_s.
    dispatch_timeout_s: float = 5.0
    slots_per_instance: int = 32
    max_context: int = 2048
    default_max_tokens: int = 1024
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies are refused (413) unread
    # Large prompts are tokenized in these threads; half the cores leaves the rest to the event loop.
    tokenizer_threads: int = field(default_factory=lambda: max(1, (os.cpu_count() or 2) // 2))
    metrics_interval_s: float = 0.5
    resync_interval_s: float = 5.0
    # Before the first registry read (or while a model the registry lists is still loading) a
    # model request is answered 503 with this Retry-After, never 404: a client retries a 503
    # (the openai client twice, honouring Retry-After) but takes a 404 as final.
    not_ready_retry_after_s: float = 2.0
    # A request that arrives before that first read waits this long for it before that 503: a
    # restarted gateway reads the registry within a second or two, and a request held that long
    # spends none of its client's retries (which connection errors during the restart may have used).
    first_sync_wait_s: float = 5.0
    key_cache_s: float = 5.0  # how long a registry key's lookup is trusted (a revocation's delay)
    usage_flush_s: float = 1.0  # usage is recorded in the registry this often
    max_n: int = 8  # choices per request at most (each takes a KV slot)
    # Refused (400) before validating or templating, work proportional to the count: chat messages
    # per request (each content part, tool call and tool counted as one more; OpenAI's limit), and
    # token ids in a prompt or /detokenize list (no context holds more).
    max_messages: int = 2048
    max_token_ids: int = 131072
    # The HTTP server: a request's headers must all arrive within header_timeout_s (of the connection
    # opening or its last response), its body within body_timeout_s of them (else 408); open
    # connections at most (a request beyond them is answered 503).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    # "exclusive": an instance per device, least-loaded routing. "mesh" (LLM-Mesh): models share
    # workers; bin-packing routing, and workers may refuse a request as "busy". "dedicated": one
    # model per worker at a time (the planner's placement and the workers'), least-loaded routing.
    sharing: str = "exclusive"

    def __post_init__(self):
        sharing_setting(self.sharing)  # an unknown name fails here, at start


MAX_HANDOVERS = 2  # per request: a request that loses three instances fails


@dataclass
class Piece:
    """One step of a generation as clients see it."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # of every choice so far
    logprob: TokenLogprob | None = None  # the token's, when the request asked for logprobs
    index: int = 0  # the choice it belongs to (n > 1)


class _Choice:
    """One of a request's n completions, as the client sees it: its own text, stop strings and end."""

    def __init__(self, tokenizer, stops: list[str]):
        self.token_ids: list[int] = []  # generated so far: a hand-over recomputes their KV elsewhere
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(stops)
        self.expected = 0  # the index of its next TokenEvent
        self.completion_tokens = 0
        self.finished = False


class Generation:
    """A dispatched request: iterate it for Pieces (of its n choices, interleaved); always `close()` it."""

    def __init__(self, gw: "GatewayService", entry: ModelEntry, route: Route, request_id: str,
                 prompt_ids: list[int], sampling: m.SamplingSpec, stops: list[str], started: float, span: trace.Span):
        self.gw, self.entry, self.route, self.request_id = gw, entry, route, request_id
        self.prompt_ids, self.sampling = prompt_ids, sampling
        self.prompt_len, self.started, self.span = len(prompt_ids), started, span
        self.handovers = 0
        self.switches = 0  # hand-overs of a pipeline's mode switch or a preemption: planned, not failures
        self.attempt: int | None = None  # GenerateRequest.attempt of its dispatch now (set by dispatch)
        self.queue: asyncio.Queue[m.TokenEvent] = asyncio.Queue()
        self.choices = [_Choice(entry.tokenizer, stops) for _ in range(sampling.n)]

    @property
    def token_ids(self) -> list[int]:
        """Choice 0's tokens so far (n = 1: the request's)."""
        return self.choices[0].token_ids

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    async def __aiter__(self) -> AsyncIterator[Piece]:
        model = self.entry.info.name
        last = first = None
        while not self.finished:
            timeout = self.gw.config.first_token_timeout_s if last is None else self.gw.config.token_timeout_s
            try:
                ev = await asyncio.wait_for(self.queue.get(), timeout)
            except TimeoutError:
                if await self._hand_over(f"instance {self.route.instance_id} stopped responding"):
                    continue
                raise APIError(503, f"instance {self.route.instance_id} stopped responding", code="worker_timeout",
                               retry_after=1) from None
            if ev.instance_id is not None and ev.instance_id != self.route.instance_id:
                continue  # from the instance this request was handed over from: stale
            if ev.attempt is not None and self.attempt is not None and ev.attempt != self.attempt:
                continue  # from an attempt it left on this same instance (a hand-over back to it): stale
            if ev.error is not None:
                self.switches += ev.preempted  # a worker's preemption (sharing=mesh): planned, not a failure
                if await self._hand_over(ev.error):
                    continue
                raise APIError(503, f"generation failed: {ev.error}", code="generation_failed", retry_after=1)
            if ev.choice >= len(self.choices):
                raise APIError(503, f"token stream names choice {ev.choice} of {len(self.choices)}",
                               code="stream_broken", retry_after=1)
            choice = self.choices[ev.choice]
            if choice.finished or ev.index < choice.expected:
                continue  # a token the instance handed over from had sent already, or after a stop string
            if ev.index != choice.expected:
                # Tokens were lost on the way (a NATS restart drops what it carried): go on from
                # the tokens received, on this instance or another, rather than fail the request.
                why = f"token stream lost tokens (got {ev.index}, expected {choice.expected})"
                if await self._hand_over(why):
                    continue
                raise APIError(503, why, code="stream_broken", retry_after=1)
            choice.expected += 1
            if ev.token_id is not None:
                choice.token_ids.append(ev.token_id)
            now = time.perf_counter()
            if last is None:
                ttft = now - self.started
                TTFT.labels(model).observe(ttft)
                self.entry.ttft_samples.append(ttft)
                self.span.add_event("first_token")
                first = now
            else:
                ITL.labels(model).observe(now - last)
            last = now
            text = ""
            stops, detok = choice.stops, choice.detok
            if ev.token_id is not None:
                self.entry.tokens_generated += 1
            if ev.token_id is not None and not (ev.finished and ev.token_id in self.entry.eos_ids):
                choice.completion_tokens += 1
                GENERATED.labels(model).inc()
                text = stops.feed(detok.add(ev.token_id))
            elif ev.token_id is not None:
                choice.completion_tokens += 1  # the eos token counts as generated, as in the OpenAI API
            finish = ev.finish_reason if ev.finished else None
            if stops.stopped:
                finish = "stop"
            if finish is not None:
                if not stops.stopped:
                    text += stops.feed(detok.finish())
                    text += stops.flush() if not stops.stopped else ""
                    if stops.stopped:  # the stop string was in the text held back until the end
                        finish = "stop"
                # With n > 1 the worker goes on with a choice ended by a stop string until its
                # own end; what it sends for it is dropped above.
                choice.finished = True
                after_first = max(c.completion_tokens for c in self.choices) - 1  # the longest choice's
                if self.finished and first is not None and after_first > 0:
                    self.entry.tpot_samples.append((now - first) / after_first)
            if ev.token_id is not None or finish is not None:
                # A chunk per token, its text possibly empty while held back (an incomplete
                # character, a possible stop string), as vLLM streams: a client sees the first
                # token when it comes, not when its text becomes printable.
                logprob = None
                if ev.token_id is not None and ev.logprob is not None:
                    logprob = TokenLogprob(ev.token_id, ev.logprob, tuple(map(tuple, ev.top_logprobs)))
                yield Piece(text, finish, self.prompt_len, self.completion_tokens, logprob, ev.choice)

    async def _hand_over(self, why: str) -> bool:
        """Its instance failed or was stopped: go on on another instance, which recomputes the
        KV cache of the prompt and the tokens so far (the client sees one unbroken stream)."""
        if self.handovers - self.switches >= MAX_HANDOVERS or self.finished:
            return False
        self.handovers += 1
        old = self.route
        # That attempt only: the request may be handed over to the same instance, and this cancel
        # may reach the worker after the new attempt.
        await self.gw.workers.cancel(old.worker_id, m.CancelRequest(request_id=self.request_id,
                                                                    instance_id=old.instance_id,
                                                                    attempt=self.attempt))
        self.entry.routes.release(old, self.sampling.n)
        while not self.queue.empty():
            self.queue.get_nowait()  # what the old instance sent is stale
        tokens = sum(len(c.token_ids) for c in self.choices)
        log.warning("request %s: %s; handing it over after %d tokens", self.request_id, why, tokens)
        self.span.add_event("handover", {"layercast.reason": why[:200], "layercast.tokens": tokens})
        # n > 1: the choices still running go on, each from its own tokens (the prompt is
        # prefilled once there too); the ended ones stay as they are.
        resume = {} if self.sampling.n == 1 else {i: list(c.token_ids) for i, c in enumerate(self.choices)
                                                  if not c.finished}
        try:
            self.route = await self.gw.dispatch(self.entry, self.request_id, self.prompt_ids, self.sampling,
                                                self.token_ids if self.sampling.n == 1 else (), resume,
                                                admitted=True)
        except APIError as e:
            self.route = old
            old.in_flight += self.entry.routes.charge(old, self.sampling.n)  # close() releases it once more
            log.warning("request %s: hand-over failed: %s", self.request_id, e.message)
            return False
        HANDOVERS.labels(self.entry.info.name).inc()
        return True

    async def close(self) -> None:
        self.gw.streams.pop(self.request_id, None)
        self.entry.routes.release(self.route, self.sampling.n)
        if not self.finished:
            await self.gw.workers.cancel(self.route.worker_id, m.CancelRequest(request_id=self.request_id,
                                                                               instance_id=self.route.instance_id))
        self.span.set_attribute("layercast.completion_tokens", self.completion_tokens)
        self.span.end()


class GatewayService(Service):
    name = "gateway"

    def __init__(self, config: GatewayConfig | None = None, nats_url: str | None = None,
                 workers: WorkerClient | None = None):
        super().__init__(nats_url)
        self.config = config or GatewayConfig()
        # The workers' generate: over NATS, or given (tests: InMemoryWorkerClient).
        self.workers = workers or NatsWorkerClient(self.broker, self.config.gateway_id)
        self.workers.listen(self._token_arrived)
        self.models: dict[str, ModelEntry] = {}
        self.streams: dict[str, Generation] = {}
        self._synced = False
        self._first_sync = asyncio.Event()  # set once, when the registry has been read
        self.listed: set[str] = set()  # the models the registry listed at the last read (some may be loading)
        # When a deploy or delete of a model (its event, or the admin call answered here) last
        # reached this gateway: a registry read asked before that is older news about the model.
        self._model_news_at: dict[str, float] = {}
        self.ended = EndedInstances()
        self._adding: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._demand = asyncio.Event()
        self._reported_at = time.monotonic()  # the previous metrics report: what its deltas cover
        self._attempts = itertools.count()  # GenerateRequest.attempt: unique per hand-off
        self._tokenizing = ThreadPoolExecutor(self.config.tokenizer_threads, thread_name_prefix="tokenize")
        self._subscribe()

    def healthy(self) -> bool:
        """Ready: the registry has been read once (a process that is up but not ready is live)."""
        return self._synced

    async def wait_synced(self) -> None:
        """Until the registry has been read once, at most `first_sync_wait_s` (then require_synced's 503)."""
        if not self._synced:
            try:
                await asyncio.wait_for(self._first_sync.wait(), self.config.first_sync_wait_s)
            except TimeoutError:
                pass

    def require_synced(self) -> None:
        """503 until the registry has been read once: until then no model is known to exist or not."""
        if not self._synced:
            raise APIError(503, "The gateway is starting and has not read the model registry yet",
                           code="gateway_starting", retry_after=self.config.not_ready_retry_after_s)

    async def stop(self) -> None:
        await super().stop()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    def background(self) -> list:
        return [self.every(lambda: self.config.resync_interval_s if self._synced else 0.5, self.resync, "registry resync",
                           first_now=True),
                self.every(self.config.metrics_interval_s, self.publish_metrics, "publishing gateway metrics",
                           wake=self._demand)]

    # --- model table -------------------------------------------------------------------
    async def add_model(self, info: m.ModelInfo) -> ModelEntry:
        # The deploy call, the model event and the resync all add the model: one at a time, so
        # the tokenizer loads once and a later entry never replaces one that routes already use.
        async with self._adding[info.name]:
            entry = self.models.get(info.name)
            if entry is not None and entry.info.path == info.path:
                entry.info = info
                entry.routes.max_queue = info.max_queue
                return entry
            return await self._load_model(info)

    async def _load_model(self, info: m.ModelInfo) -> ModelEntry:
        started = time.monotonic()
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, info.path)
        index = await asyncio.to_thread(CheckpointIndex.load, info.path)
        longest_token = await asyncio.to_thread(lambda: max(len(t.encode()) for t in tokenizer.get_vocab()))
        took = time.monotonic() - started
        (log.warning if took > SLOW_MODEL_LOAD_S else log.info)("model %s: tokenizer and index read in %.2f s",
                                                                 info.name, took)
        context = min(int(index.config.get("max_position_embeddings", self.config.max_context)),
                      self.config.max_context)
        eos = index.config.get("eos_token_id", tokenizer.eos_token_id)
        eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        entry = ModelEntry(info, tokenizer, context, eos_ids,
                           ModelRoutes(info.name, info.max_queue, self.config.slots_per_instance,
                                       sharing=self.config.sharing),
                           max_prompt_bytes=context * longest_token * NORMALIZER_SLACK)
        self.models[info.name] = entry
        return entry

    async def deployed(self, info: m.ModelInfo) -> ModelEntry:
        """The registry has deployed `info` (its event, or the deploy call this gateway answered)."""
        self._model_news_at[info.name] = time.monotonic()
        self.listed.add(info.name)
        return await self.add_model(info)

    def deleted(self, name: str) -> None:
        """The registry has deleted the model (its event, or the delete call this gateway answered)."""
        self._model_news_at[name] = time.monotonic()
        self.drop_model(name)

    def drop_model(self, name: str) -> None:
        self.listed.discard(name)  # deleted: a 404 from now on, not a 503 "not loaded yet"
        entry = self.models.pop(name, None)
        if entry is not None:
            entry.routes.fail_all(f"model {name!r} was deleted")

    def _apply_instance(self, inst: m.InstanceInfo, switched_to: list[str] = ()) -> None:
        if inst.state not in (m.InstanceState.loading, m.InstanceState.ready):
            self.ended.mark(inst.instance_id)
        entry = self.models.get(inst.model)
        if entry is None:
            return
        if inst.state == m.InstanceState.ready and inst.instance_id not in self.ended:
            entry.routes.add(inst.instance_id, inst.entry_worker, loading=inst.loaded_at is None,
                             max_batch=inst.max_batch, device=inst.device)
        elif inst.state == m.InstanceState.draining:
            route = entry.routes.remove(inst.instance_id)  # no new requests; those running there finish there
            if route is not None and switched_to:
                # A pipeline's mode switch: its step in flight ends, then its requests come back
                # to be handed over (a planned move, not a failure).
                for _, gen in self._streams_on(route):
                    gen.switches += 1
        elif inst.state != m.InstanceState.loading:  # a "loading" after "ready" is stale (the registry's rule too)
            why = f"switched to {', '.join(switched_to)}" if switched_to else f"instance {inst.state.value}"
            self._drop_route(entry, inst.instance_id, why, switched=bool(switched_to))

    def _drop_route(self, entry: ModelEntry, instance_id: str, why: str, switched: bool = False) -> None:
        route = entry.routes.remove(instance_id)
        if route is None:
            return
        # Requests running there can no longer finish: move them now rather than wait for a timeout.
        for rid, gen in self._streams_on(route):
            gen.switches += switched
            gen.queue.put_nowait(m.TokenEvent(request_id=rid, index=-1, finished=True, finish_reason="error",
                                              error=why, instance_id=instance_id))

    async def on_reconnected(self) -> None:
        """NATS came back: tokens sent to this gateway while it was away are lost, and the
        streams waiting for them would wait out the token timeout. Hand each over now (a planned
        move: the instance did not fail), and read the registry again (routes dropped while
        workers did not answer come back)."""
        moved = 0
        for rid, gen in list(self.streams.items()):
            if gen.route is None or gen.finished:
                continue  # not dispatched yet: its dispatch retries by itself
            gen.switches += 1
            gen.queue.put_nowait(m.TokenEvent(request_id=rid, index=-1, finished=True, finish_reason="error",
                                              error="the NATS connection was re-established",
                                              instance_id=gen.route.instance_id))
            moved += 1
        RECONNECTS.inc()
        log.warning("NATS reconnected: handing over %d in-flight streams (of %d requests)", moved, len(self.streams))
        self.spawn(self.resync())

    def _streams_on(self, route: Route) -> list[tuple[str, Generation]]:
        """The requests streaming from `route` now (a copy: handing over changes the table)."""
        return [(rid, gen) for rid, gen in list(self.streams.items()) if gen.route is route]

    async def resync(self) -> None:
        """Rebuild the tables from the registry; events keep them fresh in between."""
        asked = time.monotonic()
        view = await call(self.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=0), m.ClusterView)
        # A model deployed or deleted after the registry was asked: the view is older than that
        # news and must not undo it (a model deployed meanwhile dropped again would be a 404 for
        # a whole resync interval, and the requests queued for it failed).
        newer = {name for name, at in self._model_news_at.items() if at >= asked}
        names = {mi.name for mi in view.models}
        self.listed = (names - newer) | (self.listed & newer)
        for name in list(self.models):
            if name not in names and name not in newer:
                self.drop_model(name)
        for info in view.models:
            if info.name in newer:
                continue
            try:
                await self.add_model(info)
            except Exception as e:
                log.warning("cannot serve model %s from %s: %s", info.name, info.path, e)
        live = {i.instance_id for i in view.instances if i.state == m.InstanceState.ready}
        for inst in view.instances:
            self._apply_instance(inst)
        for entry in self.models.values():
            # A route first added after the registry was asked came from a newer event than the
            # view (an instance's "ready" reaches the gateway before the registry has written
            # it): the view says nothing of it. Dropping it would leave the instance without
            # requests until the next resync, longer than a pipeline may serve.
            for iid in [i for i, r in entry.routes.routes.items() if i not in live and r.added_at < asked]:
                self._drop_route(entry, iid, "instance no longer in the registry")
        self._mark_synced()

    def _mark_synced(self) -> None:
        """The registry has been read: models not in it do not exist (404), the gateway is ready."""
        self._synced = True
        self._first_sync.set()

    async def publish_metrics(self) -> None:
        loads = []
        for name, e in self.models.items():
            r = e.routes
            QUEUE_DEPTH.labels(name).set(r.queued)
            IN_FLIGHT.labels(name).set(r.in_flight)
            INSTANCES.labels(name).set(len(r.routes))
            loads.append(m.ModelLoad(model=name, queued=r.queued, in_flight=r.in_flight, arrivals=r.arrivals,
                                     ready_instances=len(r.routes), last_request_at=r.last_request_at,
                                     ttft_s=e.ttft_samples, tpot_s=e.tpot_samples,
                                     tokens_generated=e.tokens_generated, queued_tokens=e.queued_tokens))
            r.arrivals, e.ttft_samples, e.tpot_samples, e.tokens_generated = 0, [], [], 0
        now = time.monotonic()
        interval, self._reported_at = now - self._reported_at, now
        await publish(self.broker, subjects.METRICS_GATEWAY, m.GatewayMetrics(
            gateway_id=self.config.gateway_id, models=loads, interval_s=interval))

    def _token_arrived(self, ev: m.TokenEvent) -> None:
        gen = self.streams.get(ev.request_id)
        if gen is not None:
            gen.queue.put_nowait(ev)

    def _subscribe(self) -> None:
        b = self.broker

        @b.subscriber(subjects.EVENT_INSTANCE)
        @on_event(m.InstanceEvent)
        async def instance(ev: m.InstanceEvent) -> None:
            self._apply_instance(ev.instance, ev.switched_to)

        @b.subscriber(subjects.EVENT_MODEL)
        @on_event(m.ModelEvent)
        async def model(ev: m.ModelEvent) -> None:
            if ev.kind == "deployed":
                await self.deployed(ev.model)
            else:
                self.deleted(ev.model.name)

    # --- requests ----------------------------------------------------------------------------------
    def entry(self, name: str, visible: bool = True) -> ModelEntry:
        """The model's entry; 404 if there is none, or if the caller may not see it (`visible`);
        503 + Retry-After while that cannot be told yet (registry not read, or the model loading)."""
        entry = self.models.get(name)
        if entry is not None and visible:
            return entry
        self.require_synced()
        if visible and (name in self.listed or self._adding_now(name)):
            # The registry has it but its tokenizer is not loaded here (loading, or failed to): it exists.
            raise APIError(503, f"The model '{name}' is not loaded at this gateway yet", param="model",
                           code="model_loading", retry_after=self.config.not_ready_retry_after_s)
        raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")

    def _adding_now(self, name: str) -> bool:
        lock = self._adding.get(name)  # .get: a lookup must not add a lock for every name asked about
        return lock is not None and lock.locked()

    async def tokenize(self, entry: ModelEntry, nbytes: int, param: str, work: Callable[[], list[int]],
                       messages: int = 0) -> list[int]:
        """Run `work` (tokenizing a prompt of `nbytes` UTF-8 bytes of text, in `messages` chat
        messages to template first, if any) off the event loop, so a large prompt delays no other
        request; a prompt too long for the context whatever it tokenizes to is refused first,
        without tokenizing it."""
        if nbytes > entry.max_prompt_bytes:
            raise APIError(400, f"This model's maximum context length is {entry.context_len} tokens; the prompt "
                           f"has {nbytes} bytes, more than that many tokens can hold", param=param,
                           code="context_length_exceeded")
        return await self.off_loop(work, small=nbytes + messages * MESSAGE_COST_BYTES <= INLINE_TOKENIZE_BYTES)

    async def off_loop(self, work: Callable[[], object], small: bool):
        """Tokenizer work: in a tokenizer thread, or, `small` (about a millisecond), at once on the
        event loop, where it never waits behind large prompts for a thread."""
        loop_thread = threading.get_ident()

        def counted():
            TOKENIZER_RUNS.labels("event_loop" if threading.get_ident() == loop_thread else "thread").inc()
            return work()
        if small:
            return counted()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, counted)

    def resolve_max_tokens(self, entry: ModelEntry, prompt_len: int, requested: int | None, param: str) -> int:
        room = entry.context_len - prompt_len
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {entry.context_len} tokens; the prompt "
                           f"has {prompt_len}", param="messages" if param != "max_tokens" else "prompt",
                           code="context_length_exceeded")
        if requested is None:
            return min(room, self.config.default_max_tokens)
        if requested > room:
            raise APIError(400, f"{param}={requested} is too large: the prompt has {prompt_len} tokens and the "
                           f"model's context is {entry.context_len}", param=param, code="context_length_exceeded")
        return requested

    async def start_generation(self, entry: ModelEntry, prompt_ids: list[int], sampling: m.SamplingSpec,
                               stops: list[str]) -> Generation:
        """Admit, route and dispatch; errors here are HTTP errors (nothing streamed yet).

        One trace per request: under FastAPI's server span (which continues a client's
        `traceparent`), `gateway.generate` lasts until the stream ends and `gateway.queue`
        is the wait for an instance slot."""
        started = time.perf_counter()
        span = _tracer.start_span("gateway.generate", attributes={
            "layercast.model": entry.info.name, "layercast.prompt_tokens": len(prompt_ids)})
        request_id = uuid.uuid4().hex
        try:
            with trace.use_span(span):
                gen = Generation(self, entry, None, request_id, prompt_ids, sampling, stops, started, span)
                self.streams[request_id] = gen  # before dispatch: the first token may beat the reply
                try:
                    gen.route = await self.dispatch(entry, request_id, prompt_ids, sampling)
                except BaseException:
                    self.streams.pop(request_id, None)
                    raise
                return gen
        except BaseException:
            span.end()
            raise

    async def dispatch(self, entry: ModelEntry, request_id: str, prompt_ids: list[int], sampling: m.SamplingSpec,
                       generated_ids: list[int] = (), choices: dict[int, list[int]] | None = None,
                       admitted: bool = False) -> Route:
        """Wait for instance slots (one per choice) and hand the request to its worker; the route it holds.

        A worker that fails it loses its route (three failures: 503). One that refuses it as
        "busy" (sharing=mesh: it would break an SLO there) keeps it, full for now: the request
        tries the next instance or waits, within the same queue_timeout_s. One that does not
        answer in time (overloaded, or hung) loses its route until the next sync and has that
        attempt cancelled, since it may still take it late; one whose instance is stopping loses
        the route too. In both cases the request tries elsewhere within the same wait: neither
        is proof that the request cannot be served. `admitted`: a hand-over; the request waits at
        the queue's head (a pipeline's switch hands over requests that came before those queued)."""
        self._demand.set()
        model = entry.info.name
        failures, handed_over = 0, admitted
        arrived = time.monotonic()
        deadline = arrived + self.config.queue_timeout_s  # refusals do not restart the wait
        while failures < 3:
            with _tracer.start_as_current_span("gateway.queue", attributes={
                    "layercast.model": model, "layercast.attempt": failures, "layercast.admitted": admitted}) as queued:
                # Counted while it waits (also if it gets a slot at once: a report in between sees no change).
                owed = sampling.max_tokens * sampling.n
                entry.queued_tokens += owed
                try:
                    route = await entry.routes.acquire(max(0.0, deadline - time.monotonic()), sampling.n,
                                                       admitted=admitted)
                finally:
                    entry.queued_tokens -= owed
                queued.set_attribute("layercast.instance", route.instance_id)
            self._demand.set()
            req = m.GenerateRequest(request_id=request_id, instance_id=route.instance_id, model=model,
                                    prompt_ids=prompt_ids, sampling=sampling,
                                    generated_ids=list(generated_ids), choices=dict(choices or {}),
                                    reply_subject=self.workers.reply_subject(request_id),
                                    ttft_slo_s=entry.info.ttft_slo_s, tpot_slo_s=entry.info.tpot_slo_s,
                                    queued_s=time.monotonic() - arrived, attempt=next(self._attempts))
            try:
                await self.workers.generate(route.worker_id, req, self.config.dispatch_timeout_s)
            except asyncio.CancelledError:
                # The caller gave up mid-RPC (its client went away): give the slot back, and cancel
                # on the worker, which may have taken the request. Spawned: this task is cancelled.
                entry.routes.release(route, sampling.n)
                self._cancel_attempt(route, req)
                raise
            except (TimeoutError, RemoteError) as e:
                if isinstance(e, RemoteError) and e.code == "busy":
                    entry.routes.refuse(route, sampling.n)
                    BUSY_REFUSALS.labels(model).inc()
                    log.debug("instance %s refused request %s as busy: %s", route.instance_id, request_id, e.error)
                    admitted = True
                    continue
                unanswered = isinstance(e, TimeoutError) and not isinstance(e, NoResponders)
                if unanswered or (isinstance(e, RemoteError) and e.code == "unavailable"):
                    # Its worker is slow, or the instance is stopping (the planner drains it): the
                    # route goes, the request's wait goes on; neither is the request's failure.
                    if unanswered:
                        self._cancel_attempt(route, req)
                        UNANSWERED.labels(model).inc()
                    self._dispatch_failed(entry, route, sampling.n, e)
                    admitted = True  # it waits at the head, never a 429
                    continue
                self._dispatch_failed(entry, route, sampling.n, e)
                failures, admitted = failures + 1, handed_over
                deadline = time.monotonic() + self.config.queue_timeout_s  # as before: each failure waits anew
            else:
                span = trace.get_current_span()
                span.set_attribute("layercast.instance", route.instance_id)
                span.set_attribute("layercast.worker", route.worker_id)
                if (gen := self.streams.get(request_id)) is not None:
                    gen.attempt = req.attempt  # a hand-over cancels exactly this attempt
                return route
        raise APIError(503, "no instance accepted the request", code="model_unavailable", retry_after=1)

    def _cancel_attempt(self, route: Route, req: m.GenerateRequest) -> None:
        """Cancel one hand-off on its worker, which may have taken it or may yet (spawned: the
        caller may be a task being cancelled)."""
        self.spawn(self.workers.cancel(route.worker_id, m.CancelRequest(
            request_id=req.request_id, instance_id=route.instance_id, attempt=req.attempt)))

    def _dispatch_failed(self, entry: ModelEntry, route: Route, weight: int, e: Exception) -> None:
        """Its worker did not take the request: a 400 if the request is at fault, else drop the route."""
        entry.routes.release(route, weight)
        if isinstance(e, RemoteError) and e.code == "invalid":
            raise APIError(400, e.error) from e
        log.warning("dispatch to %s failed (%s); dropping that route", route.instance_id, e)
        entry.routes.remove(route.instance_id)
