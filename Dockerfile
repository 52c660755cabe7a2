FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake git curl \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 gateway
USER gateway
WORKDIR /home/gateway/app

COPY --chown=gateway:gateway requirements/ requirements/
COPY --chown=gateway:gateway pyproject.toml config.yaml ./
COPY --chown=gateway:gateway scripts/ scripts/
COPY --chown=gateway:gateway gateway/ gateway/
COPY --chown=gateway:gateway adapters/ adapters/
COPY --chown=gateway:gateway policies/ policies/

# Builds llama-cpp-python for the build host's CPU features (never AMX), or for the flags given
# with --build-arg LLAMA_CMAKE_ARGS=..., and provisions the models into the image.
ARG LLAMA_CMAKE_ARGS=""
RUN ./scripts/setup.sh

ENV GATEWAY_SERVER__HOST=0.0.0.0
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD curl -fsS http://127.0.0.1:8000/health/ready || exit 1
CMD [".venv/bin/python", "-m", "gateway", "serve", "--config", "config.yaml"]
