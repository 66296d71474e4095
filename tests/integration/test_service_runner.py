"""The services' common runner (services/common/runner.py) against a real NATS."""

import logging

from services.common.runner import Service


async def test_a_service_that_stops_does_not_report_a_lost_nats_connection(nats_url, caplog):
    """nats-py calls the disconnected callback on close too: a service's own stop must not log the
    warning that a lost connection gets (it misled a CI failure's reading)."""
    service = Service(nats_url)
    await service.start()
    with caplog.at_level(logging.INFO, logger="services.common.runner"):
        await service.stop()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "services.common.runner"]
    assert (logging.INFO, "service: NATS connection closed") in messages
    assert not [m for level, m in messages if level >= logging.WARNING]
