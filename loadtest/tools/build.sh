#!/usr/bin/env bash
# Builds a command-line tool the tests use from the Go module proxy, once per version, into
# a cache outside the repo, and prints the binary's path.
#
#   loadtest/tools/build.sh helm                 # helm, for the chart tests
#   loadtest/tools/build.sh kube-state-metrics   # for its CustomResourceState config's test
#
# The cache root is the control plane's ($TPO_CONTROLPLANE_CACHE, else
# $XDG_CACHE_HOME/traffic-policy-operator, else ~/.cache/traffic-policy-operator).
# Progress goes to stderr; the binary's path is the only stdout line.
set -euo pipefail

BUILD_NAME=tools-build
# shellcheck source=../build-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../build-lib.sh"

case ${1:-} in
  helm) package=helm.sh/helm/v4/cmd/helm version=v4.3.2 ;;
  kube-state-metrics) package=k8s.io/kube-state-metrics/v2 version=v2.20.0 ;;
  *) fail "usage: $0 helm|kube-state-metrics" ;;
esac
name=$1
dir="$cache_root/tools/$name-$version"
complete() { [[ -x "$dir/$name" ]]; }
exit_if_built_else_lock "$dir" "$dir/$name"

log "$name: building $package@$version (about 2 minutes on a cold 2-core machine)..."
start=$SECONDS
if ! CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOBIN="$dir/.build" \
  go install -trimpath -ldflags "-s -w" "$package@$version" >&2; then
  fail "building $name failed (see the go output above)"
fi
mv "$dir/.build/$name" "$dir/$name"
rmdir "$dir/.build"
log "$name: built in $((SECONDS - start)) s"
echo "$dir/$name"
