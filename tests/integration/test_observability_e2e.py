"""Operators' view of a real cluster (services as processes, OTLP export to a test receiver):
one connected trace per streamed request and per scale operation, and every metric the
Grafana dashboard queries present in the services' /metrics."""

import json
import re
import secrets
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import running_cluster, wait_for
from otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "layercast.json"


@pytest.fixture(scope="module")
def traced(tmp_path_factory, nats_url, postgres_server_url, tiny_checkpoint):
    """A one-worker cluster exporting spans to a receiver; the model starts at zero instances."""
    with OtlpReceiver() as receiver, running_cluster(
            postgres_server_url, tiny_checkpoint, dict(min_instances=0, max_instances=1, keep_alive_s=600),
            state_dir=tmp_path_factory.mktemp("cluster"), api_key=API_KEY, admin_key=ADMIN_KEY, workers=1,
            nats_url=nats_url, namespace=f"lco{uuid.uuid4().hex[:8]}",
            extra_env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
                       "OTEL_TRACES_EXPORTER": "otlp"}) as state:
        yield state, receiver


@pytest.fixture(scope="module")
def streamed(traced):
    """One streamed completion (it scales the model from zero) sent with the client's own
    `traceparent`; returns (client trace id, client span id, streamed lines)."""
    state, _ = traced
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    with httpx.stream("POST", f"{state.gateway_url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "trace me", "max_tokens": 6, "stream": True,
            # ignore_eos would be nicer; a fixed seed keeps the stream long enough in practice
            "seed": 1, "temperature": 0.0},
            headers={"Authorization": f"Bearer {API_KEY}", "traceparent": f"00-{trace_id}-{span_id}-01"}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return trace_id, span_id, lines


def by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.span_id: s for s in spans}


def ancestors(span: ReceivedSpan, index: dict[str, ReceivedSpan]) -> list[str]:
    """Names from the span's parent up to the root of what was received."""
    names = []
    while span.parent_span_id in index:
        span = index[span.parent_span_id]
        names.append(span.name)
    return names


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"expected one {name!r} span, got {len(found)}: {sorted(s.name for s in spans)}"
    return found[0]


def test_a_streamed_request_is_one_trace_from_the_client_through_the_worker_and_back(traced, streamed):
    _, receiver = traced
    trace_id, client_span, lines = streamed
    tokens = len(lines) - 2  # the last chunk carries finish_reason, then [DONE]

    def complete():
        spans = receiver.trace(trace_id)
        names = [s.name for s in spans]
        return spans if "gateway.generate" in names and "worker.generate" in names and \
            sum(n.endswith(" process") and ".tokens." in n for n in names) >= 2 else None

    spans = wait_for(complete, 20, "the request's spans from the gateway and the worker")
    index = by_id(spans)
    assert {s.service for s in spans} == {"layercast-gateway", "layercast-worker"}

    # Exactly one span has a parent outside the trace's services: the HTTP server span, child of
    # the client's span. Every other parent link resolves inside the trace.
    orphans = [s for s in spans if s.parent_span_id not in index]
    assert [(s.name, s.parent_span_id) for s in orphans] == [("POST /v1/completions", client_span)]

    generate = one(spans, "gateway.generate")
    assert generate.attributes["layercast.model"] == "tiny"
    assert "POST /v1/completions" in ancestors(generate, index)
    queue = one(spans, "gateway.queue")
    assert queue.parent_span_id == generate.span_id
    worker = one(spans, "worker.generate")
    assert worker.service == "layercast-worker"
    assert "gateway.generate" in ancestors(worker, index)  # through the NATS publish and the worker's consumer span
    assert worker.attributes["layercast.worker"] == generate.attributes["layercast.worker"]
    assert worker.attributes["layercast.instance"] == generate.attributes["layercast.instance"]

    # Tokens come back over NATS: the first and the last hop are in the trace (under the worker's
    # span, received by the gateway), the ones between are propagated unsampled.
    hops = [s for s in spans if s.name.endswith(" process") and ".tokens." in s.name]
    assert all(h.service == "layercast-gateway" and "worker.generate" in ancestors(h, index) for h in hops)
    assert len(hops) == min(tokens, 2), (len(hops), tokens)
    assert generate.end_ns >= max(h.end_ns for h in hops) - 50_000_000  # the request span covers the stream


def test_a_scale_operation_is_one_trace_from_the_decision_to_the_instance_ready(traced, streamed):
    _, receiver = traced

    def complete():
        roots = [s for s in receiver.snapshot() if s.name == "load_monitor.scale_request"
                 and s.attributes.get("layercast.direction") == "up"]
        for root in roots:
            spans = receiver.trace(root.trace_id)
            names = {s.name for s in spans}
            if {"planner.scale_up", "worker.load"} <= names and any(
                    s.name.endswith("events.instance process") and s.service == "layercast-planner"
                    and "worker.load" in ancestors(s, by_id(spans)) for s in spans):
                return root, spans
        return None

    root, spans = wait_for(complete, 20, "the scale-up's trace with the worker's load and the ready event")
    index = by_id(spans)
    assert root.parent_span_id == "" and root.attributes["layercast.model"] == "tiny"
    assert [s for s in spans if s.parent_span_id and s.parent_span_id not in index] == []

    plan = one(spans, "planner.scale_up")
    assert root.name in ancestors(plan, index)
    assert plan.attributes["layercast.mode"] == "local-load"
    load = one(spans, "worker.load")
    assert "planner.scale_up" in ancestors(load, index)
    assert load.attributes["layercast.worker"] in plan.attributes["layercast.targets"].split(",")
    assert load.attributes["layercast.bytes"] > 0
    # The operation's span lasts until the planner has seen its instance ready.
    ready = [s for s in spans if s.name.endswith("events.instance process") and s.service == "layercast-planner"
             and "worker.load" in ancestors(s, index)]
    assert plan.attributes["layercast.outcome"] == "done"
    assert plan.end_ns >= min(s.start_ns for s in ready)
    assert {"layercast-load-monitor", "layercast-planner", "layercast-registry", "layercast-worker"} <= \
        {s.service for s in spans}


def test_periodic_traffic_starts_no_traces(traced, streamed):
    _, receiver = traced
    names = {s.name for s in receiver.snapshot()}
    assert not [n for n in names if "heartbeat" in n or ".metrics." in n], sorted(names)


def scrape(state) -> dict[str, set[str]]:
    """Metric names each process exposes: families and the sample names they produce."""
    exposed = {}
    for p in state.processes:
        if not p.health_url:
            continue
        text = httpx.get(p.health_url.replace("/health", "/metrics"), timeout=10).text
        names = set()
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update({"counter": [family.name + "_total"],
                          "histogram": [family.name + s for s in ("_bucket", "_sum", "_count")]}.get(family.type, []))
            names.update(s.name for s in family.samples)
        exposed[p.name] = names
    return exposed


def test_every_metric_on_the_dashboard_is_exposed_by_a_service(traced, streamed):
    state, _ = traced
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    queried = {name for e in exprs for name in re.findall(r"\blayercast_[a-z0-9_]+", e)}
    assert len(queried) >= 15
    exposed = scrape(state)
    everything = set().union(*exposed.values())
    assert sorted(queried - everything) == []
    # Names follow layercast_<service>_<what>_<unit>, and each service exposes its own.
    services = {"gateway": "gateway", "registry": "registry", "planner": "planner",
                "load-monitor": "load_monitor", "worker-0": "worker"}
    for process, prefix in services.items():
        ours = {n for n in exposed[process] if n.startswith("layercast_")}
        assert ours and all(n.startswith(f"layercast_{prefix}_") for n in ours), (process, sorted(ours))
