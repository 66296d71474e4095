"""Tracing (OpenTelemetry), metrics (Prometheus) and the health/metrics HTTP endpoint."""

from libs.telemetry.setup import setup_logging, setup_tracing, tracer, unsampled
from libs.telemetry.http import HealthServer

__all__ = ["HealthServer", "setup_logging", "setup_tracing", "tracer", "unsampled"]
