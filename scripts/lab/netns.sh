#!/usr/bin/env bash
# Network-namespace "hosts" on one machine, for multi-node tests.
#
# A lab is N namespaces <prefix>-h1..hN, each with one veth (eth0, 10.A.B.i/24) on a bridge
# <prefix>-br (10.A.B.254/24, on this machine), its own loopback, and (for commands started with
# `exec`) its own hostname n1..nN and an /etc/hosts that names every host of the lab. The prefix
# and the /24 are chosen per lab and checked free, so labs of tests running in parallel never
# clash. State lives in $CTORCH_LAB_STATE (default /run/ctorch-lab)/<prefix>/; a lab whose owner
# process has died is torn down by the next `up` or by `gc` (an aborted test leaves nothing).
#
# Usage:
#   netns.sh check                    exit 0 if this machine can make labs, else print why (exit 1)
#   netns.sh up N [--owner PID]       create a lab, print KEY=VALUE lines (LAB_PREFIX, LAB_SUBNET, ...)
#   netns.sh addr P I                 address of host I of lab P
#   netns.sh exec P I CMD...          run CMD inside host I (own net namespace, hostname nI)
#   netns.sh cut P I | restore P I    take host I's link down (a partition) / bring it back
#   netns.sh cutpair P I J            drop traffic between hosts I and J only (a partial partition);
#                                     restorepair P I J undoes it
#   netns.sh block P I PORT           drop TCP traffic to PORT inside host I; unblock P I PORT undoes it
#   netns.sh kill P I                 SIGKILL every process in host I (a crashed machine)
#   netns.sh pids P [I]               processes in host I (or in every host)
#   netns.sh down P                   kill everything in the lab and remove it (idempotent)
#   netns.sh run N -- CMD...          up, run CMD with the LAB_* variables exported, down (always)
#   netns.sh list | gc                labs present | tear down labs whose owner died
set -euo pipefail

STATE_ROOT=${CTORCH_LAB_STATE:-/run/ctorch-lab}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "netns.sh: $*" >&2; exit 1; }
# shellcheck source=common.sh
. "$HERE/common.sh"

# ---- helpers ---------------------------------------------------------------------------------------
lab_dir() { echo "$STATE_ROOT/$1"; }
lab_get() { cat "$(lab_dir "$1")/$2" 2>/dev/null || true; }
ns_name() { echo "$1-h$2"; }
need_lab() { [ -d "$(lab_dir "$1")" ] || die "no lab '$1' (see: netns.sh list)"; }
need_host() {
  need_lab "$1"
  local n; n=$(lab_get "$1" n)
  [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge 1 ] && [ "$2" -le "$n" ] || die "lab '$1' has hosts 1..$n, not '$2'"
}

# "pid starttime" of a process, so a recycled pid is not mistaken for a live owner.
proc_id() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }          # fields after the command name (which may contain spaces)
  # shellcheck disable=SC2086
  set -- $stat
  echo "$1 ${20}"            # state is field 3 overall (here $1), starttime field 22 (here $20)
}
owner_alive() {
  local owner pid start now
  owner=$(lab_get "$1" owner)
  [ -n "$owner" ] || return 0                     # no owner recorded: managed by hand
  pid=${owner% *}; start=${owner#* }
  now=$(proc_id "$pid") || return 1
  [ "${now#* }" = "$start" ] && [ "${now% *}" != "Z" ]
}

lock() {
  mkdir -p "$STATE_ROOT"
  exec 9>"$STATE_ROOT/.lock"
  flock -w 30 9 || die "could not lock $STATE_ROOT/.lock within 30 s"
}
unlock() { flock -u 9 2>/dev/null || true; }

host_pids() { ip netns pids "$(ns_name "$1" "$2")" 2>/dev/null || true; }

kill_host() {  # P I: SIGKILL until nothing is left (bounded)
  local p=$1 i=$2 tries=0 pids
  while pids=$(host_pids "$p" "$i"); [ -n "$pids" ]; do
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    tries=$((tries + 1))
    [ $tries -le 100 ] || { echo "netns.sh: processes survive in $(ns_name "$p" "$i"): $pids" >&2; return 1; }
    sleep 0.05
  done
}

# ---- check -----------------------------------------------------------------------------------------
cmd_check() {
  # The modern lane (scripts/modern.sh) runs in a chroot made for LibTorch 2.x; the lab's hosts and
  # Slurm cluster are tested in the bookworm lane, where scripts/setup.sh installs them.
  [ "${CTORCH_LANE:-}" != modern ] || { echo "the modern lane's root has no lab (network namespaces, iptables, Slurm): the bookworm lane runs these tests"; exit 1; }
  [ "$(id -u)" -eq 0 ] || { echo "needs root to create network namespaces (uid $(id -u))"; exit 1; }
  local c
  for c in ip nsenter unshare flock iptables mount hostname; do
    command -v "$c" >/dev/null || { echo "'$c' is not installed (scripts/setup.sh installs it)"; exit 1; }
  done
  unshare --net --uts --mount true 2>/dev/null || { echo "cannot create namespaces here (unshare --net failed)"; exit 1; }
  exit 0
}

# ---- up ---------------------------------------------------------------------------------------------
subnet_free() {  # 10.A.B
  ! ip -4 -o addr show 2>/dev/null | grep -q " $1\." &&
  ! ip -4 route show 2>/dev/null | grep -q "^$1\." &&
  ! grep -qx "$1" "$STATE_ROOT"/*/subnet 2>/dev/null
}
prefix_free() {
  [ ! -e "$(lab_dir "$1")" ] && ! ip link show "$1-br" >/dev/null 2>&1 &&
  ! ip netns list 2>/dev/null | grep -q "^$1-"
}

cmd_up() {
  local n=${1:-}; shift || true
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 60 ] || die "up: number of hosts must be 1..60, not '$n'"
  local owner_pid=$PPID
  while [ $# -gt 0 ]; do
    case $1 in
      --owner) owner_pid=${2:?}; shift 2 ;;
      *) die "up: unknown option '$1'" ;;
    esac
  done
  cmd_gc quiet
  lock
  local p="" s="" tries
  for tries in $(seq 1 200); do
    p=$(printf 'cl%04x%02x' $((RANDOM)) $((RANDOM % 256)))
    prefix_free "$p" && break
    p=""
  done
  [ -n "$p" ] || die "up: no free lab prefix found"
  for tries in $(seq 1 200); do
    s="10.$((200 + RANDOM % 50)).$((RANDOM % 256))"
    subnet_free "$s" && break
    s=""
  done
  [ -n "$s" ] || die "up: no free 10.x.y.0/24 subnet found"
  local dir; dir=$(lab_dir "$p")
  mkdir -p "$dir"
  echo "$n" >"$dir/n"
  echo "$s" >"$dir/subnet"
  local owner; owner=$(proc_id "$owner_pid") || die "up: owner process $owner_pid does not exist"
  echo "$owner_pid ${owner#* }" >"$dir/owner"
  unlock

  # From here on a failure (or Ctrl-C) removes what was made.
  trap 'cmd_down "$p" >/dev/null 2>&1 || true; exit 1' ERR INT TERM HUP

  {
    echo "127.0.0.1 localhost"
    echo "::1 localhost ip6-localhost ip6-loopback"
    echo "$s.254 ctl"
    local i
    for i in $(seq 1 "$n"); do echo "$s.$i n$i"; done
  } >"$dir/hosts"

  ip link add "$p-br" type bridge
  ip addr add "$s.254/24" dev "$p-br"
  ip link set "$p-br" up
  # Bridged traffic passes the host's FORWARD chain when br_netfilter is loaded; some machines
  # (Docker hosts) drop it by default. Open it for this bridge only, and remember to undo it.
  if [ "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo 0)" = 1 ] &&
     ! iptables -S FORWARD 2>/dev/null | head -1 | grep -q ACCEPT; then
    iptables -I FORWARD -i "$p-br" -o "$p-br" -j ACCEPT && touch "$dir/forward-rule"
  fi
  if ! iptables -S INPUT 2>/dev/null | head -1 | grep -q ACCEPT; then
    iptables -I INPUT -i "$p-br" -j ACCEPT && touch "$dir/input-rule"
  fi
  for i in $(seq 1 "$n"); do
    local ns; ns=$(ns_name "$p" "$i")
    ip netns add "$ns"
    ip link add "$p-v$i" type veth peer name eth0 netns "$ns"
    ip link set "$p-v$i" master "$p-br" up
    ip -n "$ns" addr add "$s.$i/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
  done
  # A watcher removes the lab as soon as its owner dies, even by SIGKILL (a test killed at its
  # CTest timeout cannot run its own cleanup). `down` stops the watcher.
  setsid bash -c 'tail --pid="$1" -s 0.2 -f /dev/null; exec "$2" down "$3"' watcher \
    "$owner_pid" "$HERE/netns.sh" "$p" </dev/null >/dev/null 2>&1 &
  echo $! >"$dir/watcher"
  wait_own_session $!
  trap - ERR INT TERM HUP

  echo "LAB_PREFIX=$p"
  echo "LAB_SUBNET=$s"
  echo "LAB_N=$n"
  echo "LAB_BRIDGE_ADDR=$s.254"
  echo "LAB_STATE=$dir"
  echo "LAB_HOSTS_FILE=$dir/hosts"
  local addrs=""
  for i in $(seq 1 "$n"); do addrs+="${addrs:+,}$s.$i"; done
  echo "LAB_ADDRS=$addrs"
}

# ---- per-host commands -----------------------------------------------------------------------------
cmd_addr() { need_host "$1" "$2"; echo "$(lab_get "$1" subnet).$2"; }

cmd_exec() {
  local p=$1 i=$2; shift 2
  need_host "$p" "$i"
  [ $# -gt 0 ] || die "exec: no command given"
  local dir; dir=$(lab_dir "$p")
  # `nsenter --net`, not `ip netns exec`: the latter remounts /sys, which breaks slurmd.
  exec nsenter --net="/run/netns/$(ns_name "$p" "$i")" -- \
    unshare --uts --mount -- sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
    sh "$dir/hosts" "n$i" "$@"
}

cmd_cut() { need_host "$1" "$2"; ip link set "$1-v$2" down; }
cmd_restore() { need_host "$1" "$2"; ip link set "$1-v$2" up; }

# Each host drops what comes from the other: neither reaches the other, both reach everyone else.
cmd_cutpair() {
  need_host "$1" "$2"; need_host "$1" "$3"
  nsenter --net="/run/netns/$(ns_name "$1" "$2")" -- iptables -I INPUT -s "$(cmd_addr "$1" "$3")" -j DROP
  nsenter --net="/run/netns/$(ns_name "$1" "$3")" -- iptables -I INPUT -s "$(cmd_addr "$1" "$2")" -j DROP
}
cmd_restorepair() {
  need_host "$1" "$2"; need_host "$1" "$3"
  nsenter --net="/run/netns/$(ns_name "$1" "$2")" -- iptables -D INPUT -s "$(cmd_addr "$1" "$3")" -j DROP
  nsenter --net="/run/netns/$(ns_name "$1" "$3")" -- iptables -D INPUT -s "$(cmd_addr "$1" "$2")" -j DROP
}

cmd_block() {
  need_host "$1" "$2"
  [[ "${3:-}" =~ ^[0-9]+$ ]] || die "block: port must be a number, not '${3:-}'"
  nsenter --net="/run/netns/$(ns_name "$1" "$2")" -- iptables -I INPUT -p tcp --dport "$3" -j DROP
}
cmd_unblock() {
  need_host "$1" "$2"
  [[ "${3:-}" =~ ^[0-9]+$ ]] || die "unblock: port must be a number, not '${3:-}'"
  nsenter --net="/run/netns/$(ns_name "$1" "$2")" -- iptables -D INPUT -p tcp --dport "$3" -j DROP
}

cmd_kill() { need_host "$1" "$2"; kill_host "$1" "$2"; }

cmd_pids() {
  need_lab "$1"
  if [ -n "${2:-}" ]; then need_host "$1" "$2"; host_pids "$1" "$2"; return; fi
  local i
  for i in $(seq 1 "$(lab_get "$1" n)"); do host_pids "$1" "$i"; done
}

# ---- down / gc / list --------------------------------------------------------------------------------
cmd_down() {
  local p=${1:?down: lab prefix required}
  local dir n status=0
  dir=$(lab_dir "$p")
  n=$(lab_get "$p" n)
  # A Slurm cluster on top of this lab is stopped first (its daemons run outside the namespaces).
  if [ -f "$dir/slurm" ]; then
    "$HERE/slurm.sh" down "$(cat "$dir/slurm")" >/dev/null 2>&1 || status=1
  fi
  if [ -z "$n" ]; then  # no state: find what is left by name
    n=$(ip netns list 2>/dev/null | sed -n "s/^$p-h\([0-9]*\).*/\1/p" | sort -n | tail -1)
    n=${n:-0}
  fi
  local watcher; watcher=$(lab_get "$p" watcher)
  if [ -n "$watcher" ] && [ "$watcher" != $$ ]; then kill -- "-$watcher" 2>/dev/null || true; fi
  local i
  for i in $(seq 1 "$n"); do kill_host "$p" "$i" || status=1; done
  for i in $(seq 1 "$n"); do
    ip link del "$p-v$i" 2>/dev/null || true
    ip netns del "$(ns_name "$p" "$i")" 2>/dev/null || true
  done
  [ -f "$dir/forward-rule" ] && { iptables -D FORWARD -i "$p-br" -o "$p-br" -j ACCEPT 2>/dev/null || true; }
  [ -f "$dir/input-rule" ] && { iptables -D INPUT -i "$p-br" -j ACCEPT 2>/dev/null || true; }
  ip link del "$p-br" 2>/dev/null || true
  # Deleting a namespace frees its veth asynchronously; wait (bounded) so "down" means gone.
  local tries=0
  while ip link show 2>/dev/null | grep -q " $p-" || ip netns list 2>/dev/null | grep -q "^$p-"; do
    tries=$((tries + 1))
    [ $tries -le 100 ] || { echo "netns.sh: links of lab $p are still present" >&2; status=1; break; }
    sleep 0.02
  done
  rm -rf "$dir"
  return $status
}

cmd_list() {
  local d
  for d in "$STATE_ROOT"/*/; do
    [ -d "$d" ] || continue
    local p; p=$(basename "$d")
    local alive=dead; owner_alive "$p" && alive=alive
    echo "$p n=$(lab_get "$p" n) subnet=$(lab_get "$p" subnet).0/24 owner=$(lab_get "$p" owner) ($alive)"
  done
}

cmd_gc() {
  local quiet=${1:-} d
  for d in "$STATE_ROOT"/*/; do
    [ -d "$d" ] || continue
    local p; p=$(basename "$d")
    if ! owner_alive "$p"; then
      [ -n "$quiet" ] || echo "netns.sh: removing lab $p (owner $(lab_get "$p" owner) is gone)"
      cmd_down "$p" >/dev/null 2>&1 || true
    fi
  done
}

cmd_run() {
  local n=${1:?run: number of hosts required}; shift
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "run: no command given"
  local out
  out=$(cmd_up "$n" --owner $$) || exit 1
  run_in_lab "$out" 'cmd_down "$LAB_PREFIX"' "$@"
}

main() {
  local cmd=${1:-}; shift || true
  case $cmd in
    check) cmd_check ;;
    up) cmd_up "$@" ;;
    addr) cmd_addr "${1:?lab}" "${2:?host}" ;;
    exec) [ $# -ge 2 ] || die "exec: usage: exec P I CMD..."; cmd_exec "$@" ;;
    cut) cmd_cut "${1:?lab}" "${2:?host}" ;;
    restore) cmd_restore "${1:?lab}" "${2:?host}" ;;
    cutpair) cmd_cutpair "${1:?lab}" "${2:?host}" "${3:?host}" ;;
    restorepair) cmd_restorepair "${1:?lab}" "${2:?host}" "${3:?host}" ;;
    block) cmd_block "${1:?lab}" "${2:?host}" "${3:-}" ;;
    unblock) cmd_unblock "${1:?lab}" "${2:?host}" "${3:-}" ;;
    kill) cmd_kill "${1:?lab}" "${2:?host}" ;;
    pids) cmd_pids "${1:?lab}" "${2:-}" ;;
    down) cmd_down "${1:?lab}" ;;
    list) cmd_list ;;
    gc) cmd_gc ;;
    run) cmd_run "$@" ;;
    ""|-h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
    *) die "unknown command '$cmd' (see: netns.sh --help)" ;;
  esac
}

main "$@"
