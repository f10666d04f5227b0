# shardrun: static runner and coordinator binaries, and probe (the health
# check: the image has no shell), on a distroless base, as a non-root user.
#   docker build -t shardrun .
# Both base images are the upstream ones; `make deploy-test` builds local
# stand-ins under the same names where no registry is reachable
# (deploy/standins/build.sh).
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/ ./cmd/runner ./cmd/coordinator ./cmd/probe

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/runner /out/coordinator /out/probe /usr/local/bin/
USER nonroot:nonroot
# 8080: coordinator API and status page; 9090: runner admin endpoint.
EXPOSE 8080 9090
CMD ["runner", "--help"]
