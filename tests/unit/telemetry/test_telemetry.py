"""What becomes a trace (libs.telemetry): quiet roots dropped with their subtree, hot-path
hops propagated unsampled, the sampling ratio validated."""

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.protocol import subjects
from libs.telemetry.setup import make_sampler, unsampled


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.delenv("LAYERCAST_TRACE_RATIO", raising=False)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=make_sampler(subjects.QUIET_SUBJECTS))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def names(exporter) -> list[str]:
    return sorted(s.name for s in exporter.get_finished_spans())


def test_a_heartbeat_root_and_everything_under_it_is_dropped(recorded):
    tracer, exporter = recorded
    with tracer.start_as_current_span(f"{subjects.EVENT_HEARTBEAT} create"):
        with tracer.start_as_current_span("registry handles it"):
            pass
    with tracer.start_as_current_span("_INBOX.abc.def create"):  # a reply to an untraced request
        pass
    assert names(exporter) == []


def test_the_same_subject_inside_a_traced_operation_is_kept(recorded):
    tracer, exporter = recorded
    with tracer.start_as_current_span("planner.scale_up"):
        with tracer.start_as_current_span(f"{subjects.REGISTRY_CLUSTER} create"):
            pass
    assert names(exporter) == sorted(["planner.scale_up", f"{subjects.REGISTRY_CLUSTER} create"])


def test_an_unsampled_stand_in_keeps_the_trace_but_records_nothing_downstream(recorded):
    tracer, exporter = recorded
    with tracer.start_as_current_span("worker.generate") as span:
        with trace.use_span(unsampled(span)):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            with tracer.start_as_current_span("token publish"):
                pass
    version, trace_id, _, flags = carrier["traceparent"].split("-")
    assert trace_id == format(span.get_span_context().trace_id, "032x")
    assert flags == "00"  # the receiving service does not record its hop either
    assert names(exporter) == ["worker.generate"]


@pytest.mark.parametrize("ratio", ["1.5", "-0.1"])
def test_a_trace_ratio_outside_zero_to_one_is_refused(monkeypatch, ratio):
    monkeypatch.setenv("LAYERCAST_TRACE_RATIO", ratio)
    with pytest.raises(ValueError, match="LAYERCAST_TRACE_RATIO"):
        make_sampler()


def test_a_zero_ratio_samples_no_root(monkeypatch):
    monkeypatch.setenv("LAYERCAST_TRACE_RATIO", "0")
    provider = TracerProvider(sampler=make_sampler())
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("gateway.generate"):
        pass
    assert names(exporter) == []
