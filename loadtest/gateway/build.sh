#!/usr/bin/env bash
# Builds Traefik v3 from the Go module proxy, once per version, into a cache outside the repo,
# and gathers the CRDs the gateway tests install: Traefik's own, the Gateway API standard
# channel at the version Traefik's go.mod names, and Envoy Gateway's (for dry-run validation).
#
#   loadtest/gateway/build.sh        # build what is missing, print the cache dir
#
# The cache root is the control plane's ($TPO_CONTROLPLANE_CACHE, else
# $XDG_CACHE_HOME/traffic-policy-operator, else ~/.cache/traffic-policy-operator).
# Progress goes to stderr; the cache dir is the only stdout line.
set -euo pipefail

TRAEFIK_VERSION=v3.6.12
GATEWAY_API_VERSION=v1.4.0 # what traefik v3.6.12's go.mod requires
ENVOY_GATEWAY_VERSION=v1.9.1

BUILD_NAME=gateway-build
# shellcheck source=../build-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../build-lib.sh"
dir="$cache_root/gateway/traefik-${TRAEFIK_VERSION}_gateway-api-${GATEWAY_API_VERSION}_envoy-gateway-${ENVOY_GATEWAY_VERSION}"
complete() { [[ -x "$dir/traefik" && -f "$dir/crds/.complete" ]]; }
exit_if_built_else_lock "$dir" "$dir"
mkdir -p "$dir/crds"

export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"

module_dir() { # module@version -> its directory in the module cache (downloads it)
  log "downloading $1..."
  go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'
}

traefik_src=$(module_dir "github.com/traefik/traefik/v3@$TRAEFIK_VERSION")
[[ -d "$traefik_src" ]] || fail "could not download github.com/traefik/traefik/v3@$TRAEFIK_VERSION"

if [[ ! -x "$dir/traefik" ]]; then
  log "traefik: building $TRAEFIK_VERSION (about 10 minutes on a cold 2-core machine)..."
  start=$SECONDS
  # Built inside the module's own directory so its go.mod `replace` list applies
  # (`go install …@version` refuses modules with replaces). The module cache is read-only,
  # so the output goes to the cache dir.
  if ! (cd "$traefik_src" && go build -trimpath -ldflags "-s -w" -o "$dir/.traefik.tmp" ./cmd/traefik) >&2; then
    rm -f "$dir/.traefik.tmp"
    fail "building traefik failed (see the go output above)"
  fi
  mv "$dir/.traefik.tmp" "$dir/traefik"
  log "traefik: built in $((SECONDS - start)) s"
fi

cp "$traefik_src/integration/fixtures/k8s/01-traefik-crd.yml" "$dir/crds/traefik.yaml"
gwapi_src=$(module_dir "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION")
for f in "$gwapi_src"/config/crd/standard/*.yaml; do echo "---"; cat "$f"; done > "$dir/crds/gateway-api.yaml"
envoy_src=$(module_dir "github.com/envoyproxy/gateway@$ENVOY_GATEWAY_VERSION")
btp="$envoy_src/charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_backendtrafficpolicies.yaml" # the plain CRD, not the helm template
[[ -f "$btp" ]] || fail "no BackendTrafficPolicy CRD in github.com/envoyproxy/gateway@$ENVOY_GATEWAY_VERSION"
cp "$btp" "$dir/crds/envoy-gateway-backendtrafficpolicy.yaml"
chmod u+w "$dir"/crds/*
touch "$dir/crds/.complete"
log "done"
echo "$dir"
