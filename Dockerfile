# syntax=docker/dockerfile:1
#
# ngstone edge image: a static binary on distroless, running as non-root.
#   docker build --build-arg VERSION=$(git describe --tags --always) \
#                --build-arg COMMIT=$(git rev-parse HEAD) -t ngstone .
#   docker run -p 80:80 -p 443:443 -p 4443:4443 -v ngstone-data:/data \
#              -e NGSTONE_DOMAIN=tunnels.example.com ngstone
# Every flag of `ngstone edge` is also an NGSTONE_* environment variable;
# see examples/docker-compose.yml.

FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
ARG VERSION=dev
ARG COMMIT=unknown
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false \
      -ldflags "-s -w -X main.version=${VERSION} -X main.commit=${COMMIT}" \
      -o /out/ngstone ./cmd/ngstone \
 && /out/ngstone version \
 && mkdir /out/data

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ngstone /usr/local/bin/ngstone
# The volume's mount point belongs to the nonroot user (65532), so a fresh
# named volume is writable: the self-signed CA, ACME account and
# certificates live here. Nothing else in the image is written to.
COPY --from=build --chown=65532:65532 /out/data /data
ENV NGSTONE_DATA_DIR=/data
VOLUME /data
# Visitors (HTTP, HTTPS) and agents (TLS control). Docker lets a non-root
# process bind ports below 1024 in its network namespace
# (net.ipv4.ip_unprivileged_port_start=0 since Docker 20.10). The admin API
# (/healthz, /metrics, /api/tunnels) stays on 127.0.0.1:9180 unless
# NGSTONE_ADMIN_ADDR says otherwise (then NGSTONE_ADMIN_TOKEN is required).
EXPOSE 80 443 4443
USER 65532:65532
# Asks the admin /healthz (at $NGSTONE_ADMIN_ADDR, default 127.0.0.1:9180);
# exits non-zero when the edge does not answer ok.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/ngstone", "healthcheck"]
# SIGTERM (docker stop) shuts down gracefully: agents are told to go away
# and reconnect, in-flight requests get --shutdown-grace (30s) to finish, so
# give docker stop a longer timeout (-t 40, or stop_grace_period in compose).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/ngstone", "edge"]
