# Shared by netns.sh and slurm.sh (sourced, not run): the pieces both labs need the same way.

# Waits (bounded) until PID leads its own session: a daemon started with `setsid ... &` must be
# out of our process group before we exit, or a caller that kills our group on exit kills it too.
wait_own_session() {
  local tries=0 sid
  while sid=$(ps -o sid= -p "$1" 2>/dev/null | tr -d ' '); [ -n "$sid" ] && [ "$sid" != "$1" ]; do
    tries=$((tries + 1)); [ $tries -le 500 ] || return 1
    sleep 0.01
  done
}

# run_in_lab LINES TEARDOWN CMD...: exports the KEY=VALUE lines `up` printed, runs CMD and exits with
# its status; TEARDOWN (a command line, expanded when it runs) removes the lab on every way out.
run_in_lab() {
  local out=$1 teardown=$2 line; shift 2
  while IFS= read -r line; do export "${line?}"; done <<<"$out"
  trap "$teardown || true" EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  local status=0
  "$@" || status=$?
  exit $status
}
