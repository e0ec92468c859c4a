# kappa-gateway: the gateway and the mock vLLM backends, one image (docker-compose.yml runs both).
#   docker build -t kappa-gateway:local .
#   docker run --rm -p 8000:8000 kappa-gateway:local kappa-gateway serve --config /app/config/fleet.local.yaml --host 0.0.0.0
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app

# Dependencies first, read from pyproject.toml, so a source change does not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The source tree stays at /app and is installed in editable mode: fleet_config/catalog.py reads the
# model and hardware catalogs from config/ beside the packages (CONFIG_DIR = parents[1] of
# fleet_config/catalog.py), which a regular install into site-packages would leave behind.
COPY setup.py ./
COPY hot_path/ hot_path/
COPY gateway/ gateway/
COPY dispatch/ dispatch/
COPY fleet_config/ fleet_config/
COPY router/ router/
COPY prefix_index/ prefix_index/
COPY mock_vllm/ mock_vllm/
COPY sim/ sim/
COPY tokenization/ tokenization/
COPY config/ config/
# The models' tokenizers a config may name (models.<m>.tokenizer), e.g. the mock's kappa-mock-bpe.
COPY assets/tokenizers/ assets/tokenizers/
# The per-request hot path is compiled (mypyc and C: setup.py, hot_path) with a compiler and
# xxhash.h (hot_path.BUILD_PACKAGES) that are removed again in the same layer; without them it would
# install as pure Python. `kappa-gateway hot-path --require-compiled` imports every hot-path module
# and fails the image's build (exit 1) unless each one runs compiled: a partial build (a missing
# xxhash.h, a mypyc failure, the mypyc group library missing beside its shims) does not ship.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libxxhash-dev \
    && pip install --no-cache-dir --no-deps -e . \
    && apt-get purge -y --auto-remove gcc libc6-dev libxxhash-dev \
    && rm -rf /var/lib/apt/lists/* build/ \
    && python -c "from fleet_config.catalog import default_catalog; default_catalog()" \
    && kappa-gateway hot-path --require-compiled

RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kappa
USER kappa

EXPOSE 8000

# No curl in the slim image: the stdlib's urlopen raises (exit 1, unhealthy) on a refused
# connection, a timeout or a non-2xx status. Mock backends override this in docker-compose.yml.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]

CMD ["kappa-gateway", "serve", "--config", "/app/config/fleet.compose.yaml", "--host", "0.0.0.0"]
