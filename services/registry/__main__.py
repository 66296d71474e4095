"""`python -m services.registry`: run the registry service."""

import argparse
import os

from services.common.runner import run
from services.registry.service import RegistryService


def main() -> None:
    p = argparse.ArgumentParser(description="layercast registry")
    p.add_argument("--database-url", default=os.environ.get("DATABASE_URL"), required=not os.environ.get("DATABASE_URL"))
    p.add_argument("--heartbeat-ttl", type=float, default=float(os.environ.get("LAYERCAST_HEARTBEAT_TTL", "5")))
    p.add_argument("--health-host", default=os.environ.get("LAYERCAST_HEALTH_HOST", "127.0.0.1"))
    p.add_argument("--health-port", type=int, default=int(os.environ.get("LAYERCAST_HEALTH_PORT", "0")))
    a = p.parse_args()
    run(lambda: RegistryService(a.database_url, heartbeat_ttl_s=a.heartbeat_ttl), a.health_host, a.health_port)


if __name__ == "__main__":
    main()
