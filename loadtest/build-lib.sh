# Sourced by the build scripts (controlplane/, gateway/, tools/): the cache root outside the
# repo, logging, and the build lock. The caller sets BUILD_NAME and defines `complete`.

cache_root=${TPO_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/traffic-policy-operator}

log() { echo "[$BUILD_NAME] $*" >&2; }
fail() { echo "$BUILD_NAME: error: $*" >&2; exit 1; }

# Prints OUTPUT and exits when `complete` holds. Otherwise checks for what a build needs and
# takes DIR's lock, then checks again: test processes start at once on a cold machine, and
# only the first builds.
exit_if_built_else_lock() { # DIR OUTPUT
  local dir=$1 output=$2
  if complete; then
    echo "$output"
    exit 0
  fi
  command -v go >/dev/null 2>&1 || fail "the Go toolchain ('go') is not on PATH; it is needed once to build into $dir"
  command -v flock >/dev/null 2>&1 || fail "'flock' (util-linux) is not on PATH"
  mkdir -p "$dir"
  exec 9>"$dir/.build.lock"
  flock 9
  if complete; then
    echo "$output"
    exit 0
  fi
}
