"""`python -m services.worker`: run one worker."""

import argparse
import os
import socket

from libs.planning.sharing import SHARINGS
from libs.transfer.transports import TRANSPORTS
from services.common.runner import run
from services.worker.service import WorkerConfig, WorkerService


def main() -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(description="layercast worker")
    p.add_argument("--worker-id", default=env("LAYERCAST_WORKER_ID", socket.gethostname()))
    p.add_argument("--data-host", default=env("LAYERCAST_DATA_HOST", "127.0.0.1"))
    p.add_argument("--data-port", type=int, default=int(env("LAYERCAST_DATA_PORT", "0")))
    p.add_argument("--data-advertise-host", default=env("LAYERCAST_DATA_ADVERTISE_HOST") or None,
                   help="the address other workers dial (default: the data host, or this host's address "
                        "when the data host is a wildcard such as 0.0.0.0)")
    p.add_argument("--host", default=env("LAYERCAST_TOPOLOGY_HOST", socket.gethostname()))
    p.add_argument("--leaf", default=env("LAYERCAST_TOPOLOGY_LEAF") or "leaf-0")  # k8s: "" without a zone label
    p.add_argument("--scaleup-group", default=env("LAYERCAST_TOPOLOGY_SCALEUP_GROUP", ""))
    p.add_argument("--link-gbps", type=float, default=float(env("LAYERCAST_LINK_GBPS", "10")))
    p.add_argument("--host-capacity-gb", type=float, default=float(env("LAYERCAST_HOST_CAPACITY_GB", "8")))
    p.add_argument("--host-cache-models", type=int, default=int(env("LAYERCAST_HOST_CACHE_MODELS", "0")),
                   help="models the host tier keeps at most, least recently used out first (pinned "
                        "blocks stay); 0: bounded by --host-capacity-gb only")
    p.add_argument("--host-arena-gb", type=float, default=float(env("LAYERCAST_HOST_ARENA_GB", "0")),
                   help="host memory reserved (faulted in) at start for loaded blocks; 0: allocate per load")
    p.add_argument("--engine-capacity-gb", type=float, default=float(env("LAYERCAST_ENGINE_CAPACITY_GB", "8")))
    p.add_argument("--heartbeat-interval", type=float, default=float(env("LAYERCAST_HEARTBEAT_INTERVAL", "1")))
    p.add_argument("--device", default=env("LAYERCAST_DEVICE", "cpu"), help="cpu or cuda[:n]")
    p.add_argument("--load-chunk-mib", type=int, default=int(env("LAYERCAST_LOAD_CHUNK_MIB", "16")))
    p.add_argument("--load-threads", type=int, default=int(env("LAYERCAST_LOAD_THREADS", "4")))
    p.add_argument("--serve-while-loading", action=argparse.BooleanOptionalAction,
                   default=env("LAYERCAST_SERVE_WHILE_LOADING", "1") not in ("0", "false", "no"),
                   help="announce an instance after its first block and run blocks as they arrive")
    p.add_argument("--transport", choices=list(TRANSPORTS), default=env("LAYERCAST_TRANSPORT", "tcp"),
                   help="block transfers between workers: tcp, or rdma (the rdma extra and an RDMA device)")
    p.add_argument("--rdma-device", default=env("LAYERCAST_RDMA_DEVICE") or None)
    p.add_argument("--kv-cache-gb", type=float, default=float(env("LAYERCAST_KV_CACHE_GB", "1")),
                   help="KV cache per instance, pre-allocated: it bounds the requests running at once")
    p.add_argument("--torch-threads", type=int, default=int(env("LAYERCAST_TORCH_THREADS", "0")))
    p.add_argument("--emulated-host-to-device-mbit", type=float,
                   default=float(env("LAYERCAST_EMULATED_HOST_TO_DEVICE_MBIT", "0")),
                   help="emulation only: pace host->device copies to this rate (Mbit/s), standing in "
                        "for PCIe on a CPU-only worker; 0: off")
    p.add_argument("--emulated-link-mbit", type=float, default=float(env("LAYERCAST_EMULATED_LINK_MBIT", "0")),
                   help="emulation without root: pace this worker's block sends to this rate (Mbit/s, tcp); "
                        "0: off")
    p.add_argument("--sharing", choices=list(SHARINGS), default=env("LAYERCAST_SHARING", WorkerConfig.sharing),
                   help="exclusive: engines step in turn on fixed KV caches; mesh (LLM-Mesh): one headroom "
                        "scheduler over every instance here, admission by shadow validation; dedicated: one "
                        "model at a time (another model's load unloads it first)")
    p.add_argument("--shadow-validation", action=argparse.BooleanOptionalAction,
                   default=env("LAYERCAST_SHADOW_VALIDATION", "1") not in ("0", "false", "no"),
                   help="with --sharing mesh: refuse a request that would push any request here past its SLO")
    p.add_argument("--preemption", action=argparse.BooleanOptionalAction,
                   default=env("LAYERCAST_PREEMPTION", "1") not in ("0", "false", "no"),
                   help="with shadow validation: a refused request may move smaller instances' requests elsewhere")
    p.add_argument("--profile-max-len", type=int, default=int(env("LAYERCAST_PROFILE_MAX_LEN", "512")),
                   help="with --sharing mesh: the longest prompt a model's profile samples")
    p.add_argument("--profile-refresh-s", type=float, default=float(env("LAYERCAST_PROFILE_REFRESH_S", "0")),
                   help="with --sharing mesh: refresh the profiles from live steps this often (0: never, "
                        "the default)")
    p.add_argument("--memory-capacity-bytes", type=int,
                   default=int(env("LAYERCAST_MEMORY_CAPACITY_BYTES", "0")),
                   help="with --sharing mesh: the bytes this worker's engines may hold (weights and KV "
                        "caches); model loads and KV growth that would pass it wait or are refused. "
                        "0: the memory available at start (on CUDA, less --device-working-gb)")
    p.add_argument("--device-working-gb", type=float, default=float(env("LAYERCAST_DEVICE_WORKING_GB", "1")),
                   help="with --sharing mesh on CUDA: device memory the default capacity leaves for the forward "
                        "pass (activations, cuBLAS workspaces), which the mesh does not charge")
    p.add_argument("--kv-watermark", type=float, default=float(env("LAYERCAST_KV_WATERMARK", "0.2")),
                   help="with --sharing mesh: a KV cache grows to its need x (1 + w) and shrinks only "
                        "once that is below its size / (1 + w)")
    p.add_argument("--kv-min-slots", type=int, default=int(env("LAYERCAST_KV_MIN_SLOTS", "0")),
                   help="with --sharing mesh: elastic KV, the KV slots an instance keeps however idle (L_min); "
                        "0: KV fixed at the instance's ceiling")
    p.add_argument("--local-checkpoints", action="append",
                   default=[d for d in env("LAYERCAST_LOCAL_CHECKPOINTS", "").split(os.pathsep) if d],
                   help="a directory on this worker's local disk holding checkpoints (repeatable; the "
                        "environment: a path list): deployed models under it are reported in the ssd tier. "
                        "None given: every deployed model path this worker can read counts as local")
    p.add_argument("--health-host", default=env("LAYERCAST_HEALTH_HOST", "127.0.0.1"))
    p.add_argument("--health-port", type=int, default=int(env("LAYERCAST_HEALTH_PORT", "0")))
    a = p.parse_args()
    config = WorkerConfig(
        worker_id=a.worker_id, data_host=a.data_host, data_port=a.data_port,
        data_advertise_host=a.data_advertise_host, host=a.host, leaf=a.leaf,
        scaleup_group=a.scaleup_group, link_gbps=a.link_gbps,
        host_capacity_bytes=int(a.host_capacity_gb * (1 << 30)),
        host_cache_models=a.host_cache_models, host_arena_bytes=int(a.host_arena_gb * (1 << 30)),
        engine_capacity_bytes=int(a.engine_capacity_gb * (1 << 30)),
        heartbeat_interval_s=a.heartbeat_interval, torch_threads=a.torch_threads,
        device=a.device, serve_while_loading=a.serve_while_loading, load_chunk_bytes=a.load_chunk_mib << 20,
        load_threads=a.load_threads, transport=a.transport, rdma_device=a.rdma_device,
        kv_cache_bytes=int(a.kv_cache_gb * (1 << 30)),
        emulated_host_to_device_mbit=a.emulated_host_to_device_mbit, emulated_link_mbit=a.emulated_link_mbit,
        sharing=a.sharing, shadow_validation=a.shadow_validation, preemption=a.preemption,
        profile_max_len=a.profile_max_len,
        profile_refresh_s=a.profile_refresh_s, memory_capacity_bytes=a.memory_capacity_bytes,
        device_working_bytes=int(a.device_working_gb * (1 << 30)),
        kv_watermark=a.kv_watermark, kv_min_slots=a.kv_min_slots,
        local_checkpoint_dirs=tuple(a.local_checkpoints),
    )
    run(lambda: WorkerService(config), a.health_host, a.health_port)


if __name__ == "__main__":
    main()
