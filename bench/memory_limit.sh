#!/usr/bin/env bash
# Runs each given command under one memory limit and says whether it completed or was killed / failed, and why:
# issue 31's demonstration that a model DDP cannot train under a limit trains with sharding.
# Usage: bench/memory_limit.sh <limit MB | none> <command> [<command>...]     (each command one bash string)
#   The limit is, in order of preference (MEMORY_LIMIT_METHOD=auto|cgroup|ulimit picks one):
#   - a memory cgroup nested in this shell's own (v2 memory.max, else v1 memory.limit_in_bytes): the limit is on
#     everything the command starts together (launcher and all ranks), as a container's would be; the kernel's
#     OOM killer ends a process when the group's memory cannot be reclaimed below it. Reports the group's peak
#     (file cache included, which is reclaimed before anything is killed). Needs a writable cgroup tree (root).
#   - `ulimit -v`: each process's VIRTUAL address space, not the group's memory; LibTorch and Gloo threads
#     reserve far more address space than they touch, so the limit must be far above the resident size.
#   "none": no limit, only the peak (cgroup) to choose one from.
#   TIMEOUT: seconds a command may run (default 1800). VERBOSE=1: the command's output too.
set -euo pipefail
usage="usage: bench/memory_limit.sh <limit MB | none> <command> [<command>...]"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
limit=$1; shift
[[ $limit == none || $limit =~ ^[1-9][0-9]*$ ]] || { echo "memory_limit.sh: limit '$limit' is not a number of MB or 'none'" >&2; exit 2; }
method=${MEMORY_LIMIT_METHOD:-auto}
[[ $method =~ ^(auto|cgroup|ulimit)$ ]] || { echo "memory_limit.sh: MEMORY_LIMIT_METHOD '$method' is not auto, cgroup or ulimit" >&2; exit 2; }
TIMEOUT=${TIMEOUT:-1800}
[[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || { echo "memory_limit.sh: TIMEOUT '$TIMEOUT' is not a positive number of seconds" >&2; exit 2; }
work=$(mktemp -d)
group=""

# A memory cgroup below this shell's own; prints "v2 DIR" or "v1 DIR", nothing if none can be made.
make_group() {
  local own dir
  own=$(awk -F: '$1 == "0" && $2 == "" {print $3}' /proc/self/cgroup)
  if [ -n "$own" ] && [ -f "/sys/fs/cgroup$own/cgroup.controllers" ]; then  # unified hierarchy at the root
    dir=/sys/fs/cgroup${own%/}/ctorch-memlimit-$$
    if mkdir "$dir" 2>/dev/null; then
      [ -f "$dir/memory.max" ] && { echo "v2 $dir"; return; }
      rmdir "$dir"
    fi
  fi
  own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
  if [ -n "$own" ] && [ -d "/sys/fs/cgroup/memory$own" ]; then
    dir=/sys/fs/cgroup/memory${own%/}/ctorch-memlimit-$$
    if mkdir "$dir" 2>/dev/null; then
      [ -f "$dir/memory.limit_in_bytes" ] && { echo "v1 $dir"; return; }
      rmdir "$dir"
    fi
  fi
}

# Ends what the command left in the group (only its processes are there), then removes the group.
drop_group() {
  [ -n "$group" ] || return 0
  local dir=${group#* } pid
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    [ -s "$dir/cgroup.procs" ] || break
    while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done <"$dir/cgroup.procs"
    sleep 0.5
  done
  rmdir "$dir" 2>/dev/null || echo "memory_limit.sh: could not remove $dir" >&2
  group=""
}
trap 'drop_group; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

if [ "$method" != ulimit ]; then
  group=$(make_group || true)
  if [ -z "$group" ]; then
    [ "$method" = cgroup ] && { echo "memory_limit.sh: no writable memory cgroup here (MEMORY_LIMIT_METHOD=cgroup)" >&2; exit 1; }
    drop_group
  fi
fi
if [ -n "$group" ]; then
  how="cgroup ${group%% *} memory limit (launcher and ranks together)"
elif [ "$limit" = none ]; then
  echo "memory_limit.sh: 'none' measures a cgroup's peak; no memory cgroup can be made here" >&2; exit 1
else
  how="ulimit -v per process (virtual memory)"
fi
shown=$limit; [ "$limit" = none ] || shown="$limit MB"
echo "memory limit: $shown, $how; $(date -u +%FT%TZ), $(nproc --all) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"

# The group's counters: "<oom kills> <peak bytes>".
counters() {
  local kind=${group%% *} dir=${group#* } kills peak
  if [ "$kind" = v2 ]; then
    kills=$(awk '$1 == "oom_kill" {print $2}' "$dir/memory.events")
    peak=$(cat "$dir/memory.peak" 2>/dev/null || echo 0)
  else
    kills=$(awk '$1 == "oom_kill" {print $2}' "$dir/memory.oom_control")
    peak=$(cat "$dir/memory.max_usage_in_bytes")
  fi
  echo "${kills:-0} ${peak:-0}"
}

# The last <n> processes the OOM killer ended in this group, from the kernel's log where it can be read:
# " (name pid N, ...)".
victims() {
  local dir=${group#* } rel names
  rel=${dir#/sys/fs/cgroup}; rel=${rel#/memory}
  names=$(dmesg 2>/dev/null | grep -F "oom_memcg=$rel," | grep -o 'task=[^,]*,pid=[0-9]*' | tail -n "$1" |
          sed 's/task=\([^,]*\),pid=\(.*\)/\1 pid \2/' | paste -sd, - | sed 's/,/, /g' || true)
  [ -z "$names" ] || echo " ($names)"
}

# What a refused allocation prints: C++ (std::bad_alloc, c10's allocator), Python, OpenBLAS's buffers.
refused="bad_alloc|cannot allocate memory|MemoryError|out of memory|DefaultCPUAllocator|OpenBLAS error: Memory allocation"
n=0
for cmd in "$@"; do
  n=$((n + 1))
  log=$work/command-$n.log
  rc=0
  start=$(date +%s.%N)
  if [ -n "$group" ]; then
    kind=${group%% *}; dir=${group#* }
    bytes=max; [ "$limit" = none ] || bytes=$((limit * 1024 * 1024))
    if [ "$kind" = v2 ]; then
      echo "$bytes" >"$dir/memory.max"
      [ -f "$dir/memory.swap.max" ] && echo 0 >"$dir/memory.swap.max"
      [ -f "$dir/memory.peak" ] && echo 0 >"$dir/memory.peak" 2>/dev/null || true
    else
      [ "$bytes" = max ] && bytes=-1
      echo "$bytes" >"$dir/memory.limit_in_bytes"
      [ -f "$dir/memory.memsw.limit_in_bytes" ] && echo "$bytes" >"$dir/memory.memsw.limit_in_bytes" 2>/dev/null || true
      echo 0 >"$dir/memory.max_usage_in_bytes"
    fi
    read -r kills_before _ < <(counters)
    # (the braces take bash's own "Killed" line for a killed command: the verdict below says it)
    { bash -c 'echo $$ >"$1/cgroup.procs" && exec timeout --kill-after=30 "$2" bash -c "$3"' _ "$dir" "$TIMEOUT" "$cmd" \
        >"$log" 2>&1 || rc=$?; } 2>/dev/null
    read -r kills_after peak < <(counters)
    kills=$((kills_after - kills_before))
    # A process the command left behind (a rank whose launcher was killed) is ended: the next command starts clean.
    while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done <"$dir/cgroup.procs"
  else
    { bash -c 'ulimit -v "$1" && exec timeout --kill-after=30 "$2" bash -c "$3"' _ $((limit * 1024)) "$TIMEOUT" "$cmd" \
        >"$log" 2>&1 || rc=$?; } 2>/dev/null
    kills=0; peak=""
  fi
  seconds=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.1f", e - s}')
  [ "${VERBOSE:-0}" = 1 ] && sed 's/^/    | /' "$log"
  measured="${seconds} s"
  [ -n "$peak" ] && measured="$measured, group peak $(awk -v b="$peak" 'BEGIN {printf "%.0f", b / 1048576}') MB"
  if [ "$rc" -eq 0 ] && [ "$kills" -eq 0 ]; then
    echo "completed ($measured): $cmd"
  else
    if [ "$kills" -gt 0 ]; then
      reason="the OOM killer ended $kills process(es) at the limit$(victims "$kills"); exit status $rc"
    elif { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && awk -v s="$seconds" -v t="$TIMEOUT" 'BEGIN {exit !(s >= t)}'; then
      reason="still running after ${TIMEOUT} s"
    elif grep -qiE "$refused" "$log"; then
      reason="an allocation was refused: '$(grep -m1 -iE "$refused" "$log" | sed 's/^\[[a-z]*[0-9]*\]://' | cut -c1-120)'; exit status $rc"
    else
      reason="exit status $rc"
    fi
    echo "killed/failed: $reason ($measured): $cmd"
    # The lines that say what went wrong (a launcher's root cause, an exception), else the last ones.
    if [ "${VERBOSE:-0}" != 1 ]; then
      { grep -E "root cause|what\(\)|Traceback|Error:|$refused" "$log" | head -n 4 ||
        grep -v 'gloo/transport' "$log" | tail -n 3 || true; } | sed 's/^/    | /'
    fi
  fi
done
