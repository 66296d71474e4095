"""`python -m services.load_monitor`: run the load-monitor."""

import argparse
import os

from services.common.runner import run
from services.load_monitor.service import DEFAULT_SCALE_DOWN_DELAY_S, LoadMonitorService


def main() -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(description="layercast load-monitor")
    p.add_argument("--tick", type=float, default=float(env("LAYERCAST_MONITOR_TICK", "0.1")))
    p.add_argument("--target-concurrency", type=int, default=int(env("LAYERCAST_TARGET_CONCURRENCY", "8")))
    p.add_argument("--scale-down-delay", type=float,
                   default=float(env("LAYERCAST_SCALE_DOWN_DELAY", str(DEFAULT_SCALE_DOWN_DELAY_S))),
                   help="seconds the policy must want fewer instances before a scale-in is requested, for "
                        "policies without a scale-down timeout of their own (concurrency) where the deployment "
                        "sets no scale_down_delay_s parameter")
    p.add_argument("--health-host", default=env("LAYERCAST_HEALTH_HOST", "127.0.0.1"))
    p.add_argument("--health-port", type=int, default=int(env("LAYERCAST_HEALTH_PORT", "0")))
    a = p.parse_args()
    run(lambda: LoadMonitorService(tick_s=a.tick, target_concurrency=a.target_concurrency,
                                   scale_down_delay_s=a.scale_down_delay),
        a.health_host, a.health_port)


if __name__ == "__main__":
    main()
