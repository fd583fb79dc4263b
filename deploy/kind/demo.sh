#!/usr/bin/env bash
# kv-router on a local kind cluster, end to end, and a result that shows whether it routes.
#
#   deploy/kind/demo.sh [--path standalone-envoy|istio-envoyfilter|gateway-api] [--keep] [--name NAME]
#
# Needs: docker (daemon running), kind, kubectl, curl, make, cargo; for the Istio paths istioctl
# of the pinned Istio version (ISTIO_VERSION below). In order: tools checked; the image built (make image) and kv-bench built on this
# machine; the cluster created (or reused when NAME exists); Istio and the CRDs the path needs;
# the path + 4 simulated vLLM pods (CPU only) + a round-robin Envoy applied; rollouts awaited;
# `kv-bench compare` runs the same workload through Envoy round robin and through kv-router
# (pod caches reset before each, hit ratio against the oracles); the run fails unless the pods'
# own prefix-cache counters give kv-router a hit ratio MIN_HIT_GAIN points above round robin's,
# and unless every router replica's decisions per pod equal each pod's own count of requests
# served in that run (gateway retries are off on the demo's routes, so one request = one attempt).
# A cluster this script created is deleted at the end unless --keep; an existing one is kept.
# Environment: LOCAL_PORT (default 8080; it and the 60 ports after it are used), ISTIO_VERSION
# (default: the pinned one), KV_BENCH_ARGS (extra kv-bench workload flags, e.g. "--sessions 32"),
# MIN_HIT_GAIN (default 10: percentage points; set it anew for another KV_BENCH_ARGS workload).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="kv-router-demo"
DEMO_PATH="standalone-envoy"
KEEP=0
IMAGE="kv-router:demo"
LOCAL_PORT="${LOCAL_PORT:-8080}"
# Pinned to the releases whose CRDs deploy/schemas vendors (deploy/schemas/SOURCES.md).
ISTIO_VERSION="${ISTIO_VERSION:-1.30.3}"
GATEWAY_API_VERSION="v1.6.1"
GIE_VERSION="v1.6.0"
SIM_PORT=8000   # the pods' `http` port: kv-router labels its decisions with ip:8000

die() { echo "demo.sh: error: $*" >&2; exit 1; }
log() { echo "==> $*" >&2; }
# kv-router's hit ratio must beat round robin's by this many percentage points. On the default
# workload (16 conversations x 8 turns on a 6 KB shared system prompt, 4 pods) round robin finds a
# conversation's history on the pod a turn lands on about one time in four; kv-router sends the
# turn to it. Measured on this workload (kv-bench compare, 3 rounds; deploy/README.md, "kind
# demo"): kv-router 15.7 to 18.1 points above round robin, whose runs lie within 0.8 points of
# each other (a gateway that ignores kv-router's picks is round robin). 10 sits between the two.
MIN_HIT_GAIN="${MIN_HIT_GAIN:-10}"
[[ "$MIN_HIT_GAIN" =~ ^[0-9]+$ ]] ||
  die "MIN_HIT_GAIN must be a whole number of percentage points, not '$MIN_HIT_GAIN'"

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
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
ISTIO=0
if [[ "$DEMO_PATH" != standalone-envoy ]]; then ISTIO=1; fi

# ---- 1. tools, before anything runs ----
need() {
  command -v "$1" >/dev/null 2>&1 || die "'$1' is not installed or not on PATH: $2"
}
need docker "install Docker (https://docs.docker.com/get-docker/)"
need kind "install kind (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
need kubectl "install kubectl (https://kubernetes.io/docs/tasks/tools/)"
need curl "install curl"
need make "install make (builds the image: make image)"
need cargo "install Rust (https://rustup.rs): kv-bench runs on this machine"
if [[ "$ISTIO" == 1 ]]; then
  need istioctl "install istioctl $ISTIO_VERSION: curl -L https://istio.io/downloadIstio | ISTIO_VERSION=$ISTIO_VERSION sh -"
fi
docker info >/dev/null 2>&1 ||
  die "docker is installed but its daemon is not reachable (is it running? may this user use it?)"
if [[ "$ISTIO" == 1 ]]; then
  have="$(istioctl version --remote=false 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -n 1 || true)"
  [[ "$have" == "$ISTIO_VERSION" ]] ||
    die "istioctl is ${have:-of an unknown version}, this demo pins Istio $ISTIO_VERSION (istioctl installs its own version):" \
      "get it with 'curl -L https://istio.io/downloadIstio | ISTIO_VERSION=$ISTIO_VERSION sh -', or run with" \
      "ISTIO_VERSION=${have:-X.Y.Z} to try yours"
fi

# ---- 2. everything built on this machine comes before the cluster ----
log "building the image $IMAGE (make image: kv-router + vllm-sim)"
make -C "$ROOT" image IMAGE="$IMAGE" CONTAINER_TOOL=docker  # kind loads from Docker's store
docker image inspect "$IMAGE" >/dev/null 2>&1 ||
  die "make image did not leave $IMAGE in Docker's image store, where 'kind load docker-image' reads it"
log "building kv-bench (it runs on this machine)"
cargo build --release --manifest-path "$ROOT/Cargo.toml" -p kv-bench
BENCH="${CARGO_TARGET_DIR:-$ROOT/target}/release/kv-bench"
[[ -x "$BENCH" ]] || die "cargo built no $BENCH"

# ---- 3. the cluster ----
CTX="kind-$CLUSTER"
k() { kubectl --context "$CTX" "$@"; }
CREATED=0
WORK=""
PF_PIDS=()
cleanup() {
  for pid in ${PF_PIDS[@]+"${PF_PIDS[@]}"}; do kill "$pid" 2>/dev/null || true; done
  if [[ -n "$WORK" ]]; then rm -rf "$WORK"; fi
  # Only a cluster this run created goes; a reused one was someone's before.
  if [[ "$CREATED" == 1 && "$KEEP" == 0 ]]; then
    log "deleting kind cluster $CLUSTER (this run created it; --keep leaves it up)"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

clusters="$(kind get clusters 2>/dev/null || true)"
if grep -qx -- "$CLUSTER" <<<"$clusters"; then
  log "kind cluster $CLUSTER exists: reusing it (it stays up afterwards)"
  kind export kubeconfig --name "$CLUSTER"
else
  log "creating kind cluster $CLUSTER"
  CREATED=1
  kind create cluster --name "$CLUSTER" --config "$ROOT/deploy/kind/kind-config.yaml" --wait 120s
fi
log "loading $IMAGE into $CLUSTER"
kind load docker-image "$IMAGE" --name "$CLUSTER"

# Istio retries a route's 503s and connect failures twice by default: a retried request is served
# by a pod kv-router did not pick for it, and the routing check below would count it. The demo's
# Istio retries nothing (the mesh-wide default policy, which HTTPRoutes get too).
NO_RETRIES=(--set meshConfig.defaultHttpRetryPolicy.attempts=0)
case "$DEMO_PATH" in
  istio-envoyfilter)
    log "installing Istio $ISTIO_VERSION (default profile: istiod + ingress gateway, ClusterIP: kind has no load balancer)"
    istioctl --context "$CTX" install -y --set profile=default --set tag="$ISTIO_VERSION" \
      --set values.gateways.istio-ingressgateway.type=ClusterIP "${NO_RETRIES[@]}"
    ;;
  gateway-api)
    log "installing Gateway API $GATEWAY_API_VERSION and InferencePool $GIE_VERSION CRDs"
    k apply --server-side -f "https://github.com/kubernetes-sigs/gateway-api/releases/download/$GATEWAY_API_VERSION/standard-install.yaml"
    k apply --server-side -f "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/$GIE_VERSION/manifests.yaml"
    log "installing Istio $ISTIO_VERSION with Gateway API Inference Extension support"
    istioctl --context "$CTX" install -y --set profile=minimal --set tag="$ISTIO_VERSION" \
      --set values.pilot.env.PILOT_ENABLE_GATEWAY_API=true \
      --set values.pilot.env.ENABLE_GATEWAY_API_INFERENCE_EXTENSION=true "${NO_RETRIES[@]}"
    ;;
esac

# ---- 4. the manifests: the path, the simulated pods, the round-robin baseline ----
# kustomize wants relative paths, so the kustomization lives under target/.
mkdir -p "$ROOT/target"
WORK="$(mktemp -d "$ROOT/target/kind-demo.XXXXXX")"
cat >"$WORK/kustomization.yaml" <<KUSTOMIZATION
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- ../../deploy/base
components:
- ../../deploy/components/$DEMO_PATH
- ../../deploy/components/sim
- ../../deploy/kind/round-robin
images:
- name: ghcr.io/example/kv-router
  newName: ${IMAGE%:*}
  newTag: ${IMAGE##*:}
KUSTOMIZATION
if [[ "$DEMO_PATH" == gateway-api ]]; then
  # Istio gives a Gateway a LoadBalancer Service, which stock kind never provisions (the Gateway
  # stays un-Programmed); ClusterIP is all a port-forward needs.
  cat >>"$WORK/kustomization.yaml" <<'PATCH'
patches:
- patch: |-
    apiVersion: gateway.networking.k8s.io/v1
    kind: Gateway
    metadata:
      name: llm-gateway
      namespace: llm
      annotations:
        networking.istio.io/service-type: ClusterIP
PATCH
fi
if [[ "$DEMO_PATH" == istio-envoyfilter ]]; then
  # No retries on the VirtualService's routes either, whatever the mesh default (the routes the
  # component ships leave it to Istio's default, two retries).
  cat >>"$WORK/kustomization.yaml" <<'PATCH'
patches:
- target: { group: networking.istio.io, kind: VirtualService, name: llm }
  patch: |-
    - op: add
      path: /spec/http/0/retries
      value: { attempts: 0 }
    - op: add
      path: /spec/http/1/retries
      value: { attempts: 0 }
PATCH
fi
log "applying $DEMO_PATH + sim + round-robin baseline"
k apply -k "$WORK"
if [[ "$CREATED" == 0 ]]; then
  # Same image tag as the last run: only a restart picks up the image just loaded.
  k -n llm rollout restart deployment/vllm-sim deployment/kv-router
fi

log "waiting for the simulated pods, kv-router and the round-robin Envoy"
for d in vllm-sim kv-router envoy-round-robin; do
  k -n llm rollout status "deployment/$d" --timeout=300s
done
case "$DEMO_PATH" in
  standalone-envoy)
    k -n llm rollout status deployment/envoy --timeout=300s
    ENTRY=(llm service/envoy)
    ;;
  istio-envoyfilter)
    k -n istio-system rollout status deployment/istio-ingressgateway --timeout=300s
    ENTRY=(istio-system service/istio-ingressgateway)
    ;;
  gateway-api)
    # istiod creates the gateway's Deployment and Service (<gateway>-istio) once it sees the Gateway.
    log "waiting for istiod to deploy the gateway llm-gateway-istio"
    for _ in $(seq 1 120); do
      if k -n llm get deployment/llm-gateway-istio >/dev/null 2>&1; then break; fi
      sleep 1
    done
    k -n llm rollout status deployment/llm-gateway-istio --timeout=300s
    k -n llm wait --for=condition=Programmed gateway/llm-gateway --timeout=120s
    ENTRY=(llm service/llm-gateway-istio)
    ;;
esac

# ---- 5. port-forwards: the entry point, the baseline, every pod and router replica ----
# kubectl itself in the background (not the k function) so that $! is the process to stop.
forward() { # LOCAL_PORT REMOTE_PORT NAMESPACE RESOURCE PATH_TO_PROBE
  local lport="$1" rport="$2" ns="$3" res="$4" probe="$5" out="$WORK/port-forward-$1.log" pid
  kubectl --context "$CTX" -n "$ns" port-forward "$res" "$lport:$rport" >"$out" 2>&1 &
  pid=$!
  PF_PIDS+=("$pid")
  for _ in $(seq 1 100); do
    if curl -fsS -o /dev/null "http://127.0.0.1:$lport$probe" 2>/dev/null; then return 0; fi
    kill -0 "$pid" 2>/dev/null || die "port-forward of $ns/$res exited: $(cat "$out")"
    sleep 0.2
  done
  die "http://127.0.0.1:$lport$probe ($ns/$res) does not answer"
}
# name, IP of the live pods matching a selector (terminating ones from a reused cluster left out).
live_pods() {
  k -n llm get pods -l "$1" \
    -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.status.podIP}{" "}{.metadata.deletionTimestamp}{"\n"}{end}' |
    awk 'NF == 2'
}

SIMS=()
SIM_IPS=()
while read -r name ip; do SIMS+=("$name"); SIM_IPS+=("$ip"); done < <(live_pods app=vllm)
ROUTERS=()
while read -r name _; do ROUTERS+=("$name"); done < <(live_pods app.kubernetes.io/name=kv-router)
[[ ${#SIMS[@]} -gt 0 && ${#SIMS[@]} -le 20 ]] || die "expected 1-20 vllm-sim pods in namespace llm, found ${#SIMS[@]}"
[[ ${#ROUTERS[@]} -gt 0 && ${#ROUTERS[@]} -le 20 ]] || die "expected 1-20 kv-router pods in namespace llm, found ${#ROUTERS[@]}"

RR_PORT=$((LOCAL_PORT + 1))
log "port-forwarding ${ENTRY[*]} to 127.0.0.1:$LOCAL_PORT, the round-robin Envoy to :$RR_PORT"
forward "$LOCAL_PORT" 80 "${ENTRY[0]}" "${ENTRY[1]}" /v1/models
forward "$RR_PORT" 80 llm service/envoy-round-robin /v1/models
RESET=()
SCRAPES=()
for i in "${!SIMS[@]}"; do
  port=$((LOCAL_PORT + 10 + i))
  forward "$port" "$SIM_PORT" llm "pod/${SIMS[$i]}" /metrics
  RESET+=(--reset-pod "127.0.0.1:$port")
  SCRAPES+=(--scrape "sim-$i=http://127.0.0.1:$port/metrics")
done
for i in "${!ROUTERS[@]}"; do
  port=$((LOCAL_PORT + 40 + i))
  forward "$port" 9090 llm "pod/${ROUTERS[$i]}" /metrics
  SCRAPES+=(--scrape "router-$i=http://127.0.0.1:$port/metrics")
done
BLOCKS="$(curl -fsS "http://127.0.0.1:$((LOCAL_PORT + 10))/metrics" |
  sed -n 's/.*num_gpu_blocks="\([0-9][0-9]*\)".*/\1/p' | head -n 1 || true)"
[[ -n "$BLOCKS" ]] || die "${SIMS[0]} states no num_gpu_blocks in its /metrics: no oracle could be computed"

# ---- 6. the comparison ----
read -r -a EXTRA <<<"${KV_BENCH_ARGS:-}"
log "kv-bench compare: the same workload twice over the same ${#SIMS[@]} pods ($BLOCKS KV blocks each), every pod's cache reset before each run:"
log "  round-robin: Envoy round robin, no ext_proc (deploy/kind/round-robin, Service envoy-round-robin): the pods without kv-router"
log "  kv-router:   the $DEMO_PATH entry point (${ENTRY[*]}), kv-router picking the pod"
log "  oracle columns: the best hit ratio any router could reach on this workload (infinite: one unbounded cache; pooled: one cache the size of the fleet)"
"$BENCH" compare \
  --endpoint "round-robin=http://127.0.0.1:$RR_PORT" \
  --endpoint "kv-router=http://127.0.0.1:$LOCAL_PORT" \
  --pods "${#SIMS[@]}" --gpu-blocks "$BLOCKS" "${RESET[@]}" \
  "${SCRAPES[@]}" --scrape-dir "$WORK/scrapes" \
  ${EXTRA[@]+"${EXTRA[@]}"}

SCR="$WORK/scrapes"

# ---- 7. kv-router beats round robin on the pods' own counters ----
# Each run's prefix-cache hits and queries (tokens), summed over the pods, after minus before:
# what the pods cached, whatever kv-bench or the router report.
# metric NAME FILE: every series of one metric in a scrape, summed.
metric() { awk -v m="$1" 'index($0, m "{") == 1 || index($0, m " ") == 1 { s += $NF } END { printf "%d\n", s }' "$2"; }
# counter NAME RUN: the run's increase of one pod counter, summed over the pods.
counter() {
  local i total=0
  for i in "${!SIMS[@]}"; do
    total=$((total + $(metric "$1" "$SCR/$2.sim-$i.after.prom") - $(metric "$1" "$SCR/$2.sim-$i.before.prom")))
  done
  echo "$total"
}
# hit_ratio RUN: the pods' prefix-cache hits per prompt token in that run, in hundredths of a percent.
hit_ratio() {
  local hits queries
  hits=$(counter vllm:prefix_cache_hits_total "$1")
  queries=$(counter vllm:prefix_cache_queries_total "$1")
  [[ "$queries" -gt 0 ]] || die "hit ratio check: the pods counted no prefix-cache queries in the $1 run"
  echo $((hits * 10000 / queries))
}
pct() { awk -v x="$1" 'BEGIN { printf "%.2f", x / 100 }'; }
RR_HIT=$(hit_ratio round-robin)
KV_HIT=$(hit_ratio kv-router)
GAIN=$((KV_HIT - RR_HIT))
log "hit ratio check over each run, from the pods' own vllm:prefix_cache_{hits,queries}_total:" \
  "round robin $(pct "$RR_HIT") %, kv-router $(pct "$KV_HIT") %, $(pct "$GAIN") points apart"
[[ "$GAIN" -ge $((MIN_HIT_GAIN * 100)) ]] ||
  die "hit ratio check failed: kv-router's hit ratio is $(pct "$GAIN") points above round robin's," \
    "short of the $MIN_HIT_GAIN points this workload must show (MIN_HIT_GAIN)"
log "hit ratio check passed: kv-router at least $MIN_HIT_GAIN points above round robin"

# ---- 8. every decision's pod is the pod that served it ----
# Over exactly the kv-router run (kv-bench saved the counters right before and right after it):
# the replicas' kv_router_decisions_total per pod against each pod's own vllm:request_success_total.
served() { awk '/^vllm:request_success_total[{ ]/ { s += $NF } END { printf "%d\n", s }' "$1"; }
# decided WHEN [POD]: decisions summed over every replica, for one pod (ip:port) or all.
decided() {
  local files=() r
  for r in "${!ROUTERS[@]}"; do files+=("$SCR/kv-router.router-$r.$1.prom"); done
  awk -v want="${2:+pod=\"$2\"}" \
    'index($0, "kv_router_decisions_total{") == 1 && (want == "" || index($0, want)) { s += $NF } END { printf "%d\n", s }' \
    "${files[@]}"
}
log "routing check over the kv-router run: each pod's decisions (summed over ${#ROUTERS[@]} kv-router replicas) vs the requests it says it served"
printf '%-36s %-16s %9s %9s\n' pod ip decided served >&2
BAD=0
TOTAL_DECIDED=0
TOTAL_SERVED=0
for i in "${!SIMS[@]}"; do
  ip="${SIM_IPS[$i]}"
  d=$(($(decided after "$ip:$SIM_PORT") - $(decided before "$ip:$SIM_PORT")))
  s=$(($(served "$SCR/kv-router.sim-$i.after.prom") - $(served "$SCR/kv-router.sim-$i.before.prom")))
  mark=""
  if [[ "$d" != "$s" ]]; then mark="  <-- differs"; BAD=1; fi
  printf '%-36s %-16s %9d %9d%s\n' "${SIMS[$i]}" "$ip" "$d" "$s" "$mark" >&2
  TOTAL_DECIDED=$((TOTAL_DECIDED + d))
  TOTAL_SERVED=$((TOTAL_SERVED + s))
done
ALL_DECIDED=$(($(decided after) - $(decided before)))
if [[ "$ALL_DECIDED" != "$TOTAL_DECIDED" ]]; then
  log "$((ALL_DECIDED - TOTAL_DECIDED)) decisions named a pod that is not one of these ${#SIMS[@]}"
  BAD=1
fi
[[ "$TOTAL_SERVED" -gt 0 ]] || die "routing check: the pods served nothing in the kv-router run"
[[ "$BAD" == 0 ]] ||
  die "routing check failed: kv-router's decisions and the pods that served disagree (the gateway did not send requests where kv-router said)"
log "routing check passed: $TOTAL_DECIDED decisions, each pod served exactly the requests kv-router sent it"

if [[ "$KEEP" == 1 || "$CREATED" == 0 ]]; then
  log "cluster $CLUSTER stays up. kv-router's view: kubectl --context $CTX -n llm port-forward deploy/kv-router 9090 & curl 127.0.0.1:9090/debug/pods"
  log "delete it with: kind delete cluster --name $CLUSTER"
fi
