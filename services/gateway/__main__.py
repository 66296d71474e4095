"""`python -m services.gateway`: run the HTTP gateway."""

import os
import sys

# The gateway only tokenizes, and transformers without torch loads the same tokenizers: when it
# finds torch it imports it (seconds), which a restarted gateway would spend before its first
# answer (issue 40). None in sys.modules makes torch absent to transformers' checks, and an
# `import torch` fail loudly. Its advisory "PyTorch was not found" is for model users: not shown.
sys.modules.setdefault("torch", None)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse  # noqa: E402 (after the torch guard, as are all below)

from libs.planning.sharing import SHARINGS, sharing_setting  # noqa: E402
from libs.protocol import subjects  # noqa: E402
from libs.telemetry import setup_logging, setup_tracing  # noqa: E402
from services.gateway.app import create_app  # noqa: E402
from services.gateway.server import serve  # noqa: E402
from services.gateway.service import GatewayConfig, GatewayService  # noqa: E402


def _keys(value: str | None, name: str) -> list[str]:
    keys = [k.strip() for k in (value or "").split(",") if k.strip()]
    if not keys:
        raise SystemExit(f"set {name} (comma-separated keys)")
    return keys


def main() -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(description="layercast gateway")
    p.add_argument("--host", default=env("LAYERCAST_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("LAYERCAST_GATEWAY_PORT", "8000")))
    p.add_argument("--queue-timeout", type=float, default=float(env("LAYERCAST_QUEUE_TIMEOUT", "120")))
    p.add_argument("--slots-per-instance", type=int, default=int(env("LAYERCAST_SLOTS_PER_INSTANCE", "32")))
    p.add_argument("--max-context", type=int, default=int(env("LAYERCAST_MAX_CONTEXT", "2048")))
    p.add_argument("--max-body-bytes", type=int,
                   default=int(env("LAYERCAST_MAX_BODY_BYTES", GatewayConfig.max_body_bytes)),
                   help="larger request bodies are refused (413) unread")
    p.add_argument("--tokenizer-threads", type=int,
                   default=int(env("LAYERCAST_TOKENIZER_THREADS", GatewayConfig().tokenizer_threads)),
                   help="threads that tokenize large prompts off the event loop")
    p.add_argument("--key-cache-s", type=float, default=float(env("LAYERCAST_KEY_CACHE_S", GatewayConfig.key_cache_s)),
                   help="how long a registry API key's lookup is trusted (how late a revocation can be)")
    p.add_argument("--max-n", type=int, default=int(env("LAYERCAST_MAX_N", GatewayConfig.max_n)),
                   help="choices (n) per request at most; each takes a KV slot")
    p.add_argument("--sharing", choices=list(SHARINGS), default=env("LAYERCAST_SHARING", GatewayConfig.sharing),
                   help="exclusive: least-loaded routing; mesh (LLM-Mesh, models sharing workers): bin-packing "
                        "routing, and workers may refuse a request as busy; dedicated: one model per worker "
                        "at a time, least-loaded routing")
    p.add_argument("--max-messages", type=int,
                   default=int(env("LAYERCAST_MAX_MESSAGES", GatewayConfig.max_messages)),
                   help="chat messages per request at most (content parts, tool calls and tools count too)")
    p.add_argument("--max-token-ids", type=int,
                   default=int(env("LAYERCAST_MAX_TOKEN_IDS", GatewayConfig.max_token_ids)),
                   help="token ids in a prompt (or /detokenize list) at most")
    p.add_argument("--header-timeout", type=float,
                   default=float(env("LAYERCAST_HEADER_TIMEOUT_S", GatewayConfig.header_timeout_s)),
                   help="seconds for a request's headers to arrive; the connection is closed after")
    p.add_argument("--body-timeout", type=float,
                   default=float(env("LAYERCAST_BODY_TIMEOUT_S", GatewayConfig.body_timeout_s)),
                   help="seconds for a request's body to arrive after its headers; 408 after")
    p.add_argument("--max-connections", type=int,
                   default=int(env("LAYERCAST_MAX_CONNECTIONS", GatewayConfig.max_connections)),
                   help="open connections at most; a request beyond them is answered 503")
    a = p.parse_args()
    try:  # argparse checks choices on the flag, not on a default from the env
        sharing_setting(a.sharing)
    except ValueError as e:
        p.error(f"LAYERCAST_SHARING: {e}")
    setup_logging("gateway")
    setup_tracing("gateway", subjects.QUIET_SUBJECTS)
    config = GatewayConfig(queue_timeout_s=a.queue_timeout, slots_per_instance=a.slots_per_instance,
                           max_context=a.max_context, max_body_bytes=a.max_body_bytes,
                           tokenizer_threads=a.tokenizer_threads, key_cache_s=a.key_cache_s,
                           max_n=a.max_n, sharing=a.sharing, max_messages=a.max_messages,
                           max_token_ids=a.max_token_ids, header_timeout_s=a.header_timeout,
                           body_timeout_s=a.body_timeout, max_connections=a.max_connections)
    app = create_app(GatewayService(config), _keys(env("LAYERCAST_API_KEYS"), "LAYERCAST_API_KEYS"),
                     _keys(env("LAYERCAST_ADMIN_KEYS"), "LAYERCAST_ADMIN_KEYS"))
    serve(app, host=a.host, port=a.port, log_level=env("LAYERCAST_LOG_LEVEL", "info").lower(),
          header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s,
          max_connections=config.max_connections)


if __name__ == "__main__":
    main()
