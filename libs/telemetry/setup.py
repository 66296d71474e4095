"""Process-wide telemetry set-up, called once by every service's entry point.

Exporters follow the standard OTEL_* variables: OTLP/HTTP when
OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, the console when
OTEL_TRACES_EXPORTER=console, nothing exported otherwise (spans are still
created so `traceparent` propagates through this process).
"""

import logging
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

_configured = False


def setup_logging(service: str) -> None:
    level = os.environ.get("LAYERCAST_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
    # FastStream logs every message at INFO; keep that for debugging only.
    logging.getLogger("layercast.bus").setLevel(max(logging.WARNING, logging.getLevelName(level)))


def setup_tracing(service: str) -> TracerProvider:
    global _configured
    if _configured:
        return trace.get_tracer_provider()  # type: ignore[return-value]
    provider = TracerProvider(resource=Resource.create({"service.name": f"layercast-{service}"}))
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
