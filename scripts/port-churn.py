#!/usr/bin/env python3
# A port churner for load tests (issue 57): opens and closes loopback TCP connections as fast as it
# can until it is stopped, so that the kernel's ephemeral port range is in constant use while a suite
# runs beside it. A port picked by binding port 0 and closing the socket is then soon taken by one of
# these connections before the server it was meant for binds it: such a picker fails here, a server
# that binds port 0 itself (or a fixed port below the ephemeral range, scripts/lib/ports.sh) does not.
#
# What each process does, in a loop: a client socket, half of them first bound to 127.0.0.1:0 (the
# kernel's bind(0) search, which prefers odd ports: the one a bind-and-close picker uses) and half
# left to connect()'s own search (even ports first), connects to this process's listener on
# 127.0.0.1:0; the listener's side is accepted without blocking. The last --hold connections of each
# side stay open (the ports in use at any moment: procs x hold), older ones are closed with
# SO_LINGER 0: a reset, never a FIN, so that no TIME_WAIT is left on either side and the range is not
# exhausted for the rest of the machine. Connections that fail are counted by errno, retried after 1 ms.
#
# Measured on the 2-core VM (Linux 6.18, ephemeral range 32768-60999): one process makes ~12,000
# connections/s, holds 2,000 ports, leaves no TIME_WAIT of its own (`ss -tan state time-wait` with its
# listener's port: 0); a port picked by binding 0 and closing, bound again 0.2 s later, was taken 22
# times in 200 (none in 100 without it); with --procs 2 --hold 4000, 12 in 100.
#
#   scripts/port-churn.py [--procs 1] [--hold 2000] [--seconds S]
#
# Stop it with SIGTERM or SIGINT (or --seconds): it prints the connections made, per second, and the
# failures by errno, on stdout. Standard library only (Debian's /usr/bin/python3 or any python3 >= 3.7).
import argparse
import collections
import errno
import os
import resource
import signal
import socket
import struct
import sys
import time

LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, skips TIME_WAIT


def abort(sock):
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    except OSError:
        pass
    sock.close()


def die_with_parent():
    """SIGTERM when the parent dies (a SIGKILLed parent leaves no churner behind); Linux only."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(0)


def churn(hold, stop_at, result_fd):
    """One process: connect and reset against its own listener until SIGTERM or stop_at; writes
    "connections failures-by-errno" to result_fd."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    listener.setblocking(False)
    target = listener.getsockname()
    clients, served = collections.deque(), collections.deque()
    made, failed, n = 0, collections.Counter(), 0
    while not stopping and (stop_at is None or n % 256 or time.monotonic() < stop_at):
        n += 1
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if n % 2:
                c.bind(("127.0.0.1", 0))
            c.connect(target)
            made += 1
            clients.append(c)
        except OSError as e:
            failed[errno.errorcode.get(e.errno, str(e.errno))] += 1
            abort(c)
            time.sleep(0.001)
        while True:
            try:
                s, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                failed["accept " + errno.errorcode.get(e.errno, str(e.errno))] += 1
                break
            served.append(s)
        while len(clients) > hold:
            abort(clients.popleft())
        while len(served) > hold:
            abort(served.popleft())
    for s in list(clients) + list(served):
        abort(s)
    listener.close()
    try:
        os.write(result_fd, (f"{made} " + " ".join(f"{k}={v}" for k, v in failed.items()) + "\n").encode())
    except BrokenPipeError:
        pass  # the parent is gone (killed): nobody to tell
    os.close(result_fd)


def main():
    ap = argparse.ArgumentParser(description="Open and reset loopback TCP connections as fast as possible "
                                             "until stopped (SIGTERM, SIGINT or --seconds).")
    ap.add_argument("--procs", type=int, default=1, help="processes churning side by side (default 1)")
    ap.add_argument("--hold", type=int, default=2000,
                    help="connections each process keeps open before resetting the oldest (default 2000)")
    ap.add_argument("--seconds", type=float, default=None, help="stop by itself after this long")
    a = ap.parse_args()
    if a.procs < 1 or a.hold < 0 or (a.seconds is not None and a.seconds <= 0):
        ap.error("--procs must be at least 1, --hold at least 0, --seconds more than 0")
    # Two descriptors per held connection and process, and some room.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * a.hold + 64
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            ap.error(f"--hold {a.hold} needs {need} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    t0 = time.monotonic()
    stop_at = t0 + a.seconds if a.seconds else None
    children = []

    # The parent forwards a stop to its children and sums what they made.
    def stop(*_):
        for pid, _ in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for _ in range(a.procs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (not the parent's forwarding handler)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            try:
                die_with_parent()
                churn(a.hold, stop_at, w)
            except BaseException as e:  # noqa: BLE001 - a child says why and leaves
                print(f"port-churn: process {os.getpid()}: {type(e).__name__}: {e}", file=sys.stderr)
                code = 1
            os._exit(code)
        os.close(w)
        children.append((pid, r))
    made, failed, bad = 0, collections.Counter(), 0
    for pid, r in children:
        with os.fdopen(r) as f:
            line = f.read().split()
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        bad += status != 0
        if line:
            made += int(line[0])
            for item in line[1:]:
                k, v = item.rsplit("=", 1)
                failed[k] += int(v)
    secs = time.monotonic() - t0
    print(f"port-churn: {made} connections in {secs:.1f} s: {made / max(secs, 1e-9):.0f}/s "
          f"({a.procs} process{'es' if a.procs > 1 else ''}, {a.hold} held each)" +
          (f"; failed: {', '.join(f'{k} {v}' for k, v in failed.most_common())}" if failed else ""),
          flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
