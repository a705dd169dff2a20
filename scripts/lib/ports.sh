# Ports for servers that must be told their port before they start (sourced by scripts, benches and
# tests/consumer/run.sh; tests/support/multiproc.hpp has the same two for C++ tests).
#
# The rule (issue 57): a server that can bind port 0 does so and tells the others the port it got; a
# port picked by binding 0 and closing is a race (any connection's local port, or another picker, can
# take it before the server binds). Where a port must be chosen first (a flag, MASTER_PORT for a rank
# 0 that hosts the store), take one below the kernel's ephemeral range, where outgoing connections
# never take ports, and run again with a fresh one when the server says the port was taken:
#
#   port=$(fixed_port_candidate)            # fails, saying why, when there is no room below the range
#   ... start the job on $port, its output in $log ...
#   port_taken "$log" && ... run it again with a fresh $(fixed_port_candidate)
#   with_fresh_port FUNC ARGS...            # runs FUNC PORT ARGS... again while it returns 98

# fixed_port_candidate [LO [HI]]: prints a random TCP port in [LO, HI], by default [20000, the first
# ephemeral port - 1] (20000-32767 on Linux's default 32768-60999). HI is held below the ephemeral
# range whatever is asked. scripts/lab/slurm.sh takes 10000-19999 for its daemons in the host
# namespace; contract::slurmDerivedPort's 20000-31999 is used only inside Slurm jobs.
fixed_port_candidate() {
  local lo=${1:-20000} hi=${2:-} range eph_lo eph_hi
  if ! range=$(cat /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null); then
    echo "fixed_port_candidate: cannot read /proc/sys/net/ipv4/ip_local_port_range" >&2
    return 1
  fi
  read -r eph_lo eph_hi <<<"$range"
  [ -n "$hi" ] && [ "$hi" -lt "$eph_lo" ] || hi=$((eph_lo - 1))
  if ! [ "$lo" -ge 1024 ] 2>/dev/null || [ "$hi" -lt "$lo" ]; then
    echo "fixed_port_candidate: no room for a fixed port in [$lo, $hi] below the ephemeral range" \
         "$eph_lo-$eph_hi (/proc/sys/net/ipv4/ip_local_port_range): lower its first port or ask for another range" >&2
    return 1
  fi
  local r=${SRANDOM:-}
  [ -n "$r" ] || r=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
  echo $((lo + r % (hi - lo + 1)))
}

# port_taken FILE...: succeeds when one of the logs says a server's port was in use (our launcher's
# "port already in use", the C library's "Address already in use", c10d's "errno: 98", EADDRINUSE).
# Missing files count as saying nothing.
port_taken() {
  grep -s -q -i -E 'address already in use|EADDRINUSE|errno: ?98|port already in use' "$@"
}

# with_fresh_port FUNC ARGS...: runs FUNC PORT ARGS... with a fresh fixed_port_candidate, again while
# FUNC returns 98 (EADDRINUSE: "the port was taken, nothing else went wrong"), up to 8 times; returns
# FUNC's last status. FUNC decides with port_taken on its own logs.
with_fresh_port() {
  local fn=$1 attempt port rc=98
  shift
  for attempt in 1 2 3 4 5 6 7 8; do
    port=$(fixed_port_candidate) || return 1
    rc=0
    "$fn" "$port" "$@" || rc=$?
    [ "$rc" -eq 98 ] || return "$rc"
    echo "with_fresh_port: port $port was taken (attempt $attempt of 8)" >&2
  done
  echo "with_fresh_port: 8 fixed ports in a row were taken: giving up" >&2
  return 98
}
