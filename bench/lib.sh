# Shared by the bench scripts (source it after setting `root` to the checkout).
# shellcheck source=../scripts/lib/ports.sh
. "$root/scripts/lib/ports.sh"

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

# bench_ranks WORLD OUT LIMIT COMMAND...: one job of WORLD processes of COMMAND on this machine, without
# a launcher: rank r's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
# MASTER_PORT) set, its output in OUT<r>.out, each under `timeout LIMIT`. Rank 0 hosts the store (no
# TORCHELASTIC_USE_AGENT_STORE) on a fixed_port_candidate port; when it ends saying the port was taken,
# the other ranks (waiting on whatever holds that port) are stopped and the job runs again on a fresh
# port. Returns 0 when every rank exited 0.
bench_ranks() {
  with_fresh_port _bench_ranks_on "$@"
}

_bench_ranks_on() {  # PORT WORLD OUT LIMIT COMMAND...: one try of bench_ranks; 98: the port was taken
  local port=$1 world=$2 out=$3 limit=$4; shift 4
  local r pid pids=() rc=0
  for ((r = 0; r < world; r++)); do
    # (in braces: the shell's own word on a rank killed by a signal goes to that rank's log)
    { RANK=$r LOCAL_RANK=$r WORLD_SIZE=$world LOCAL_WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        timeout "$limit" env -u TORCHELASTIC_USE_AGENT_STORE "$@"; } >"$out$r.out" 2>&1 &
    pids+=($!)
  done
  wait "${pids[0]}" || rc=$?
  if [ "$rc" -ne 0 ] && port_taken "${out}0.out"; then
    for pid in "${pids[@]:1}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
    return 98
  fi
  for pid in "${pids[@]:1}"; do wait "$pid" || rc=1; done
  [ "$rc" -eq 0 ]
}
