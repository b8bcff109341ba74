#!/usr/bin/env bash
# The demo: a local control plane, the operator, the sample policies, and their status.
#
#   loadtest/demo.sh            # Ctrl-C stops everything
#   loadtest/demo.sh --no-wait  # show the result, then stop everything (CI runs this)
#
# Needs Rust, Go (once, to build the control plane) and kubectl.
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

echo "[demo] building the operator and the control-plane runner..."
cargo build -q --workspace --bins
bin="${CARGO_TARGET_DIR:-target}/debug"

echo "[demo] starting the control plane (the first run also builds it from Go modules: minutes)..."
rm -f "$KUBECONFIG" "$state/controlplane.out"
"$bin/controlplane" --kubeconfig "$KUBECONFIG" >"$state/controlplane.out" &
pids+=($!)
until grep -q "control plane ready" "$state/controlplane.out" 2>/dev/null; do
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$state/controlplane.out"; exit 1; }
  sleep 0.2
done
head -1 "$state/controlplane.out"

kubectl apply -f crds/ >/dev/null
# The demo's replicas run as the control plane's admin: the fencing policy takes it for the operator.
sed -e "s/'system:serviceaccount:traffic-policy-operator:traffic-policy-operator'/'admin'/" \
  deploy/components/fencing/fencing.yaml | kubectl apply -f - >/dev/null
kubectl wait --for condition=established --timeout=60s crd/applicationtrafficpolicies.trafficpolicy.dev >/dev/null

operator_ns=traffic-policy-operator
kubectl create namespace "$operator_ns" >/dev/null
echo "[demo] starting 3 operator replicas (logs: $state/operator-N.log)..."
for i in 0 1 2; do
  "$bin/traffic-policy-operator" --pod-name "traffic-policy-operator-$i" --namespace "$operator_ns" \
    --metrics-addr 127.0.0.1:0 --health-probe-addr 127.0.0.1:0 --log-format text >"$state/operator-$i.log" 2>&1 &
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
if ! $wait_at_end; then
  exit 0
fi
echo "Try it from another shell:"
echo "  export KUBECONFIG=$KUBECONFIG"
echo "  kubectl get atp -A; kubectl get networkpolicies,configmaps -n shop"
echo "  $bin/traffic-policy-operator shards --namespace $operator_ns"
echo "Press Ctrl-C to stop everything."
wait "${pids[0]}"
