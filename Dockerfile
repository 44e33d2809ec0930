# syntax=docker/dockerfile:1
# hcp-sense: the same gates as CI (rustfmt, clippy), then a release build, on a distroless runtime.
#   docker build -t hcp-sense:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9464:9464 -e HCP_SENSE_DATABASE_URL=postgres://… \
#     hcp-sense:0.1.0 serve --listen 0.0.0.0:50051 --metrics-listen 0.0.0.0:9464 …
# The Helm chart (helm/hcp-sense) runs this image as 65532 with a read-only root filesystem.

FROM rust:1.95-bookworm AS builder
ENV CARGO_TERM_COLOR=never
RUN rustup component add rustfmt clippy
WORKDIR /src
# The whole workspace (".", "api" and "migrations"; fuzz/ is excluded from it): clippy's
# --all-targets compiles the integration tests too, and api/build.rs compiles proto/.
COPY Cargo.toml Cargo.lock ./
COPY proto/ proto/
COPY api/ api/
COPY migrations/ migrations/
COPY src/ src/
COPY .cargo/ .cargo/
COPY examples/ examples/
COPY tests/ tests/
# Verbatim the commands of .ci/run, then the release build it also runs.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    cargo fmt --all -- --check
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    cargo clippy --workspace --all-targets --locked -- -D warnings
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    cargo build --release --locked --bin hcp-sense

# glibc and libgcc, no shell, user "nonroot" (65532).
FROM gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="hcp-sense" \
      org.opencontainers.image.description="Control plane for the Sense loop (§7) of the Harness Context Protocol" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12:nonroot"
COPY --from=builder /src/target/release/hcp-sense /usr/local/bin/hcp-sense
USER 65532:65532
# gRPC; /metrics, /healthz and /readyz. The binary listens on loopback unless told otherwise
# (--listen / --metrics-listen, or listen / metrics_listen in the --config file).
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/hcp-sense"]
CMD ["serve"]
