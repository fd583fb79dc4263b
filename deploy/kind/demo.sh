#!/usr/bin/env bash
# kv-router on a local kind cluster: creates the cluster, builds and loads the image, installs what
# the chosen path needs, applies the `sim` pods (4 simulated vLLM pods, CPU only), waits for
# readiness, port-forwards the entry point and runs `kv-bench compare --endpoint` against it.
#
#   deploy/kind/demo.sh [--path standalone-envoy|istio-envoyfilter|gateway-api] [--keep] [--name NAME]
#
# Needs on this machine: docker (running), kind, kubectl, cargo (builds kv-bench), and for the Istio
# paths istioctl. Everything else runs in the cluster. `--keep` leaves the cluster up afterwards
# (delete it with `kind delete cluster --name NAME`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="kv-router-demo"
DEMO_PATH="standalone-envoy"
KEEP=0
IMAGE="kv-router:demo"
LOCAL_PORT="${LOCAL_PORT:-8080}"
GATEWAY_API_VERSION="v1.6.1"
GIE_VERSION="v1.6.0"

die() { echo "demo.sh: error: $*" >&2; exit 1; }
log() { echo "==> $*" >&2; }

usage() {
  sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --path) [[ $# -ge 2 ]] || die "--path needs a value"; DEMO_PATH="$2"; shift 2 ;;
    --name) [[ $# -ge 2 ]] || die "--name needs a value"; CLUSTER="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "demo.sh: unknown argument: $1" >&2; usage 2 ;;
  esac
done

case "$DEMO_PATH" in
  standalone-envoy|istio-envoyfilter|gateway-api) ;;
  *) die "unknown --path '$DEMO_PATH' (standalone-envoy, istio-envoyfilter or gateway-api)" ;;
esac

need() {
  command -v "$1" >/dev/null 2>&1 || die "'$1' is not installed or not on PATH: $2"
}
need docker "install Docker (https://docs.docker.com/get-docker/)"
need kind "install kind (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
need kubectl "install kubectl (https://kubernetes.io/docs/tasks/tools/)"
need curl "install curl"
need cargo "install Rust (https://rustup.rs): kv-bench runs on this machine"
if [[ "$DEMO_PATH" != standalone-envoy ]]; then
  need istioctl "install istioctl (https://istio.io/latest/docs/setup/getting-started/#download)"
fi
docker info >/dev/null 2>&1 || die "docker is installed but the daemon is not reachable (is it running? may this user use it?)"

CTX="kind-$CLUSTER"
k() { kubectl --context "$CTX" "$@"; }

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "kind cluster $CLUSTER exists; reusing it"
else
  log "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" --config "$ROOT/deploy/kind/kind-config.yaml" --wait 120s
fi

log "building $IMAGE (kv-router + vllm-sim) and loading it into the cluster"
docker build -t "$IMAGE" "$ROOT"
kind load docker-image "$IMAGE" --name "$CLUSTER"

case "$DEMO_PATH" in
  istio-envoyfilter)
    log "installing Istio (default profile: istiod + ingress gateway)"
    istioctl --context "$CTX" install -y --set profile=default
    ;;
  gateway-api)
    log "installing Gateway API $GATEWAY_API_VERSION and InferencePool $GIE_VERSION CRDs"
    k apply --server-side -f "https://github.com/kubernetes-sigs/gateway-api/releases/download/$GATEWAY_API_VERSION/standard-install.yaml"
    k apply --server-side -f "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/$GIE_VERSION/manifests.yaml"
    log "installing Istio with Gateway API Inference Extension support"
    istioctl --context "$CTX" install -y --set profile=minimal \
      --set values.pilot.env.PILOT_ENABLE_GATEWAY_API=true \
      --set values.pilot.env.ENABLE_GATEWAY_API_INFERENCE_EXTENSION=true
    ;;
esac

# The chosen path + the simulated pods, with the freshly built image (kustomize wants relative
# paths, so the kustomization lives under target/).
mkdir -p "$ROOT/target"
WORK="$(mktemp -d "$ROOT/target/kind-demo.XXXXXX")"
PF_PID=""
cleanup() {
  if [[ -n "$PF_PID" ]]; then kill "$PF_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
  if [[ "$KEEP" == 0 ]]; then
    log "deleting kind cluster $CLUSTER (pass --keep to leave it up)"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
cat >"$WORK/kustomization.yaml" <<KUSTOMIZATION
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- ../../deploy/base
components:
- ../../deploy/components/$DEMO_PATH
- ../../deploy/components/sim
images:
- name: ghcr.io/example/kv-router
  newName: ${IMAGE%%:*}
  newTag: ${IMAGE##*:}
KUSTOMIZATION
log "applying $DEMO_PATH + sim"
k apply -k "$WORK"

log "waiting for the simulated pods and kv-router"
k -n llm rollout status deployment/vllm-sim --timeout=300s
k -n llm rollout status deployment/kv-router --timeout=300s

case "$DEMO_PATH" in
  standalone-envoy)
    k -n llm rollout status deployment/envoy --timeout=300s
    TARGET=(-n llm service/envoy)
    ;;
  istio-envoyfilter)
    k -n istio-system rollout status deployment/istio-ingressgateway --timeout=300s
    TARGET=(-n istio-system service/istio-ingressgateway)
    ;;
  gateway-api)
    k -n llm wait --for=condition=Programmed gateway/llm-gateway --timeout=300s
    TARGET=(-n llm service/llm-gateway-istio)
    ;;
esac

log "port-forwarding ${TARGET[*]} to 127.0.0.1:$LOCAL_PORT"
k port-forward "${TARGET[@]}" "$LOCAL_PORT:80" >"$WORK/port-forward.log" 2>&1 &
PF_PID=$!
for _ in $(seq 1 50); do
  if curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/models" >/dev/null 2>&1; then break; fi
  kill -0 "$PF_PID" 2>/dev/null || die "port-forward exited: $(cat "$WORK/port-forward.log")"
  sleep 0.2
done
curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/models" >/dev/null || die "http://127.0.0.1:$LOCAL_PORT/v1/models does not answer"

log "building kv-bench"
cargo build --release --manifest-path "$ROOT/Cargo.toml" --bin kv-bench
log "kv-bench compare against the cluster ($DEMO_PATH)"
"$ROOT/target/release/kv-bench" compare --pods 4 --endpoint "kind-$DEMO_PATH=http://127.0.0.1:$LOCAL_PORT"
log "done. kv-router's view: kubectl --context $CTX -n llm port-forward deploy/kv-router 9090 && curl 127.0.0.1:9090/debug/pods"
