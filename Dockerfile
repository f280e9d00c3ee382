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
# A fully static musl binary (rustls, no OpenSSL) on distroless/static, running as non-root
# 65532, as /usr/local/bin/BIN (and /usr/local/bin/entrypoint, a link to it). Works with
# readOnlyRootFilesystem: the binaries write nothing to disk.

FROM rust:1.95.0-alpine AS build
ARG BIN
# musl-dev for the C runtime; clang/cmake/perl/make for the C parts of the crypto crates (ring, aws-lc).
RUN apk add --no-cache musl-dev clang cmake perl make
WORKDIR /src
COPY . .
# rust-toolchain.toml pins 1.95.0 (the image's toolchain); skip its rustfmt/clippy components.
ENV RUSTUP_TOOLCHAIN=1.95.0 CARGO_TERM_COLOR=never
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    test -n "$BIN" || { echo "--build-arg BIN=<binary> is required" >&2; exit 1; } \
 && cargo build --release --locked --bin "$BIN" \
 && install -D -m 0755 "target/release/$BIN" "/out/bin/$BIN" \
 && ln -s "$BIN" /out/bin/entrypoint \
 && ! ldd "/out/bin/$BIN" 2>/dev/null | grep -q '=>'

FROM gcr.io/distroless/static-debian12:nonroot
ARG BIN
ARG PORTS
LABEL org.opencontainers.image.title="$BIN"
# The binary under its own name (`kubectl exec ... -- poolpilot-gateway validate ...` works) and
# `entrypoint`, a link to it: an exec-form ENTRYPOINT cannot expand a build argument.
COPY --from=build /out/bin/ /usr/local/bin/
USER 65532:65532
EXPOSE $PORTS
ENTRYPOINT ["/usr/local/bin/entrypoint"]
