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

# bench_job LABEL RANKS PATTERN TIMEOUT COMMAND...: runs one job under `timeout` (its log in $work) and
# prints its lines matching PATTERN, in rank order (a line per rank, starting "rank="); when it failed,
# ran out of time or printed fewer than RANKS such lines, says so on stderr with the log's last lines.
bench_job() {
  local label=$1 ranks=$2 pattern=$3 limit=$4; shift 4
  local log=$work/${label// /_}.log rc=0 got
  timeout --kill-after=30 "$limit" "$@" >"$log" 2>&1 || rc=$?
  got=$(grep -o "$pattern" "$log" | sort -t= -k2n || true)
  if [ "$rc" -ne 0 ] || [ "$(printf '%s' "$got" | grep -c '^rank=')" -ne "$ranks" ]; then
    [ "$rc" -eq 124 ] && rc="timeout after ${limit}s"
    { echo "$label: failed ($rc); last lines of its log:"
      grep -v 'gloo/transport' "$log" | tail -n 5 | sed 's/^/    /'; } >&2
    return 0
  fi
  printf '%s\n' "$got"
}
