# syntax=docker/dockerfile:1
# The images of poolpilot's binaries, one Dockerfile for all: BIN names the binary, PORTS the
# ports it listens on. Build from the workspace root (the build needs the whole workspace and its
# Cargo.lock; `cargo build --bin BIN` compiles only that binary's package and its dependencies):
#   docker build --build-arg BIN=poolpilot-gateway  --build-arg PORTS="8080 9901" -t REGISTRY/poolpilot/gateway:TAG .
#   docker build --build-arg BIN=poolpilot-operator --build-arg PORTS=8080 -t REGISTRY/poolpilot/operator:TAG .
#   docker build --build-arg BIN=modelsim --build-arg PORTS="8000 8001" -t REGISTRY/poolpilot/modelsim:TAG .
# The gateway: the data plane (proxy on 8080, admin API + /metrics on 9901). The operator: the
# controller (/metrics and /healthz on 8080). modelsim: the simulated OpenAI-style model server of
# manifests/samples (serving 8000, admin 8001).
# A fully static musl binary (rustls, no OpenSSL), on `scratch` with the file tree of
# images/rootfs.sh (the binary as /usr/local/bin/BIN and /usr/local/bin/entrypoint, a link to
# it; /etc/passwd with the non-root user 65532; the CA bundle; /tmp), running as 65532. Works
# with readOnlyRootFilesystem: the binaries write nothing to disk.
# The last stage is images/Containerfile line for line (`make image-test` compares them), the
# file `make images` builds offline with buildah from the binaries of this workspace; the one
# difference in what comes out: those are linked against glibc, so their images also carry the
# libraries `ldd` names, where this static binary needs none.

FROM rust:1.95.0-alpine AS build
ARG BIN
# musl-dev for the C runtime; clang/cmake/perl/make for the C parts of the crypto crates (ring,
# aws-lc); bash and ca-certificates for images/rootfs.sh.
RUN apk add --no-cache musl-dev clang cmake perl make bash ca-certificates
WORKDIR /src
COPY . .
# rust-toolchain.toml pins 1.95.0 (the image's toolchain); skip its rustfmt/clippy components.
ENV RUSTUP_TOOLCHAIN=1.95.0 CARGO_TERM_COLOR=never
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    test -n "$BIN" || { echo "--build-arg BIN=<binary> is required" >&2; exit 1; } \
 && cargo build --release --locked --bin "$BIN" \
 && ! ldd "target/release/$BIN" 2>/dev/null | grep -q '=>' \
 && images/rootfs.sh "target/release/$BIN" /rootfs

FROM scratch: the file tree images/rootfs.sh lays out in
# rootfs/ (the binary, its libraries if it has any, /etc/passwd with the user 65532, the CA
# bundle, /tmp), running as 65532:65532. `make images` builds it offline with buildah, once per
# binary; the Dockerfile's last stage is these same lines (e2e/tests/images.rs compares them).
#   BIN      the binary's name (poolpilot-gateway, poolpilot-operator, modelsim)
#   PORTS    the ports it listens on
#   VERSION, REVISION, SOURCE   the OCI labels
FROM scratch
ARG BIN
ARG PORTS
ARG VERSION=0.0.0
ARG REVISION=unknown
ARG SOURCE
COPY --from=build /rootfs/ /
LABEL org.opencontainers.image.title="$BIN" \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.revision="$REVISION" \
      org.opencontainers.image.source="$SOURCE" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 65532:65532
EXPOSE $PORTS
ENTRYPOINT ["/usr/local/bin/entrypoint"]
