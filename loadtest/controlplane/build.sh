#!/usr/bin/env bash
# Builds the local control plane (etcd, kube-apiserver, kube-controller-manager)
# from the official Go modules, once per version, into a cache outside the repo.
#
#   loadtest/controlplane/build.sh          # the version the tests run (kubernetes/go.mod)
#   loadtest/controlplane/build.sh oldest   # the oldest supported (kubernetes-oldest/go.mod)
#
# Each prints its bin dir once built; the Kubernetes version is the one its go.mod pins.
#
# The cache directory is $TPO_CONTROLPLANE_CACHE, else $XDG_CACHE_HOME/traffic-policy-operator,
# else ~/.cache/traffic-policy-operator. Progress goes to stderr; the bin dir is the only stdout line.
set -euo pipefail

ETCD_VERSION=v3.6.16

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
case "${1:-}" in
  "") kube_module=kubernetes ;;
  oldest) kube_module=kubernetes-oldest ;;
  *) echo "usage: $0 [oldest]" >&2; exit 2 ;;
esac
BUILD_NAME=controlplane-build
# shellcheck source=../build-lib.sh
source "$here/../build-lib.sh"
KUBE_VERSION=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v1\./ { print $2; exit }
                    $1 == "require" && $2 == "k8s.io/kubernetes" { print $3; exit }' "$here/$kube_module/go.mod")
[[ -n "$KUBE_VERSION" ]] || fail "no k8s.io/kubernetes version in $kube_module/go.mod"
bin_dir="$cache_root/controlplane/kubernetes-${KUBE_VERSION}_etcd-${ETCD_VERSION}"

complete() {
  [[ -x "$bin_dir/etcd" && -x "$bin_dir/kube-apiserver" && -x "$bin_dir/kube-controller-manager" ]]
}
exit_if_built_else_lock "$bin_dir" "$bin_dir"

minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
version_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  version_ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  version_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"

build() { # name module_dir package ldflags
  local name=$1 dir=$2 pkg=$3 ldflags=$4
  if [[ -x "$bin_dir/$name" ]]; then
    log "$name: cached"
    return
  fi
  log "$name: building $pkg (takes a few minutes on a cold machine)..."
  local start=$SECONDS tmp="$bin_dir/.$name.tmp"
  if ! (cd "$here/$dir" && go build -trimpath -tags selinux,notest -ldflags "-s -w $ldflags" -o "$tmp" "$pkg") >&2; then
    rm -f "$tmp"
    fail "building $name failed (see the go output above)"
  fi
  mv "$tmp" "$bin_dir/$name"
  log "$name: built in $((SECONDS - start)) s"
}

log "building the control plane into $bin_dir"
build etcd etcd . "-X go.etcd.io/etcd/api/v3/version.GitSHA=${ETCD_VERSION}"
build kube-apiserver "$kube_module" k8s.io/kubernetes/cmd/kube-apiserver "$version_ldflags"
build kube-controller-manager "$kube_module" k8s.io/kubernetes/cmd/kube-controller-manager "$version_ldflags"
log "done"
echo "$bin_dir"
