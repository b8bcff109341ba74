# syntax=docker/dockerfile:1
# Build: docker build -t traffic-policy-operator:0.1.0 .   (see docs/operations.md)

# --- build: a pinned Rust toolchain ---
# Base images are pinned by digest (tag kept for readers); docs/operations.md, "The image", says
# how to refresh them.
FROM rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1 AS build
WORKDIR /src
# Dependencies first, in their own layer: a change to src/ does not rebuild them.
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY loadtest/Cargo.toml loadtest/Cargo.toml
COPY loadtest/controlplane/Cargo.toml loadtest/controlplane/Cargo.toml
# Every workspace member's manifest (Cargo.toml's `members`), or the workspace does not load;
# the load test's stubs stay, since its sources are never copied.
COPY crates/sharded-runtime/Cargo.toml crates/sharded-runtime/Cargo.toml
COPY crates/sharding/Cargo.toml crates/sharding/Cargo.toml
RUN mkdir -p src loadtest/src loadtest/controlplane/src crates/sharded-runtime/src crates/sharding/src \
    && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && echo 'fn main() {}' > loadtest/src/main.rs \
    && echo 'fn main() {}' > loadtest/controlplane/src/main.rs && touch loadtest/controlplane/src/lib.rs \
    && touch crates/sharded-runtime/src/lib.rs crates/sharding/src/lib.rs \
    && cargo build --release --locked -p traffic-policy-operator \
    && rm -rf src crates/sharded-runtime/src crates/sharding/src
# The real sources, and the release build of the operator only. The stubs above were built
# later than these files were written: touch them so cargo builds them again.
COPY src src
COPY crates crates
COPY crds crds
RUN touch src/main.rs src/lib.rs crates/sharded-runtime/src/lib.rs crates/sharding/src/lib.rs \
    && cargo build --release --locked -p traffic-policy-operator

# --- runtime: distroless, non-root ---
FROM gcr.io/distroless/cc-debian12:nonroot@sha256:9dac0a79194e45a7da0158a9c6da57b217585af0786db3845d1f0ec1a0dd182f
LABEL org.opencontainers.image.title="traffic-policy-operator" \
      org.opencontainers.image.description="Turns ApplicationTrafficPolicy objects into NetworkPolicies and gateway rate-limit ConfigMaps" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /src/target/release/traffic-policy-operator /usr/local/bin/traffic-policy-operator
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/traffic-policy-operator"]
