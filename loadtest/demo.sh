#!/usr/bin/env bash
# The demo: a local control plane, the operator, the sample policies, and their status.
#
#   loadtest/demo.sh            # Ctrl-C stops everything
#   loadtest/demo.sh --no-wait  # show the result, then stop everything (CI runs this)
#
# Needs Rust, Go (once, to build the control plane and Traefik) and kubectl. The gateway part
# (Traefik enforcing a policy's rate limit) also needs root, `ip` and python3, for a backend
# in a network namespace of its own; without them it is skipped, and says so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

wait_at_end=true
case "${1:-}" in
  --no-wait) wait_at_end=false ;;
  "") ;;
  *) echo "usage: loadtest/demo.sh [--no-wait]" >&2; exit 2 ;;
esac

state=.controlplane
mkdir -p "$state"
export KUBECONFIG="$PWD/$state/kubeconfig"
pids=()
cleanup() {
  trap - EXIT INT TERM
  echo "stopping..."
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "stopped"
}
trap cleanup EXIT INT TERM

echo "[demo] building the operator and the control-plane runner (a fresh clone: about 15 minutes on 2 cores)..."
# Cargo's own progress: the crate being compiled, and a bar on a terminal.
cargo build --workspace --bins
bin="${CARGO_TARGET_DIR:-target}/debug"

gateway_args=()
if [[ $(id -u) == 0 ]] && command -v ip >/dev/null && command -v python3 >/dev/null; then
  gateway_args=(--gateway-backend "hello from the storefront")
else
  echo "[demo] no gateway: the backend behind it needs root, 'ip' and python3"
fi

echo "[demo] starting the control plane (the first run also builds it and Traefik from Go modules: minutes)..."
rm -f "$KUBECONFIG" "$state/controlplane.out"
"$bin/controlplane" --kubeconfig "$KUBECONFIG" "${gateway_args[@]}" >"$state/controlplane.out" &
pids+=($!)
ready_line="control plane ready"
((${#gateway_args[@]})) && ready_line="gateway on"
until grep -q "$ready_line" "$state/controlplane.out" 2>/dev/null; do
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$state/controlplane.out"; exit 1; }
  sleep 0.2
done
head -1 "$state/controlplane.out"

kubectl apply -f crds/ >/dev/null
kubectl wait --for condition=established --timeout=60s crd/applicationtrafficpolicies.trafficpolicy.dev >/dev/null

# The operator as it is installed, less its pods: its namespace, its ServiceAccount and
# roles, and the admission policies the product ships, unchanged (fencing, and operator-reach,
# which confines the operator's identity to the objects it manages). The replicas run here as
# processes with that ServiceAccount's token.
operator_ns=traffic-policy-operator
base=deploy/base
kubectl apply -f "$base/namespace.yaml" -f "$base/clusterrole.yaml" -f "$base/clusterrolebinding.yaml" >/dev/null
kubectl apply -n "$operator_ns" -f "$base/serviceaccount.yaml" -f "$base/role.yaml" -f "$base/rolebinding.yaml" >/dev/null
kubectl apply -f deploy/components/fencing/fencing.yaml -f deploy/components/operator-reach/operator-reach.yaml >/dev/null
operator_kubeconfig="$PWD/$state/operator.kubeconfig"
cp "$KUBECONFIG" "$operator_kubeconfig"
token=$(kubectl create token traffic-policy-operator -n "$operator_ns" --duration=24h)
KUBECONFIG="$operator_kubeconfig" kubectl config set-credentials traffic-policy-operator --token="$token" >/dev/null
KUBECONFIG="$operator_kubeconfig" kubectl config set-context --current --user=traffic-policy-operator >/dev/null

echo "[demo] starting 3 operator replicas (logs: $state/operator-N.log)..."
for i in 0 1 2; do
  "$bin/traffic-policy-operator" --kubeconfig "$operator_kubeconfig" --pod-name "traffic-policy-operator-$i" \
    --namespace "$operator_ns" --metrics-addr 127.0.0.1:0 --health-probe-addr 127.0.0.1:0 --log-format text \
    >"$state/operator-$i.log" 2>&1 &
  pids+=($!)
done

kubectl apply -f deploy/samples/
for team in $(seq 1 9); do
  kubectl create namespace "team-$team" >/dev/null
  sed -e "s/namespace: shop/namespace: team-$team/" deploy/samples/web-frontend.yaml | sed -n '/^---$/,$p' | kubectl apply -f - >/dev/null
done
kubectl wait --for condition=Ready --timeout=60s atp --all -A >/dev/null
kubectl get atp -A
echo
"$bin/traffic-policy-operator" shards --namespace "$operator_ns"
echo

if ((${#gateway_args[@]})); then
  port=$(sed -n 's/^gateway on 127.0.0.1:\([0-9]*\).*/\1/p' "$state/controlplane.out")
  backend=$(sed -n 's/^backend on \(.*\):[0-9]*$/\1/p' "$state/controlplane.out")
  backend_port=$(sed -n 's/^backend on .*:\([0-9]*\)$/\1/p' "$state/controlplane.out")
  echo "[demo] Traefik on 127.0.0.1:$port; a Gateway, the storefront Service, and a policy limiting it to 2 requests/s"
  kubectl apply -f - >/dev/null <<EOF
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {name: traefik}
spec: {controllerName: traefik.io/gateway-controller}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: edge, namespace: shop}
spec:
  gatewayClassName: traefik
  listeners: [{name: web, port: $port, protocol: HTTP}]
---
apiVersion: v1
kind: Service
metadata: {name: storefront, namespace: shop}
spec: {ports: [{port: 80, targetPort: $backend_port}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: storefront, namespace: shop, labels: {kubernetes.io/service-name: storefront}}
addressType: IPv4
endpoints: [{addresses: ["$backend"], conditions: {ready: true}}]
ports: [{port: $backend_port, protocol: TCP}]
EOF
  kubectl apply -f deploy/samples/gateway/storefront.yaml
  kubectl wait --for condition=RateLimitAccepted --timeout=120s atp/storefront -n shop >/dev/null
  kubectl get atp storefront -n shop \
    -o custom-columns='POLICY:.metadata.name,ROUTE:.status.conditions[?(@.type=="RouteAccepted")].reason,RATE-LIMIT:.status.conditions[?(@.type=="RateLimitAccepted")].message'
  echo "[demo] 8 requests at once through the gateway (curl -H 'Host: shop.example.com' http://127.0.0.1:$port/):"
  for _ in $(seq 1 8); do
    curl -s -o /dev/null -w "%{http_code} " -H "Host: shop.example.com" "http://127.0.0.1:$port/"
  done
  echo
  echo
fi
if ! $wait_at_end; then
  exit 0
fi
echo "Try it from another shell:"
echo "  export KUBECONFIG=$KUBECONFIG"
echo "  kubectl get atp -A; kubectl get networkpolicies,configmaps -n shop"
((${#gateway_args[@]})) && echo "  curl -i -H 'Host: shop.example.com' http://127.0.0.1:$port/; kubectl get httproutes,middlewares -n shop"
echo "  $bin/traffic-policy-operator shards --namespace $operator_ns"
echo "Press Ctrl-C to stop everything."
wait "${pids[0]}"
