# syntax=docker/dockerfile:1@sha256:ecfaec9ed6d810b56388c508f4121597bfbba70d41a6dfeee4d8cad5f295fc32
# kv-router image: /usr/local/bin/kv-router (the picker) and /usr/local/bin/vllm-sim (simulated
# vLLM pods for the kind demo and CPU-only tests). Build: `make image` (docker build).
# The deploy/ manifests run kv-router as `serve --config /etc/kv-router` and vllm-sim by command.
# Base images are pinned by digest (the tag says which release it is): a rebuild of the same
# commit gets the same toolchain and runtime. Bump tag and digest together.

FROM rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1 AS build
# g++/make build the vendored libzmq (zeromq-src) and Oniguruma (onig_sys); protoc is vendored.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /build
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto/ proto/
COPY src/ src/
COPY benches/ benches/
# every workspace member's manifest and sources must be present for cargo to load the workspace
COPY crates/ crates/
# The image has no .git: `make image` passes the checkout's revision for `kv-router --version`.
ARG KV_ROUTER_GIT_REVISION=""
ENV KV_ROUTER_GIT_REVISION=${KV_ROUTER_GIT_REVISION}
# Debug info is dropped (the release profile keeps it for profiling: ~10x the size); symbol
# names stay, so a panic's backtrace still names its functions.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/build/target \
    cargo build --release --locked -p kv-router -p vllm-sim --bin kv-router --bin vllm-sim \
 && mkdir -p /out \
 && strip --strip-debug -o /out/kv-router target/release/kv-router \
 && strip --strip-debug -o /out/vllm-sim target/release/vllm-sim \
 && /out/kv-router --version

# glibc + libstdc++ (libzmq is C++), no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot@sha256:9dac0a79194e45a7da0158a9c6da57b217585af0786db3845d1f0ec1a0dd182f
COPY --from=build /out/kv-router /out/vllm-sim /usr/local/bin/
COPY README.md /usr/share/doc/kv-router/
USER 65532:65532
# 9002: ext_proc + Pick + grpc.health.v1; 9090: /metrics /readyz /debug/* (keep off the data plane)
EXPOSE 9002 9090
ENTRYPOINT ["/usr/local/bin/kv-router"]
CMD ["serve", "--config", "/etc/kv-router"]
