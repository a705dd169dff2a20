# Shared by the bench scripts (source it after setting `root` to the checkout).

# bench_binaries TARGET [BUILD]: sets `bin` to TARGET and `launcher` to ctorchrun, found in BUILD (default:
# the bookworm build, which it brings up to date first); exits naming what is missing.
bench_binaries() {
  local target=$1 build=${2:-}
  if [ -z "$build" ]; then
    "$root/scripts/build.sh" --target "$target" ctorchrun >/dev/null
    build=${CTORCH_BUILD_DIR:-$root/build}
  fi
  bin=$(find "$build" -name "$target" -type f -perm -u+x | head -1)
  launcher=$(find "$build" -name ctorchrun -type f -perm -u+x | head -1)
  [ -n "$bin" ] && [ -n "$launcher" ] || { echo "$(basename "$0"): no $target or ctorchrun in $build" >&2; exit 1; }
}

# bench_in_modern_lane TARGET VARS SCRIPT ARGS...: outside the modern lane's root, builds TARGET and
# ctorchrun in build-modern and runs SCRIPT ARGS inside the root (modern.sh passes no environment on:
# BUILD, the variables named in VARS and glibc's MALLOC_* settings are handed over); inside, returns.
bench_in_modern_lane() {
  local target=$1 vars=$2 script=$3; shift 3
  [ "${CTORCH_LANE:-}" != modern ] || return 0
  local build=${CTORCH_MODERN_BUILD_DIR:-$root/build-modern} log
  log=$(mktemp)
  CTORCH_JOBS=${CTORCH_JOBS:-1} CTORCH_MODERN_BUILD_DIR=$build "$root/scripts/modern.sh" build \
    --target "$target" ctorchrun >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }
  rm -f "$log"
  local pass=("BUILD=$build") v
  for v in $vars MALLOC_MMAP_THRESHOLD_ MALLOC_TRIM_THRESHOLD_ MALLOC_ARENA_MAX; do
    [ -z "${!v:-}" ] || pass+=("$v=${!v}")
  done
  exec "$root/scripts/modern.sh" run env "${pass[@]}" bash "$script" "$@"
}
