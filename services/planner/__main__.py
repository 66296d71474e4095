"""`python -m services.planner`: run the planner."""

import argparse
import dataclasses
import os

from libs.planning.scaleout import SERVERLESSLLM_KEEP_ALIVE_S
from libs.planning.sharing import SHARINGS
from services.common.runner import run
from services.planner.service import TIMERS, PlannerService


def main() -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(description="layercast planner")
    p.add_argument("--drain-timeout", type=float, default=float(env("LAYERCAST_DRAIN_TIMEOUT", "30")))
    p.add_argument("--serverlessllm-keep-alive", type=float,
                   default=float(env("LAYERCAST_SERVERLESSLLM_KEEP_ALIVE", str(SERVERLESSLLM_KEEP_ALIVE_S))),
                   help="seconds the serverlessllm mode's host cache keeps a stopped model (15: λScale; 300: BlitzScale)")
    p.add_argument("--sharing", choices=list(SHARINGS), default=env("LAYERCAST_SHARING", "exclusive"),
                   help="the cluster's sharing setting; dedicated: one model per worker at a time (a worker "
                        "holding another model is taken only for a model's first instance)")
    p.add_argument("--transfer-stall", type=float,
                   default=float(env("LAYERCAST_TRANSFER_STALL_S", str(TIMERS.transfer_stall_s))),
                   help="seconds a receiver may get no byte of a transfer before its part fails and it reads "
                        "the rest from its disk (raise it over links slow enough that a source's other sends "
                        "hold a receiver's blocks back longer)")
    p.add_argument("--health-host", default=env("LAYERCAST_HEALTH_HOST", "127.0.0.1"))
    p.add_argument("--health-port", type=int, default=int(env("LAYERCAST_HEALTH_PORT", "0")))
    a = p.parse_args()
    if a.transfer_stall <= 0:
        p.error("--transfer-stall must be > 0")
    timers = dataclasses.replace(TIMERS, transfer_stall_s=a.transfer_stall)
    run(lambda: PlannerService(drain_timeout_s=a.drain_timeout, serverlessllm_keep_alive_s=a.serverlessllm_keep_alive,
                               timers=timers, sharing=a.sharing), a.health_host, a.health_port)


if __name__ == "__main__":
    main()
