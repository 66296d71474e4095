"""Process-wide telemetry set-up, called once by every service's entry point.

Exporters follow the standard OTEL_* variables: OTLP/HTTP when
OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, the console when
OTEL_TRACES_EXPORTER=console, nothing exported otherwise (spans are still
created so `traceparent` propagates through this process).

What becomes a trace: requests and scale operations, each one trace across every
service. Periodic chatter (heartbeats, metrics, registry polls) would bury them,
so a root span on one of those subjects is not sampled, and neither is anything
under it (`QuietRootSampler`). LAYERCAST_TRACE_RATIO (default 1) samples that
fraction of the remaining root traces.
"""

import logging
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, TraceFlags

_configured = False


def setup_logging(service: str) -> None:
    level = os.environ.get("LAYERCAST_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
    # FastStream logs every message at INFO; keep that for debugging only.
    logging.getLogger("layercast.bus").setLevel(max(logging.WARNING, logging.getLevelName(level)))


class QuietRootSampler(Sampler):
    """Drops root spans whose name starts with a quiet subject (FastStream names its spans
    "<subject> create|publish|process"); other roots go to `delegate`."""

    def __init__(self, quiet_subjects: Sequence[str], delegate: Sampler):
        # A reply (to an _INBOX) without a parent answers a request that was not traced.
        self.quiet_subjects = (*quiet_subjects, "_INBOX.")
        self.delegate = delegate

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        if name.startswith(self.quiet_subjects):
            return SamplingResult(Decision.DROP)
        return self.delegate.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"QuietRootSampler({len(self.quiet_subjects)} subjects, {self.delegate.get_description()})"


def make_sampler(quiet_subjects: Sequence[str] = ()) -> Sampler:
    ratio = float(os.environ.get("LAYERCAST_TRACE_RATIO", "1"))
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"LAYERCAST_TRACE_RATIO={ratio} must be within [0, 1]")
    return ParentBased(root=QuietRootSampler(quiet_subjects, TraceIdRatioBased(ratio)))


def unsampled(span: Span) -> NonRecordingSpan:
    """A stand-in for `span` that keeps its trace id but is not sampled: what is published
    under it carries a `traceparent` whose sampled flag is off, so no hop records spans.
    For hot paths (every streamed token) where a trace keeps only the first and last."""
    ctx = span.get_span_context()
    return NonRecordingSpan(SpanContext(ctx.trace_id, ctx.span_id, is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.DEFAULT), trace_state=ctx.trace_state))


def setup_tracing(service: str, quiet_subjects: Sequence[str] = ()) -> TracerProvider:
    global _configured
    if _configured:
        return trace.get_tracer_provider()  # type: ignore[return-value]
    provider = TracerProvider(resource=Resource.create({"service.name": f"layercast-{service.replace('_', '-')}"}),
                              sampler=make_sampler(quiet_subjects))
    exporter_kind = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    has_endpoint = any(
        os.environ.get(v) for v in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    if exporter_kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter_kind not in ("none",) and (exporter_kind == "otlp" or has_endpoint):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(f"layercast.{name}")
