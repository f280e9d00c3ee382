# syntax=docker/dockerfile:1
# modelsim: the simulated OpenAI-style model server used by manifests/samples (serving 8000, admin 8001).
# Build from the workspace root (the image needs the whole workspace and its Cargo.lock):
#   docker build -f e2e/modelsim.Dockerfile -t ghcr.io/poolpilot/modelsim:dev .
# A fully static musl binary (rustls, no OpenSSL) on distroless/static, running as non-root
# 65532. Works with readOnlyRootFilesystem: the binary writes nothing to disk.

FROM rust:1.95.0-alpine AS build
# musl-dev for the C runtime; clang/cmake/perl/make for the C parts of the crypto crates (ring, aws-lc).
RUN apk add --no-cache musl-dev clang cmake perl make
WORKDIR /src
COPY . .
# rust-toolchain.toml pins 1.95.0 (the image's toolchain); skip its rustfmt/clippy components.
ENV RUSTUP_TOOLCHAIN=1.95.0 CARGO_TERM_COLOR=never
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p poolpilot-e2e --bin modelsim \
 && install -D -m 0755 target/release/modelsim /out/modelsim \
 && ! ldd /out/modelsim 2>/dev/null | grep -q '=>'

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/modelsim /usr/local/bin/modelsim
USER 65532:65532
EXPOSE 8000 8001
ENTRYPOINT ["/usr/local/bin/modelsim"]
