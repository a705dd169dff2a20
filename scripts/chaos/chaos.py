#!/usr/bin/python3
# The chaos harness (issue 6): runs ctorch-train (or tests/consumer, a user's own loop on
# ctorch::ResilientTraining) under `ctorchrun --max-restarts K`, injects faults at seeded random
# moments, and checks after every run that nothing was lost. Run with Debian's
# /usr/bin/python3 (it needs torch to compare tensors and open snapshots). docs/reliability.md has
# the fault kinds, the checks, the commands and the measured numbers.
#
#   scripts/chaos/chaos.py --suite quick --seed 1            # the CTest subset (label `chaos`)
#   scripts/chaos/chaos.py --suite full --seed 1             # every kind on both workloads
#   scripts/chaos/chaos.py --suite long --faults 50 --seed 7 # 50 faults, kinds drawn at random
#   scripts/chaos/chaos.py --suite consumer --seed 1         # the same faults on a user's own loop
#   scripts/chaos/chaos.py --suite long --program consumer   #   (tests/consumer, ctorch::ResilientTraining)
#
# Everything random (scenario kinds, the rank hit, the moment) comes from --seed; the log
# (<work>/chaos.log and each run's output.log) records every decision, so a failure is replayed
# with the same seed.
import argparse
import fcntl
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "snapshot", "python"))

import torch  # noqa: E402
from check_snapshot import digest  # noqa: E402  the format's content digest, independent of C++

KINDS = ["worker-kill", "worker-segv", "snapshot-kill", "worker-stop", "launcher-term", "launcher-kill"]
# Not in the default mix: two ring-adjacent workers SIGKILLed at once (in-place recovery of a sharded
# run with shard copies: rank r's copy lives on rank r + 1, so that loss must fall back to the files).
EXTRA_KINDS = ["worker-kill-pair"]
WORKER_KINDS = ("worker-kill", "worker-segv", "worker-stop", "worker-kill-pair")
MARKER = "CTORCH_CHAOS_RUN"      # every process of a run inherits it: the /proc scan finds leftovers
STALL_ENV = "CTORCH_TEST_SNAPSHOT_STALL_MS"
TRAIN_TIMEOUT_S = 3              # the trainer's --timeout (collectives give up on a silent peer)
SHUTDOWN_TIMEOUT_S = 2           # ctorchrun's --shutdown-timeout (SIGTERM -> SIGKILL grace)

# Workloads: the program (ctorch-train unless `program` says otherwise) and its arguments (identical for
# the reference and the faulty runs), and the step delay that gives the faulty runs time to be hit
# (it does not change any result).
WORKLOADS = {
    "synthetic": dict(args=["--model", "linear", "--dataset", "synthetic-regression",
                            "--synthetic-size", "2048", "--batch-size", "32", "--epochs", "3",
                            "--save-every-steps", "4"],
                      steps_per_rank_world={1: 64, 2: 32, 3: 22}, epochs=3, delay_ms=40),
    # Node loss: 3 nodes of 1 worker, a world of 3 that becomes 2.
    "fashion-nodes": dict(args=["--model", "mnist-cnn", "--dataset", "fashion-mnist", "--train-limit", "1536",
                                "--test-limit", "1000", "--batch-size", "32", "--epochs", "3",
                                "--save-every-steps", "4"],
                          steps_per_rank_world={2: 24, 3: 16}, epochs=3, delay_ms=10),
    "fashion": dict(args=["--model", "mnist-cnn", "--dataset", "fashion-mnist", "--train-limit", "2560",
                          "--test-limit", "500", "--batch-size", "32", "--epochs", "2",
                          "--save-every-steps", "8"],
                    steps_per_rank_world={1: 80, 2: 40, 3: 27}, epochs=2, delay_ms=20),
    # The seeds' CNN cut into 2 pipeline stages (ctorch-train --pipeline-stages): each rank writes its
    # stage's shard; a lost rank restarts the group, which resumes from the stages' shards.
    "fashion-pipeline": dict(args=["--model", "mnist-cnn", "--dataset", "fashion-mnist", "--train-limit", "2560",
                                   "--test-limit", "500", "--batch-size", "32", "--epochs", "2",
                                   "--save-every-steps", "8", "--pipeline-stages", "2", "--micro-batches", "4"],
                             steps_per_rank_world={2: 80}, epochs=2, delay_ms=20),
    # A user's own loop on the installed library (tests/consumer/main.cpp: an MLP with dropout,
    # SGD with momentum, StepLR, ctorch::ResilientTraining), on its own synthetic regression set.
    "consumer": dict(program="consumer", args=["--epochs", "3", "--batch-size", "32", "--save-every-steps", "4"],
                     steps_per_rank_world={1: 64, 2: 32, 3: 22}, epochs=3, delay_ms=40),
    # The same loop with its randomness a function of (seed, rank, step): what in-place recovery
    # needs to stay exact (a replaced rank's generator state is gone with it).
    "consumer-seeded": dict(program="consumer", args=["--epochs", "3", "--batch-size", "32", "--save-every-steps", "4",
                                                      "--step-seed", "7"],
                            steps_per_rank_world={1: 64, 2: 32, 3: 22}, epochs=3, delay_ms=40),
    # The README's loop without try / recover() under --recovery in-place: the first fault's
    # replacement finds no survivor to re-form with, ctorchrun falls back to one group restart and
    # restarts the group after every later fault (issue 28.1).
    # The same loop with FullyShardedDataParallel and shard copies (ResilienceOptions::shardCopies):
    # a user's own sharded loop healing a lost rank's shard in place through the installed API.
    "consumer-fsdp": dict(program="consumer", args=["--epochs", "3", "--batch-size", "32", "--save-every-steps", "4",
                                                    "--step-seed", "7", "--sharding", "fsdp", "--shard-copies", "1"],
                          steps_per_rank_world={1: 64, 2: 32, 3: 22}, epochs=3, delay_ms=40),
    "consumer-norecover": dict(program="consumer", args=["--epochs", "3", "--batch-size", "32", "--save-every-steps", "4",
                                                         "--recover-in-place", "0"],
                               steps_per_rank_world={1: 64, 2: 32, 3: 22}, epochs=3, delay_ms=40, no_recover=True),
}
COMMON_ARGS = ["--log-interval", "1", "--progress", "lines", "--timeout", str(TRAIN_TIMEOUT_S)]
# The programs: the executable's name in a run (the /proc scan finds workers by it) and the
# arguments every run of it gets. The consumer prints a progress line per step by itself.
PROGRAMS = {"trainer": dict(exe="ctorch-train", common=COMMON_ARGS),
            "consumer": dict(exe="consumer", common=["--timeout", str(TRAIN_TIMEOUT_S)])}
WORKER_EXES = {p["exe"] for p in PROGRAMS.values()}

STEP_RE = re.compile(r"^\[default(\d+)\]:epoch (\d+)/(\d+)\s+step\s+(\d+)/(\d+)\s")
STARTED_RE = re.compile(r"started (\d+) worker\(s\) of .* \(attempt (\d+), restart (\d+) of (\d+)\)$")
REPLACED_RE = re.compile(r"replacing worker rank (\d+) \(local \d+\) in place")
SPARE_RE = re.compile(r"(?:spare|preloaded) worker (\S+) takes over rank (\d+) ")
FELLBACK_RE = re.compile(r"[Rr]estarting the whole group for this failure")  # the first fallback says it as a sentence
# In-place recovery of a sharded run (--shard-copies 1): a lost shard healed from the next rank's
# copy, or every rank reloading the snapshot files (and why).
HEALED_RE = re.compile(r"in-place recovery: healed (.*); continuing from")
HEALED_ONE_RE = re.compile(r"rank \d+'s shard from rank \d+'s copy")
RELOADED_RE = re.compile(r"in-place recovery: a lost shard cannot come back from memory \((.*)\): every rank reloads")
STORE_RE = re.compile(r"store ([0-9.:a-zA-Z\[\]-]+):(\d+)")
TMP_RE = re.compile(r"^(snapshot(?:-epoch)?\.pt)\.tmp-(\d+)-(\d+)$")
# A stopped worker (worker-stop) becomes a restart through a hang guard, which says so: a peer's
# collective timing out after --timeout (ctorch-train adds the flag; the library and Gloo name the
# time), or with in-place recovery the agent evicting the silent worker; a group's stop that had to
# wait out --shutdown-timeout says "grace period over".
TIMED_OUT_RE = re.compile(rf"timed out after {TRAIN_TIMEOUT_S} s\b|Timed out waiting {TRAIN_TIMEOUT_S * 1000} ?ms|"
                          rf"after --timeout {TRAIN_TIMEOUT_S} s\)")
EVICTED_RE = re.compile(r"stopped answering its peers: killing it")
SETUP_TIMED_OUT_RE = re.compile(r"connecting to the other ranks \(timeout \d+ s\) failed")
GRACE_OVER_RE = re.compile(r"grace period over")


class Log:
    def __init__(self, path, verbose):
        self.f = open(path, "a")
        self.verbose = verbose
        self.lock = threading.Lock()

    def __call__(self, msg, always=False):
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        with self.lock:
            self.f.write(line + "\n")
            self.f.flush()
            if self.verbose or always:
                print(line, flush=True)


# ---------------------------------------------------------------- processes of a run (/proc scan)
def proc_environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    env = {}
    for item in data.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def proc_exe_name(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0")[0].decode(errors="replace")
        return os.path.basename(argv0)
    except OSError:
        return ""


def marked_processes(run_id):
    """[(pid, env)] of live processes (zombies excluded) that carry this run's marker."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        env = proc_environ(pid)
        if env is None or env.get(MARKER) != run_id:
            continue
        st = proc_state(pid)
        if st is None or st == "Z":
            continue
        out.append((pid, env))
    return out


def program_of(workload):
    return WORKLOADS[workload].get("program", "trainer")


def trainer_workers(run_id, spares=None):
    """{rank: pid} of the run's worker processes (ctorch-train or the consumer). A spare that took a
    rank over (--spare-workers) set RANK after it started, which /proc does not show: `spares` maps
    its CTORCH_SPARE id to the rank, from the launcher's log."""
    ranks = {}
    for pid, env in marked_processes(run_id):
        if proc_exe_name(pid) not in WORKER_EXES:
            continue
        if "RANK" in env:
            ranks[int(env["RANK"])] = pid
        elif spares and env.get("CTORCH_SPARE") in spares:
            ranks[spares[env["CTORCH_SPARE"]]] = pid
    return ranks


def listening_sockets(netns=None):
    """{socket inode: port} of the TCP sockets listening in this network namespace, or in the named
    one (/run/netns/NAME). A socket's inode names it for as long as it exists, whoever later binds
    its port number."""
    if netns:
        out = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "cat", "/proc/net/tcp", "/proc/net/tcp6"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10).stdout.decode()
        lines = out.splitlines()
    else:
        lines = []
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(name) as f:
                    lines += f.read().splitlines()
            except OSError:
                pass
    sockets = {}
    for line in lines:
        parts = line.split()
        if len(parts) > 9 and parts[3] == "0A":  # LISTEN
            sockets[int(parts[9])] = int(parts[1].rsplit(":", 1)[1], 16)
    return sockets


def listening_ports(netns=None):
    """TCP ports listened on in this network namespace, or in the named one."""
    return set(listening_sockets(netns).values())


def socket_inodes(pid):
    """Inodes of the sockets process `pid` holds open (empty when it is gone)."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[len("socket:["):-1]))
    return found


def listeners_of(pid):
    """{socket inode: port} of the TCP sockets process `pid` listens on."""
    held = socket_inodes(pid)
    return {inode: port for inode, port in listening_sockets().items() if inode in held}


# ---------------------------------------------------------------- snapshots and parameters
def check_snapshot_file(path):
    """None if the file is a valid ctorch snapshot (zip CRCs, torch.load, header, content digest),
    else the problem."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
            if bad is not None:
                return f"record {bad} fails its CRC-32"
        snap = torch.load(path, map_location="cpu")
        h = snap["CTORCH_SNAPSHOT"]
        if h.get("magic") != "ctorch-snapshot":
            return f"header magic {h.get('magic')!r}"
        stored = h.pop("content_digest")
        computed = digest(snap)
        if stored != computed:
            return f"content digest: stored {stored}, computed {computed}"
        return None
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        return f"{type(e).__name__}: {e}"


def snapshot_files(run_dir):
    return sorted(n for n in os.listdir(run_dir)
                  if re.fullmatch(r"(snapshot(-epoch)?\.pt(\.\d+)?|checkpoint_epoch_\d+\.pt)", n))


def compare_weights(a_path, b_path):
    """None if the two state dicts hold bit-identical tensors, else the first difference."""
    a = torch.load(a_path, map_location="cpu")
    b = torch.load(b_path, map_location="cpu")
    if list(a.keys()) != list(b.keys()):
        return f"keys differ: {list(a.keys())} vs {list(b.keys())}"
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            return f"{k} differs (max abs difference {diff:g})"
    return None


# ---------------------------------------------------------------- one launch of ctorchrun
class Launch:
    """ctorchrun running in the background; its merged output is read line by line, logged with
    timestamps, and parsed for progress (global steps), attempts and store ports."""

    def __init__(self, run, index):
        self.run = run
        self.index = index
        cmd = run.command()
        run.log(f"[{run.name}] launch {index}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, cwd=run.dir, env=run.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.restarts = 0
        self.replacements = 0       # --recovery in-place: workers replaced alone
        self.fallbacks = 0          # ... whose group then restarted (the program does not recover)
        self.ended = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        out = self.run.output
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            now = time.monotonic()
            out.write(f"{now - self.run.t0:9.3f} L{self.index} {line}\n")
            with self.run.cond:
                self.run.lines.append((now, line))
            m = STEP_RE.match(line)
            if m and m.group(1) == "0":
                epoch, step, steps = int(m.group(2)), int(m.group(4)), int(m.group(5))
                self.run.on_step((epoch - 1) * steps + step, now)
                continue
            m = STARTED_RE.search(line)
            if m:
                self.restarts = max(self.restarts, int(m.group(3)))
                self.run.on_attempt(now)
            if REPLACED_RE.search(line):
                self.replacements += 1
                self.run.on_attempt(now)
            if FELLBACK_RE.search(line):
                self.fallbacks += 1
            m = HEALED_RE.search(line)
            if m:
                self.run.healed += len(HEALED_ONE_RE.findall(m.group(1)))
            m = RELOADED_RE.search(line)
            if m:
                self.run.reloads.append(m.group(1))
            m = SPARE_RE.search(line)
            if m:
                self.run.spares[m.group(1)] = int(m.group(2))
            m = STORE_RE.search(line)
            if m and "rendezvous round" in line:
                self.run.ports.add(int(m.group(2)))
                # The launcher's own listening sockets (its stores) while they serve the round: after
                # the run, none of them may still be open, whoever binds their port numbers since.
                self.run.listeners.update(listeners_of(self.proc.pid))
        out.flush()
        with self.run.cond:
            self.ended = True
            self.run.cond.notify_all()

    def wait(self, timeout):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.thread.join(timeout=10)
        return rc

    def kill_all(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass


# ---------------------------------------------------------------- one scenario
class Run:
    def __init__(self, h, name, workload, world, faults, rng):
        self.h = h
        self.log = h.log
        self.name = name
        self.workload = workload
        self.world = world
        self.faults = faults          # [(kind, target global step)]
        self.rng = rng
        self.dir = os.path.join(h.work, name)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.output = open(os.path.join(self.dir, "output.log"), "w")
        self.id = uuid.uuid4().hex
        self.env = dict(os.environ)
        self.env[MARKER] = self.id
        if any(k == "snapshot-kill" for k, _ in faults):
            self.env[STALL_ENV] = "300"
        self.ports = set()
        self.listeners = {}         # {socket inode: port}: what the launchers listened on, seen during the run
        self.spares = {}            # spare id -> the rank it took over (--spare-workers)
        self.healed = 0             # shards healed from a neighbour's copy (--shard-copies 1)
        self.reloads = []           # why a lost shard could not: every rank reloaded the files
        self.cond = threading.Condition()
        self.max_step = 0           # highest global step rank 0 reported, over all launches
        self.last_step = 0          # the latest one (falls back after a resume)
        self.step_events = []       # (time, global step)
        self.lines = []             # (time read, line) of every launch, in order
        self.attempt_times = []
        self.hang_problems = []     # hang_guard's findings, one list for the run
        self.t0 = time.monotonic()

    def command(self):
        return [self.h.ctorchrun, "--standalone", "--nproc-per-node", str(self.world),
                "--max-restarts", str(len(self.faults) + 2), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                "--recovery", self.h.args.recovery] + \
            (["--spare-workers", str(self.h.args.spare_workers)] if self.h.args.spare_workers else []) + \
            (["--preloaded-workers", self.h.args.preloaded_workers] if self.h.args.preloaded_workers else []) + \
            ["--log-dir", "logs"] + self.h.worker_command(self.workload, delayed=True)

    def on_step(self, step, now):
        with self.cond:
            self.last_step = step
            self.max_step = max(self.max_step, step)
            self.step_events.append((now, step))
            self.cond.notify_all()

    def on_attempt(self, now):
        with self.cond:
            self.attempt_times.append(now)
            self.cond.notify_all()

    def wait_for(self, pred, timeout):
        with self.cond:
            return self.cond.wait_for(pred, timeout=timeout)

    # -- the faults
    def pick_worker(self):
        deadline = time.monotonic() + 60  # (only stops a hang: every worker is normally there at once)
        while time.monotonic() < deadline:
            ranks = trainer_workers(self.id, self.spares)
            if len(ranks) == self.world:
                rank = self.rng.randrange(self.world)
                return rank, ranks[rank]
            time.sleep(0.02)
        raise RuntimeError(f"workers not found (saw {trainer_workers(self.id, self.spares)})")

    def catch_snapshot_write(self, timeout):
        """Waits until a snapshot's temporary file is being written; returns (writer pid, file, size)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n in os.listdir(self.dir):
                m = TMP_RE.match(n)
                if not m:
                    continue
                pid = int(m.group(2))
                try:
                    size = os.path.getsize(os.path.join(self.dir, n))
                except OSError:
                    continue
                if size > 0 and proc_state(pid) not in (None, "Z"):
                    return pid, n, size
            time.sleep(0.005)
        return None

    def execute(self):
        """Runs the scenario; returns the result dict."""
        res = dict(name=self.name, workload=self.workload, world=self.world,
                   faults=[k for k, _ in self.faults], injected=[], problems=[], lost=[], relaunches=0)
        launches = self.launches = [Launch(self, 0)]
        expected_rcs = []
        try:
            for kind, target in self.faults:
                cur = launches[-1]
                # A moment in the middle of training: rank 0 has passed the target step (and, after a
                # restart, has made progress again), then a random extra delay.
                if not self.wait_for(lambda: self.max_step >= target or cur.ended, 120) or cur.ended:
                    res["problems"].append(f"{kind}: training never reached step {target}")
                    break
                if cur.proc.poll() is not None:
                    res["problems"].append(f"{kind}: ctorchrun exited ({cur.proc.returncode}) before the fault")
                    break
                time.sleep(self.rng.uniform(0, 0.3))
                step_at = self.max_step
                t_fault = time.monotonic()
                workers_before = trainer_workers(self.id, self.spares)
                what = self.inject(kind, cur)
                if what is None:
                    res["problems"].append(f"{kind}: could not inject at step {step_at}")
                    break
                t_fault = what.pop("t", t_fault)
                res["injected"].append(dict(kind=kind, step=step_at, **what))
                self.log(f"[{self.name}] fault {len(res['injected'])}: {kind} at global step {step_at}: {what}")
                if kind in ("launcher-term", "launcher-kill"):
                    rc = cur.wait(60)
                    want = 75 if kind == "launcher-term" else -signal.SIGKILL
                    expected_rcs.append((cur.index, rc, want))
                    if kind == "launcher-kill":
                        # The supervisors must take every worker down with the launcher.
                        gone = self.wait_gone(60)  # (only stops a hang: they go at once)
                        if not gone:
                            res["problems"].append("after SIGKILL of ctorchrun: processes left " +
                                                   str([p for p, _ in marked_processes(self.id)]))
                    launches.append(Launch(self, len(launches)))
                    res["relaunches"] += 1
                res["lost"].append(self.measure_recovery(kind, t_fault, step_at))
                if self.h.args.recovery == "in-place" and kind in WORKER_KINDS \
                        and not WORKLOADS[self.workload].get("no_recover"):
                    # The survivors keep their processes: only the faulted ranks have new pids.
                    after = trainer_workers(self.id, self.spares)
                    faulted = what.get("ranks", [what.get("rank")])
                    for rank, pid in workers_before.items():
                        if rank not in faulted and rank in after and after[rank] != pid:
                            res["problems"].append(f"{kind} of rank {what.get('rank')}: survivor rank {rank} was "
                                                   f"restarted too (pid {pid} -> {after[rank]})")
                    res["survivors_checked"] = res.get("survivors_checked", 0) + (len(after) == self.world)
            final = launches[-1]
            rc = final.wait(300)
            if rc is None:
                res["problems"].append("ctorchrun did not finish within 300 s")
                final.kill_all()
                rc = final.wait(10)
            expected_rcs.append((final.index, rc, 0))
        finally:
            for l in launches:
                if l.proc.poll() is None:
                    l.kill_all()
                    l.wait(10)
            self.output.flush()
        res["seconds"] = round(time.monotonic() - self.t0, 2)
        for index, rc, want in expected_rcs:
            if rc != want:
                res["problems"].append(f"launch {index} exited {rc}, expected {want}")
        # A replacement whose group then restarted (fallback) is that fault's one restart, as the
        # launcher counts it against --max-restarts.
        res["fallbacks"] = sum(l.fallbacks for l in launches)
        res["restarts"] = sum(l.restarts + l.replacements for l in launches) - res["fallbacks"] + res["relaunches"]
        res["replacements"] = sum(l.replacements for l in launches) - res["fallbacks"]
        res["ports"] = sorted(self.ports)
        res["healed"] = self.healed
        res["reloads"] = list(self.reloads)
        res["problems"] += self.hang_problems
        self.output.close()
        return res

    def wait_gone(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not marked_processes(self.id):
                return True
            time.sleep(0.05)
        return False

    def inject(self, kind, launch):
        if kind == "worker-kill-pair":
            rank, pid = self.pick_worker()
            ranks = trainer_workers(self.id, self.spares)
            other = (rank + 1) % self.world
            t = time.monotonic()
            # Lost at once, however busy the machine: both are stopped before either is killed. On a
            # loaded machine this process can lose the CPU between two kills, long enough for the
            # launcher to replace the first and the second, still running, to heal it from its copy:
            # two single losses, not the loss of a shard and its copy that this fault is. A stopped
            # neighbour takes part in no recovery before its kill.
            os.kill(pid, signal.SIGSTOP)
            os.kill(ranks[other], signal.SIGSTOP)
            os.kill(pid, signal.SIGKILL)
            os.kill(ranks[other], signal.SIGKILL)
            return dict(rank=rank, ranks=[rank, other], pid=pid, t=t, replaced=2)
        if kind in ("worker-kill", "worker-segv", "worker-stop"):
            rank, pid = self.pick_worker()
            sig = {"worker-kill": signal.SIGKILL, "worker-segv": signal.SIGSEGV,
                   "worker-stop": signal.SIGSTOP}[kind]
            # The moment of the fault is taken before the signal: with a spare the launcher may log
            # the replacement before this thread runs again.
            t = time.monotonic()
            os.kill(pid, sig)
            return dict(rank=rank, pid=pid, t=t)
        if kind == "snapshot-kill":
            caught = self.catch_snapshot_write(30)
            if caught is None:
                return None
            pid, name, size = caught
            os.kill(pid, signal.SIGKILL)
            t = time.monotonic()
            # Proof that the kill landed mid-write: the temporary file is still there, half written.
            left = os.path.getsize(os.path.join(self.dir, name)) if os.path.exists(os.path.join(self.dir, name)) else -1
            return dict(pid=pid, file=name, bytes_at_kill=size, bytes_left=left, t=t)
        if kind == "launcher-term":
            t = time.monotonic()
            os.kill(launch.proc.pid, signal.SIGTERM)
            return dict(pid=launch.proc.pid, t=t)
        if kind == "launcher-kill":
            t = time.monotonic()
            os.kill(launch.proc.pid, signal.SIGKILL)
            return dict(pid=launch.proc.pid, t=t)
        raise ValueError(kind)

    def measure_recovery(self, kind, t_fault, step_at):
        """Seconds from the fault until the restarted workers' first step (detection, restart,
        start-up: `restart_s`) and until training is past the step it had reached (plus the redone
        steps: `lost_s`)."""
        def first_step_after(pred):
            with self.cond:
                starts = [t for t in self.attempt_times if t > t_fault]
                if not starts:
                    return None
                for t, s in self.step_events:
                    if t > starts[0] and pred(s):
                        return t
            return None
        self.wait_for(lambda: first_step_after(lambda s: s > step_at) is not None or self.launches[-1].ended, 120)
        t_any = first_step_after(lambda s: True)
        t_past = first_step_after(lambda s: s > step_at)
        if kind == "worker-stop":
            self.hang_problems += self.hang_guard(t_fault, t_any)
        return dict(kind=kind, restart_s=round(t_any - t_fault, 3) if t_any else None,
                    lost_s=round(t_past - t_fault, 3) if t_past else None)

    def hang_guard(self, t_fault, t_first):
        """A stopped worker became a restart (or an in-place replacement) through the hang guard, in
        this order: after the fault, the guard's line (a collective timing out after --timeout, or the
        agent evicting the silent worker) before the next attempt starts (the restarted workers' first
        step follows); with in-place recovery, the worker killed at once, not by a group stop's
        grace period. How long it took is printed, not judged (a loaded machine may take longer)."""
        if t_first is None:
            return ["a stopped worker was never followed by a restarted worker's step"]
        with self.cond:
            window = [line for t, line in self.lines if t_fault < t <= t_first]

        def first(rx):
            return next((i for i, line in enumerate(window) if rx.search(line)), None)
        nxt = min((i for i in (first(STARTED_RE), first(REPLACED_RE)) if i is not None), default=None)
        in_place = self.h.args.recovery == "in-place" and not WORKLOADS[self.workload].get("no_recover")
        guard = first(EVICTED_RE) if in_place else min(
            (i for i in (first(TIMED_OUT_RE), first(EVICTED_RE)) if i is not None), default=None)
        problems = []
        if nxt is None:
            problems.append("a stopped worker: no new attempt or replacement started before the next step")
        elif guard is None or guard > nxt:
            problems.append("a stopped worker: " + (
                "the agent did not evict it ('stopped answering its peers: killing it')" if in_place else
                f"no collective timed out after --timeout {TRAIN_TIMEOUT_S} s") + " before the next attempt started")
        elif in_place and any(GRACE_OVER_RE.search(line) for line in window[:nxt]):
            problems.append("a stopped worker replaced in place was killed by a group stop's grace period, "
                            "not evicted")
        return problems


# ---------------------------------------------------------------- the harness
class Harness:
    def __init__(self, args):
        self.args = args
        self.work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="ctorch-chaos-"))
        os.makedirs(self.work, exist_ok=True)
        self.log = Log(os.path.join(self.work, "chaos.log"), args.verbose)
        # Private copies: a rebuild during a long run must not swap the programs under it.
        bindir = os.path.join(self.work, "bin")
        os.makedirs(bindir, exist_ok=True)
        self.ctorchrun = shutil.copy2(os.path.abspath(args.ctorchrun), os.path.join(bindir, "ctorchrun"))
        self.trainer = shutil.copy2(os.path.abspath(args.trainer), os.path.join(bindir, "ctorch-train"))
        self.programs = {"trainer": self.trainer}
        if uses_consumer(args):
            self.programs["consumer"] = shutil.copy2(os.path.abspath(args.consumer),
                                                     os.path.join(bindir, PROGRAMS["consumer"]["exe"]))
        self.references = {}

    def worker_command(self, workload, delayed):
        """The worker program and its arguments for a workload (with its step delay for faulty runs)."""
        w = WORKLOADS[workload]
        program = program_of(workload)
        cmd = [self.programs[program]] + w["args"] + PROGRAMS[program]["common"]
        if program == "trainer" and self.args.trainer_args:  # e.g. --sharding full: reference and faulty alike
            cmd += shlex.split(self.args.trainer_args)
        return cmd + (["--step-delay-ms", str(w["delay_ms"])] if delayed else [])

    def reference(self, workload, world):
        """model.pt of an uninterrupted run of this workload and world size (no step delay). With
        --reference-cache DIR, one run per program build, workload, world size and arguments is shared
        by every chaos process that uses DIR (CTest's chaos tests: paid once, not once per suite); a
        process that finds another making it waits for it (a lock), and reads it only once complete."""
        key = (workload, world)
        if key in self.references:
            return self.references[key]
        cache = self.args.reference_cache
        if not cache:
            d = os.path.join(self.work, f"reference-{workload}-w{world}")
            self.references[key] = self.run_reference(workload, world, d)
            return self.references[key]
        os.makedirs(cache, exist_ok=True)
        identity = hashlib.sha256()
        worker = self.worker_command(workload, delayed=False)
        for path in (self.ctorchrun, worker[0]):
            with open(path, "rb") as f:  # the programs' bytes: a rebuild makes another reference
                for block in iter(lambda: f.read(1 << 20), b""):
                    identity.update(block)
        identity.update(repr((world, worker[1:])).encode())  # not the private copies' paths
        d = os.path.join(cache, f"{workload}-w{world}-{identity.hexdigest()[:16]}")
        with open(d + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another chaos process may be making it
            done = os.path.join(d, "reference-complete")
            if os.path.exists(done):
                self.log(f"reference {workload} w{world}: shared, made earlier ({d})", always=True)
                model = os.path.join(d, "model.pt")
            else:
                model = self.run_reference(workload, world, d)
                open(done, "w").close()
        self.references[key] = model
        return model

    def reference_command(self, workload, world):
        return [self.ctorchrun, "--standalone", "--nproc-per-node", str(world), "--log-dir", "logs"] + \
            self.worker_command(workload, delayed=False)

    def run_reference(self, workload, world, d):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        cmd = self.reference_command(workload, world)
        t = time.monotonic()
        for attempt in (1, 2, 3):
            with open(os.path.join(d, "output.log"), "w") as out:
                rc = subprocess.run(cmd, cwd=d, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=600).returncode
            # The ranks connect to each other within the trainer's --timeout (3 s: the faulty runs'
            # hang guard); on a very busy machine that set-up alone can miss it. The reference tests
            # nothing, it only has to finish: it runs again then (a faulty run would count a restart).
            if rc == 0 or not SETUP_TIMED_OUT_RE.search(open(os.path.join(d, "output.log"), errors="replace").read()):
                break
            self.log(f"reference {workload} w{world}: its ranks did not connect within --timeout {TRAIN_TIMEOUT_S} s "
                     f"(a busy machine): again ({attempt} of 3)", always=True)
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        if rc != 0:
            raise RuntimeError(f"reference run {workload} w{world} failed with {rc}: see {d}/output.log")
        self.log(f"reference {workload} w{world}: {time.monotonic() - t:.1f} s", always=True)
        return os.path.join(d, "model.pt")

    def check(self, run, res):
        # The final parameters, tensor by tensor, against the uninterrupted run.
        model = os.path.join(run.dir, "model.pt")
        if not os.path.exists(model):
            res["problems"].append("no model.pt")
            res["identical"] = False
        else:
            diff = compare_weights(self.reference(run.workload, run.world), model)
            res["identical"] = diff is None
            if diff:
                res["problems"].append(f"final parameters differ from the uninterrupted run: {diff}")
        # Every snapshot on disk loads and verifies.
        files = snapshot_files(run.dir)
        bad = [(n, check_snapshot_file(os.path.join(run.dir, n))) for n in files]
        bad = [(n, why) for n, why in bad if why]
        res["snapshots"] = len(files)
        for n, why in bad:
            res["problems"].append(f"snapshot {n} does not load: {why}")
        # One restart (or relaunch) per fault, no more, no fewer.
        # (a pair of workers lost at once in place is two replacements)
        replaced = sum(f.get("replaced", 1) if self.args.recovery == "in-place" else 1 for f in res["injected"])
        if res["restarts"] != replaced or len(res["injected"]) != len(res["faults"]):
            res["problems"].append(f"{len(res['faults'])} faults planned, {len(res['injected'])} injected, "
                                   f"{res['restarts']} restarts")
        # In-place recovery: every worker fault was repaired by replacing that worker alone.
        if self.args.recovery == "in-place" and WORKLOADS[run.workload].get("no_recover"):
            # One fallback per worker fault, no replacement kept: the program does not recover in place
            # and ctorchrun restarts the group for each failure (what a failure suggests never switches
            # in-place recovery off for the rest of the run: issue 58.3).
            worker_faults = sum(1 for f in res["injected"] if f["kind"] in WORKER_KINDS)
            if res.get("fallbacks", 0) != worker_faults or res.get("replacements", 0) != 0:
                res["problems"].append(f"a loop without recover(): {res.get('fallbacks', 0)} fallbacks to a group "
                                       f"restart and {res.get('replacements', 0)} replacements kept (want "
                                       f"{worker_faults} and 0)")
        elif self.args.recovery == "in-place":
            worker_faults = sum(f.get("replaced", 1) for f in res["injected"] if f["kind"] in WORKER_KINDS)
            if res.get("replacements", 0) != worker_faults:
                res["problems"].append(f"{worker_faults} worker faults, {res.get('replacements', 0)} in-place "
                                       f"replacements (a full restart happened instead)")
            # ctorchrun's default (--preloaded-workers auto: one preloaded worker when there is no spare): every
            # replacement started from a waiting process, whose takeover the launcher logged.
            preloaded = self.args.preloaded_workers in ("", "auto") and not self.args.spare_workers or \
                self.args.preloaded_workers not in ("", "auto", "0")
            # (a pair lost at once: the second replacement may start a new process)
            pairs = sum(1 for f in res["injected"] if f["kind"] == "worker-kill-pair")
            if (preloaded or self.args.spare_workers) and not worker_faults - pairs <= len(run.spares) <= worker_faults:
                res["problems"].append(f"{worker_faults} worker faults, {len(run.spares)} taken over by a waiting "
                                       f"spare or preloaded process (want every one)")
            if not preloaded and not self.args.spare_workers and run.spares:
                res["problems"].append(f"{len(run.spares)} faults taken over by a waiting process, with none asked for")
            if shard_copies(self.args, run.workload):
                # Every worker fault of a sharded run with shard copies ends in place: its shard healed
                # from the next rank's copy, or (two neighbours lost at once; a fault between a step's
                # update and its copy) every rank reloading the files, with the reason said.
                faults = sum(1 for f in res["injected"] if f["kind"] in WORKER_KINDS)
                singles = sum(1 for f in res["injected"] if f["kind"] in WORKER_KINDS and f["kind"] != "worker-kill-pair")
                both_lost = sum(1 for why in res["reloads"] if "were both lost" in why)
                if res["healed"] + len(res["reloads"]) != faults:
                    res["problems"].append(f"{faults} worker faults of a sharded run: {res['healed']} shards healed from "
                                           f"a copy, {len(res['reloads'])} reloads from the files (want one each)")
                if pairs and (run.world < 3 or both_lost != pairs):
                    res["problems"].append(f"{pairs} losses of two neighbours: {both_lost} reloads saying both were lost")
                if res["healed"] > singles:
                    res["problems"].append(f"{res['healed']} shards healed for {singles} single losses")
        # Nothing of the run left: processes (marker scan) and the sockets its launchers listened on.
        if not run.wait_gone(60):  # (ctorchrun reaps every worker before it exits: the bound only stops a hang)
            res["problems"].append("processes left alive: " +
                                   ", ".join(f"{p} ({proc_exe_name(p)})" for p, _ in marked_processes(run.id)))
            for p, _ in marked_processes(run.id):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        if not res["ports"]:
            res["problems"].append("no store port found in ctorchrun's log")
        unseen = sorted(set(res["ports"]) - set(run.listeners.values()))
        if unseen:
            res["problems"].append(f"store ports {unseen} logged, but ctorchrun was not seen listening on them")
        left = sorted({port for inode, port in run.listeners.items() if inode in listening_sockets()})
        if left:
            res["problems"].append(f"the launchers' listening sockets (store ports {left}) still open after the run")
        # A fault on the snapshot writer must have hit a half-written file.
        for f in res["injected"]:
            if f["kind"] == "snapshot-kill" and not (0 < f["bytes_at_kill"] and f["bytes_left"] >= 0):
                res["problems"].append(f"snapshot-kill did not land during a write: {f}")

    def run_scenario(self, name, workload, world, faults, seed):
        rng = random.Random(seed)
        self.reference(workload, world)
        run = Run(self, name, workload, world, faults, rng)
        self.log(f"[{name}] {workload} w{world} seed {seed} faults {faults}")
        res = run.execute()
        res["workload"] = workload
        self.check(run, res)
        res["ok"] = not res["problems"]
        lost = " ".join(f"{l['kind']}:{l['restart_s']}/{l['lost_s']}s" for l in res["lost"])
        line = (f"{'PASS' if res['ok'] else 'FAIL'}  {name:<28} {workload}/w{world}  faults "
                f"{len(res['injected'])}/{len(faults)}  restarts {res['restarts']}  "
                f"{'bit-identical' if res.get('identical') else 'NOT identical'}  snapshots {res['snapshots']} ok  "
                f"{res['seconds']:.1f} s  [restart/lost {lost}]" +
                (f"  healed {res['healed']}, reloaded {len(res['reloads'])}" if shard_copies(self.args, workload) else ""))
        self.log(line, always=True)
        for p in res["problems"]:
            self.log(f"      problem: {p}", always=True)
        if res["ok"] and not self.args.keep:
            shutil.rmtree(run.dir, ignore_errors=True)
        return res


def self_test(h):
    """Controls: every check of a run must bite. Each case breaks one thing on purpose (a parameter
    off by one ulp, one flipped bit in a snapshot, a leftover process, a listening socket) and fails
    unless the check notices."""
    failures = []
    d = os.path.join(h.work, "self-test")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    ref = h.reference("synthetic", 2)
    ref_dir = os.path.dirname(ref)
    # 1. Bit-identity: the reference equals itself; one ulp in one element does not.
    if compare_weights(ref, ref) is not None:
        failures.append("compare_weights: the reference differs from itself")
    sd = torch.load(ref)
    k = next(iter(sd))
    sd[k] = sd[k].clone()
    flat = sd[k].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
    torch.save(sd, os.path.join(d, "model.pt"))
    if compare_weights(ref, os.path.join(d, "model.pt")) is None:
        failures.append("compare_weights: a one-ulp change went unnoticed")
    # 2. Snapshots: the reference's load; a bit flip in tensor data, a truncation, a re-save with a
    #    changed entry (valid CRCs, stale digest) do not.
    snap = os.path.join(ref_dir, "snapshot.pt")
    if check_snapshot_file(snap) is not None:
        failures.append(f"check_snapshot_file refuses a good snapshot: {check_snapshot_file(snap)}")
    data = bytearray(open(snap, "rb").read())
    with zipfile.ZipFile(snap) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0)
    flipped = os.path.join(d, "flipped.pt")
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2] ^= 0x10
    open(flipped, "wb").write(bytes(data))
    truncated = os.path.join(d, "truncated.pt")
    open(truncated, "wb").write(open(snap, "rb").read()[:-100])
    edited = os.path.join(d, "edited.pt")
    s = torch.load(snap)
    s["GLOBAL_STEP"] += 1
    torch.save(s, edited)
    for bad in (flipped, truncated, edited):
        if check_snapshot_file(bad) is None:
            failures.append(f"check_snapshot_file accepts {os.path.basename(bad)}")
    # 3. A process carrying the marker is found; a reaped one is not.
    run_id = uuid.uuid4().hex
    p = subprocess.Popen(["sleep", "30"], env=dict(os.environ, **{MARKER: run_id}))
    try:
        # Until the child has exec'd, /proc shows the parent's environment (no marker): a loaded
        # machine can take a while, so look again (the bound only stops a hang).
        found, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:
            found = [pid for pid, _ in marked_processes(run_id)]
            if found:
                break
            time.sleep(0.05)
        if found != [p.pid]:
            failures.append("marked_processes does not find a live marked process")
    finally:
        p.kill()
        p.wait()
    if marked_processes(run_id):
        failures.append("marked_processes reports a reaped process")
    # 4. A listening socket is seen, by its inode, as this process's; once closed it is not (whoever
    #    binds its port since); a socket bound but not listening (its port held: nobody else can
    #    listen there meanwhile) is not seen listening.
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    mine = listeners_of(os.getpid())
    if port not in mine.values():
        failures.append(f"listeners_of misses this process's listening port {port} (saw {sorted(mine.values())})")
    if port not in listening_ports():
        failures.append(f"listening_ports misses listening port {port}")
    inodes = {inode for inode, p in mine.items() if p == port}
    sock.close()
    if inodes & set(listening_sockets()):
        failures.append(f"listening_sockets reports the closed socket of port {port}")
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 0))
        held_port = held.getsockname()[1]
        if held_port in listening_ports() or held_port in listeners_of(os.getpid()).values():
            failures.append(f"listening_ports reports port {held_port}, bound but not listening")
    finally:
        held.close()
    for f in failures:
        h.log(f"FAIL  self-test: {f}", always=True)
    h.log(f"self-test: {'PASS' if not failures else 'FAIL'} (controls: ulp change, bit flip, truncation, "
          f"stale digest, leftover process, listening socket)", always=True)
    return not failures


def damage(path, how, like):
    """Damages one snapshot file in place, as a disk, a crash or a user might."""
    data = bytearray(open(path, "rb").read())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "zeroed":
        data = bytearray(len(data))
    elif how == "empty":
        data = bytearray()
    elif how == "bit-flipped":
        with zipfile.ZipFile(path) as z:
            info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        data[info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2] ^= 0x04
    elif how == "foreign":
        torch.save({"weights": torch.zeros(3), "epoch": 2}, path)
        return
    elif how == "other-run":
        shutil.copyfile(like, path)  # a valid snapshot of another configuration
        return
    open(path, "wb").write(bytes(data))


# What the trainer must say for each damage: it names the file and the problem.
DAMAGE_WORDS = {"truncated": "truncated", "zeroed": "zero", "empty": "empty", "bit-flipped": "checksum",
                "foreign": "not a ctorch snapshot"}


def integrity(h):
    """Snapshot integrity with the real trainer under ctorchrun (2 ranks): a finished run's newest
    snapshot damaged (truncated, zeroed, empty, one bit flipped, a foreign torch.save file): running the
    same command again names the problem, falls back to snapshot.pt.1 and ends bit-identical to the
    uninterrupted run. Every file of the slot damaged: an error naming each, unless --resume never
    (a fresh start, again bit-identical). A snapshot of another configuration or model: refused,
    naming what differs."""
    results = []
    workload, world = "synthetic", 2
    ref = h.reference(workload, world)
    ref_dir = os.path.dirname(ref)
    base = [h.ctorchrun, "--standalone", "--nproc-per-node", str(world), "--log-dir", "logs", h.trainer] + \
        WORKLOADS[workload]["args"] + COMMON_ARGS
    other = os.path.join(h.work, "integrity-other-lr.pt")
    # A valid snapshot of the same model under another learning rate.
    od = os.path.join(h.work, "integrity-other")
    shutil.rmtree(od, ignore_errors=True)
    os.makedirs(od)
    subprocess.run(base + ["--lr", "0.1", "--max-steps", "4"], cwd=od, stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=120, check=True)
    shutil.copyfile(os.path.join(od, "snapshot.pt"), other)

    def case(name, files, how, extra, want_rc, want_words, identical):
        d = os.path.join(h.work, f"integrity-{name}")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(ref_dir, d, ignore=shutil.ignore_patterns("logs", "output.log", "model.pt"))
        for f in files:
            damage(os.path.join(d, f), how, other)
        t = time.monotonic()
        p = subprocess.run(base + extra, cwd=d, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=120)
        out = p.stdout.decode(errors="replace")
        open(os.path.join(d, "output.log"), "w").write(out)
        problems = []
        if p.returncode != want_rc:
            problems.append(f"exit {p.returncode}, expected {want_rc}")
        for w in want_words:
            if w not in out:
                problems.append(f"output lacks '{w}'")
        if "Traceback" in out or "terminate called" in out:
            problems.append("a stack trace or an uncaught exception in the output")
        if identical:
            diff = compare_weights(ref, os.path.join(d, "model.pt")) if os.path.exists(
                os.path.join(d, "model.pt")) else "no model.pt"
            if diff:
                problems.append(f"final parameters differ: {diff}")
        for n in snapshot_files(d):
            why = check_snapshot_file(os.path.join(d, n))
            if why and not (n in files and p.returncode != 0):
                problems.append(f"{n} left unusable: {why}")
        line = [l for l in out.splitlines() if "resume:" in l or "error:" in l]
        ok = not problems
        h.log(f"{'PASS' if ok else 'FAIL'}  integrity {name:<24} exit {p.returncode}  {time.monotonic() - t:.1f} s  "
              f"| {line[-1].split(']:', 1)[-1].strip()[:150] if line else ''}", always=True)
        for pr in problems:
            h.log(f"      problem: {pr}", always=True)
        if ok and not h.args.keep:
            shutil.rmtree(d, ignore_errors=True)
        results.append(dict(name=f"integrity-{name}", ok=ok, problems=problems, injected=[], lost=[]))

    for how, word in DAMAGE_WORDS.items():
        case(how, ["snapshot.pt"], how, [], 0,
             [f"skipped snapshot.pt: snapshot snapshot.pt is unusable", word, "resuming from snapshot.pt.1"], True)
    slot = ["snapshot.pt", "snapshot.pt.1", "snapshot.pt.2"]
    case("all-damaged", slot, "truncated", [], 2,
         ["no usable snapshot in snapshot.pt", "skipped snapshot.pt.2", "--resume never"], False)
    case("all-damaged-resume-never", slot, "truncated", ["--resume", "never"], 0, [], True)
    case("other-config", ["snapshot.pt"], "other-run", [], 2,
         ["does not fit this run", "config 'lr' is '0.1' in the snapshot, '0.05' in this run"], False)
    case("other-config-elsewhere", [], None, ["--resume", other], 2,
         ["does not fit this run", "'lr' is '0.1' in the snapshot"], False)
    # Another model on the same data: the fashion workload's snapshot resumed by another CNN.
    fref = os.path.dirname(h.reference("fashion", world))
    fbase = [h.ctorchrun, "--standalone", "--nproc-per-node", str(world), "--log-dir", "logs", h.trainer] + \
        WORKLOADS["fashion"]["args"] + COMMON_ARGS
    d = os.path.join(h.work, "integrity-other-model")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    args = [a if a != "mnist-cnn" else "simple-cnn" for a in fbase] + ["--resume", os.path.join(fref, "snapshot.pt")]
    p = subprocess.run(args, cwd=d, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=120)
    out = p.stdout.decode(errors="replace")
    ok = p.returncode == 2 and "model name is 'mnist-cnn' in the snapshot, 'simple-cnn' in this run" in out
    h.log(f"{'PASS' if ok else 'FAIL'}  integrity other-model              exit {p.returncode}  | "
          f"{[l for l in out.splitlines() if 'error:' in l][-1:]}", always=True)
    results.append(dict(name="integrity-other-model", ok=ok, problems=[] if ok else [out[-500:]],
                        injected=[], lost=[]))
    return results


def slurm_suite(h):
    """Preemption under a real Slurm cluster (scripts/lab/slurm.sh: 2 nodes in network namespaces):
    scripts/slurm/preemptible.sbatch running `srun ctorchrun ... ctorch-train` (or, with --program
    consumer, the user's loop of tests/consumer) (1 worker per node,
    world size 2) gets SIGUSR1 as `--signal=B:USR1@<s>` would send it (scancel --signal=USR1
    --batch); the workers save and exit 75, the script requeues, the requeued job resumes and ends
    bit-identical to the uninterrupted run. Then a running job is scancel'ed: nothing of it may
    survive."""
    results = []
    slurm_sh = os.path.join(ROOT, "scripts", "lab", "slurm.sh")
    if subprocess.run([slurm_sh, "check"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT).returncode != 0:
        h.log("CTORCH_SKIPPED: slurm.sh check: no Slurm lab possible here", always=True)
        return None
    workload = "consumer" if h.args.program == "consumer" else "synthetic"
    job_name = PROGRAMS[program_of(workload)]["exe"]  # the job's output file: <name>-<job id>.out
    ref = h.reference(workload, 2)
    up = subprocess.run([slurm_sh, "up", "2", "--gpus", "1", "--owner", str(os.getpid())],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    if up.returncode != 0:
        raise RuntimeError(f"slurm.sh up failed: {up.stderr.decode()[-500:]}")
    env = dict(os.environ)
    for line in up.stdout.decode().splitlines():
        k, sep, v = line.partition("=")
        if sep:
            env[k] = v
    lab_dir = env.get("LAB_SLURM_DIR", "")

    def sl(*cmd, timeout=30):
        return subprocess.run(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout).stdout.decode(errors="replace")

    def job_state(job):
        m = re.search(r"JobState=(\S+)", sl("scontrol", "show", "job", "-o", job))
        return m.group(1) if m else "?"

    def wait_state(job, states, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = job_state(job)
            if st in states:
                return st
            time.sleep(0.2)
        return job_state(job)

    def steps_in(path):
        try:
            text = open(path, errors="replace").read()
        except OSError:
            return 0, ""
        best = 0
        for m in re.finditer(r"\[(?:\S+:)?default0\]:epoch (\d+)/\d+\s+step\s+(\d+)/(\d+)", text):
            best = max(best, (int(m.group(1)) - 1) * int(m.group(3)) + int(m.group(2)))
        return best, text

    def submit(name, run_id):
        d = os.path.join(h.work, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        os.chmod(d, 0o777)
        job_env = dict(env, CTORCHRUN=h.ctorchrun, MAX_RESTARTS="0", **{MARKER: run_id})
        cmd = ["sbatch", "--parsable", "--gpus-per-node=1", "--cpus-per-task=1", f"--chdir={d}",
               f"--job-name={job_name}", os.path.join(ROOT, "scripts", "slurm", "preemptible.sbatch")] + \
            h.worker_command(workload, delayed=True)
        p = subprocess.run(cmd, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
        out = p.stdout.decode().strip()
        if p.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out}")
        job = out.split(";")[0]
        return d, job, os.path.join(d, f"{job_name}-{job}.out")

    def wait_steps(path, n, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if steps_in(path)[0] >= n:
                return True
            time.sleep(0.1)
        return False

    try:
        # 1. Preemption and requeue.
        problems = []
        run_id = uuid.uuid4().hex
        d, job, out = submit("slurm-preempt", run_id)
        t0 = time.monotonic()
        if not wait_steps(out, 30, 120):
            problems.append("the job never reached step 30")
        step_at = steps_in(out)[0]
        t_sig = time.monotonic()
        sl("scancel", "--signal=USR1", "--batch", job)
        st = wait_state(job, {"PENDING"}, 60)
        t_pending = time.monotonic()
        if st != "PENDING":
            problems.append(f"after SIGUSR1 the job is {st}, not PENDING (requeued)")
        # Slurm holds a requeued job back (~2 min); release it sooner, but not within the second of
        # the requeue: slurmd refuses a credential issued in the same second as the old one's
        # revocation ("Job credential revoked", the job FAILs without running). StartTime=now+2 would
        # wait for the scheduler's next pass (~30 s); an update to "now" schedules at once.
        time.sleep(2.0)
        sl("scontrol", "update", f"JobId={job}", "StartTime=now")
        t_release = time.monotonic()
        st = wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 180)
        _, text = steps_in(out)
        if st != "COMPLETED":
            problems.append(f"the requeued job ended {st}: " + sl("scontrol", "show", "job", "-o", job).strip()[:600])
        show = sl("scontrol", "show", "job", "-o", job)
        if "Restarts=1" not in show:
            counted = re.findall(r"Restarts=\d+", show)
            problems.append(f"Slurm counts {counted}, expected Restarts=1")
        # The resume line is the library's (ctorch::ResilientTraining): the same for either program.
        for want in ("SIGUSR1 received", "step ended preempted (exit 75)", f"requeueing job {job}",
                     "resuming from snapshot.pt", "exactly where it stopped", "(restart 1)"):
            if want not in text:
                problems.append(f"job output lacks '{want}'")
        t_resumed = None
        # Time from the release of the requeued job to its first step (Slurm start + rendezvous + resume).
        m = re.search(r"resuming from snapshot.pt after ([^(]*)\(global step (\d+)\)", text)
        if m:
            h.log(f"slurm: preempted at step ~{step_at}, resumed after {m.group(1).strip()} (global step {m.group(2)})")
        model = os.path.join(d, "model.pt")
        diff = compare_weights(ref, model) if os.path.exists(model) else "no model.pt"
        if diff:
            problems.append(f"final parameters differ from the uninterrupted run: {diff}")
        bad = [(n, check_snapshot_file(os.path.join(d, n))) for n in snapshot_files(d)]
        problems += [f"snapshot {n}: {why}" for n, why in bad if why]
        left = marked_processes(run_id)
        if left:
            problems.append(f"processes left: {[p for p, _ in left]}")
        ok = not problems
        h.log(f"{'PASS' if ok else 'FAIL'}  slurm preempt+requeue       job {job}: SIGUSR1 at step {step_at}, "
              f"requeued (PENDING) after {t_pending - t_sig:.1f} s, finished {time.monotonic() - t_release:.1f} s "
              f"after release, {'bit-identical' if not diff else 'NOT identical'}", always=True)
        for pr in problems:
            h.log(f"      problem: {pr}", always=True)
        results.append(dict(name="slurm-preempt", ok=ok, problems=problems, injected=[], lost=[]))

        # 2. scancel of a running job leaves nothing behind.
        problems = []
        run_id = uuid.uuid4().hex
        d, job, out = submit("slurm-scancel", run_id)
        if not wait_steps(out, 10, 120):
            problems.append("the job never reached step 10")
        before = [p for p, _ in marked_processes(run_id)]
        if not any(proc_exe_name(p) in WORKER_EXES for p in before):
            problems.append(f"no worker found before scancel (control): {before}")
        t = time.monotonic()
        sl("scancel", job)
        deadline = time.monotonic() + 60  # (only stops a hang: they are normally gone within a second)
        while time.monotonic() < deadline and marked_processes(run_id):
            time.sleep(0.05)
        gone_s = time.monotonic() - t
        left = marked_processes(run_id)
        if left:
            problems.append("processes left 60 s after scancel: " +
                            ", ".join(f"{p} ({proc_exe_name(p)})" for p, _ in left))
        st = wait_state(job, {"CANCELLED"}, 30)
        if st != "CANCELLED":
            problems.append(f"job state {st}")
        ok = not problems
        h.log(f"{'PASS' if ok else 'FAIL'}  slurm scancel               job {job}: {len(before)} processes of the job "
              f"before, none left {gone_s:.1f} s after scancel", always=True)
        for pr in problems:
            h.log(f"      problem: {pr}", always=True)
        results.append(dict(name="slurm-scancel", ok=ok, problems=problems, injected=[], lost=[]))
    finally:
        if lab_dir and (not results or not all(r["ok"] for r in results)):
            # Slurm's own logs explain most failures: keep them with the run.
            shutil.copytree(os.path.join(lab_dir, "log"), os.path.join(h.work, "slurm-log"), dirs_exist_ok=True)
        if lab_dir:
            subprocess.run([slurm_sh, "down", lab_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=120)
    return results


def lab_up(netns_sh, hosts):
    """A network-namespace lab of `hosts` hosts (scripts/lab/netns.sh), gone with this process; its prefix."""
    up = subprocess.run([netns_sh, "up", str(hosts), "--owner", str(os.getpid())], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, timeout=60)
    if up.returncode != 0:
        raise RuntimeError(f"netns.sh up failed: {up.stderr.decode()[-300:]}")
    lab = dict(l.split("=", 1) for l in up.stdout.decode().splitlines() if "=" in l)
    return lab["LAB_PREFIX"]


def kill_agents(agents):
    """Ends every agent of a lab run still running (its whole session: supervisors and workers)."""
    for a in agents.values():
        if a.poll() is None:
            try:
                os.killpg(a.pid, signal.SIGKILL)
            except OSError:
                pass
            a.wait(timeout=10)


def netns_of(pid):
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def nodes_suite(h, victim=3, failover=False):
    """Node loss with the trainer: three hosts (network namespaces, scripts/lab/netns.sh), one
    `ctorchrun --nnodes 2:3 --rdzv-backend c10d` agent with one worker each (world size 3), Fashion-MNIST
    subset. Mid-epoch, host `victim` is killed (every process of it SIGKILLed), or its link is cut. The
    two others must notice, re-form with world size 2, resume from the epoch boundary and finish, with an
    accuracy close to the undisturbed run's; a cut-off host's agent must give up by itself (exit 3, one
    clear line, its worker stopped). Host 1 serves the rendezvous store (the endpoint names it); with
    `failover` (the nodes-store suite: victim 1, ctorchrun --store-failover, host 1 pinned to node rank
    0) the survivors must re-form on host 2's standby store; --repeat runs each fault that many times."""
    netns_sh = os.path.join(ROOT, "scripts", "lab", "netns.sh")
    if subprocess.run([netns_sh, "check"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT).returncode != 0:
        h.log("CTORCH_SKIPPED: netns.sh check: no network namespaces here", always=True)
        return None
    workload = "fashion-nodes"
    ref = h.reference(workload, 3)
    ref_acc = last_accuracy(open(os.path.join(os.path.dirname(ref), "output.log")).read())
    # A run that loses a node trains partly under 2 ranks (a smaller global batch, more steps): its
    # accuracy is compared with undisturbed runs of 3 and of 2 ranks.
    ref2_acc = last_accuracy(open(os.path.join(os.path.dirname(h.reference(workload, 2)), "output.log")).read())
    lo_acc, hi_acc = min(ref_acc, ref2_acc) - 2.0, max(ref_acc, ref2_acc) + 2.0
    results = []
    survivors = tuple(i for i in (1, 2, 3) if i != victim)
    modes = [m for m in ("kill", "cut") if not h.args.only or h.args.only == m for _ in range(max(1, h.args.repeat))]
    for run_no, mode in enumerate(modes):
        prefix = lab_up(netns_sh, 3)
        problems = []
        d = os.path.join(h.work, f"nodes-{mode}-h{victim}-{run_no}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        run_id = uuid.uuid4().hex
        # In-place recovery across hosts signs its commands with a key all agents share.
        env = dict(os.environ, **{MARKER: run_id, "CTORCH_JOB_SECRET": "chaos-" + run_id + "-0123456789"})
        agents, outs = {}, {}
        try:
            for i in (1, 2, 3):
                cmd = [netns_sh, "exec", prefix, str(i), h.ctorchrun, "--nnodes", "2:3", "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400", "--rdzv-id", "chaos",
                       "--max-restarts", "3", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                       "--log-dir", f"logs-n{i}"] + \
                      (["--store-failover", "--node-rank", str(i - 1)] if failover else []) + \
                      (["--recovery", "in-place"] if h.args.recovery == "in-place" else []) + \
                      [h.trainer] + WORKLOADS[workload]["args"] + COMMON_ARGS + \
                      ["--step-delay-ms", str(WORKLOADS[workload]["delay_ms"])]
                outs[i] = open(os.path.join(d, f"node{i}.log"), "w+")
                agents[i] = subprocess.Popen(cmd, cwd=d, env=env, stdin=subprocess.DEVNULL, stdout=outs[i],
                                             stderr=subprocess.STDOUT, start_new_session=True)

            def text(i):
                return open(os.path.join(d, f"node{i}.log"), errors="replace").read()

            def step_of(t):
                best = 0
                for m in re.finditer(r"default0\]:epoch (\d+)/\d+\s+step\s+(\d+)/(\d+)", t):
                    best = max(best, (int(m.group(1)) - 1) * int(m.group(3)) + int(m.group(2)))
                return best

            # Mid-epoch 2 of 3.
            per_epoch = WORKLOADS[workload]["steps_per_rank_world"][3]
            target = per_epoch + 3 + random.Random(h.args.seed * 1000 + run_no).randrange(per_epoch - 6)
            deadline = time.monotonic() + 180
            # Rank 0 (which prints progress) is on whichever host joined first: read every log.
            def progress():
                return max(step_of(text(i)) for i in (1, 2, 3))

            while time.monotonic() < deadline and progress() < target:
                if any(a.poll() is not None for a in agents.values()):
                    break
                time.sleep(0.05)
            step_at = progress()
            if step_at < target:
                problems.append(f"training never reached step {target} (at {step_at})")
            victim_ns = os.stat(f"/run/netns/{prefix}-h{victim}").st_ino
            # Where each survivor's log stood before the fault: what follows is its reaction.
            before = {i: len(text(i)) for i in survivors}
            t_fault = time.monotonic()
            subprocess.run([netns_sh, mode, prefix, str(victim)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30)
            h.log(f"nodes-{mode}: host {victim} {mode} at global step {step_at}")
            # The survivors re-form with world size 2.
            t_reformed = None

            def survivors_after():
                return "".join(text(i)[before[i]:] for i in survivors)

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if re.search(r"rendezvous round \d+ complete: node 0 of 2, world size 2", survivors_after()):
                    t_reformed = time.monotonic()
                    break
                time.sleep(0.02)
            if t_reformed is None:
                problems.append("the survivors did not re-form with world size 2 within 60 s")
            t3_exit = None
            if mode == "cut":
                try:
                    rc3 = agents[victim].wait(timeout=60)
                    t3_exit = time.monotonic()
                except subprocess.TimeoutExpired:
                    rc3 = None
                    problems.append("the cut-off node's agent did not give up within 60 s")
                if rc3 != 3:
                    problems.append(f"the cut-off node's agent exited {rc3}, expected 3")
                if "this node is cut off from the others" not in text(victim):
                    problems.append("the cut-off node's agent did not say it is cut off")
                left = [p for p, _ in marked_processes(run_id) if netns_of(p) == victim_ns]
                if left:
                    problems.append(f"the cut-off node left processes: {[(p, proc_exe_name(p)) for p in left]}")
            rcs = {}
            for i in survivors:
                try:
                    rcs[i] = agents[i].wait(timeout=240)
                except subprocess.TimeoutExpired:
                    rcs[i] = None
                if rcs[i] != 0:
                    problems.append(f"node {i}'s agent exited {rcs[i]}, expected 0")
            if failover:
                # docs/store-failover.md's path, in order in each survivor's whole log (its agent has
                # exited): the loss noticed, the store taken over (host 2) or host 2's standby joined
                # (host 3), the round of 2 complete; and nothing in between waited out a join timeout
                # or a last call. (How long it took is printed, not judged: a loaded machine may take
                # longer.)
                for i, moved in ((survivors[0], "this node serves the rendezvous store now"),
                                 (survivors[1], "now using the rendezvous store of node")):
                    problems += failover_order(text(i)[before[i]:], i, moved)
            # Every agent of a survivor exited: nothing may listen there any more (stores, standbys).
            for i in survivors:
                left_ports = listening_ports(f"{prefix}-h{i}")
                if left_ports:
                    problems.append(f"host {i} still listens on {sorted(left_ports)} after its agent exited")
            t1 = "".join(text(i) for i in survivors)
            after = survivors_after()
            # The store host must not wait for the removed node's dead connection (close_timeout, 30 s).
            if "still connected to the rendezvous store hosted here" in t1:
                problems.append("the store host waited for a removed node's connection before exiting: " +
                                re.search(r".*still connected.*", t1).group(0)[:200])
            m = re.search(r"resume: (.*continued by 2 ranks.*|.*redone with 2 ranks.*|.*2 ranks.*)", after)
            if not m:
                problems.append("no resume line under world size 2 on the survivors")
            acc = last_accuracy(t1)
            if acc is None or not (lo_acc <= acc <= hi_acc):
                problems.append(f"accuracy {acc}% outside [{lo_acc:.1f}, {hi_acc:.1f}] (undisturbed runs: "
                                f"{ref_acc}% with 3 ranks, {ref2_acc}% with 2, +-2 points)")
            bad = [(n, check_snapshot_file(os.path.join(d, n))) for n in snapshot_files(d)]
            problems += [f"snapshot {n}: {why}" for n, why in bad if why]
            ok = not problems
            first_step = None
            ev = f"{'PASS' if ok else 'FAIL'}  nodes {mode:<4} host {victim} at global step {step_at}: "
            ev += f"survivors re-formed (world 2) {t_reformed - t_fault:.1f} s later" if t_reformed else "no re-form"
            if t3_exit:
                ev += f", cut-off agent exited 3 after {t3_exit - t_fault:.1f} s"
            ev += f"; accuracy {acc}% (undisturbed: {ref_acc}% with 3 ranks, {ref2_acc}% with 2)"
            h.log(ev + (f" | {m.group(0)[:160]}" if m else ""), always=True)
            for pr in problems:
                h.log(f"      problem: {pr}", always=True)
            results.append(dict(name=f"nodes-{mode}-host{victim}", ok=ok, problems=problems, injected=[], lost=[],
                                reform_s=round(t_reformed - t_fault, 2) if t_reformed else None,
                                cut_exit_s=round(t3_exit - t_fault, 2) if t3_exit else None,
                                accuracy=acc, reference_accuracy=[ref_acc, ref2_acc]))
        finally:
            kill_agents(agents)
            subprocess.run([netns_sh, "down", prefix], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=120)
            left = marked_processes(run_id)
            if left:
                results[-1]["ok"] = False if results else None
                h.log(f"FAIL  nodes {mode}: processes left after teardown {[p for p, _ in left]}", always=True)
    if len(results) > 2:
        for mode in ("kill", "cut"):
            rs = [r for r in results if r["name"].startswith(f"nodes-{mode}")]
            if not rs:
                continue
            ts = [r["reform_s"] for r in rs if r["reform_s"] is not None]
            h.log(f"host {victim} {mode}: survived {sum(1 for r in rs if r['ok'])} of {len(rs)}; re-formed after "
                  + (f"{sum(ts) / len(ts):.2f} s mean, {min(ts):.2f}-{max(ts):.2f} s" if ts else "-"), always=True)
    return results


def nodes_store_torchrun(h):
    """The side-by-side for the nodes-store suite: the same three hosts and the same fault (host 1,
    which serves the c10d rendezvous store, killed or cut off mid-training) under Debian's torchrun
    with the Python peer (bench/trainer/python_peer.py: PyTorch's DDP on Fashion-MNIST), torchrun's
    own elastic settings (--nnodes 2:3 --max_restarts 3). Records what becomes of the job: whether the
    survivors train another epoch, how their agents end and after how long. An observation, not a
    pass/fail of torchrun (it fails only when the harness could not run it)."""
    netns_sh = os.path.join(ROOT, "scripts", "lab", "netns.sh")
    torchrun = shutil.which("torchrun", path="/usr/bin") or "/usr/bin/torchrun"
    if subprocess.run([netns_sh, "check"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT).returncode != 0:
        h.log("CTORCH_SKIPPED: netns.sh check: no network namespaces here", always=True)
        return None
    if not os.access(torchrun, os.X_OK):
        h.log("CTORCH_SKIPPED: no torchrun (python3-torch) here", always=True)
        return None
    peer = os.path.join(ROOT, "bench", "trainer", "python_peer.py")
    epochs = 12
    results = []
    for run_no, mode in enumerate([m for m in ("kill", "cut") for _ in range(max(1, h.args.repeat))]):
        prefix = lab_up(netns_sh, 3)
        d = os.path.join(h.work, f"torchrun-{mode}-{run_no}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        run_id = uuid.uuid4().hex
        env = dict(os.environ, **{MARKER: run_id, "OMP_NUM_THREADS": "1"})
        agents, problems = {}, []
        try:
            for i in (1, 2, 3):
                cmd = [netns_sh, "exec", prefix, str(i), torchrun, "--nnodes", "2:3", "--nproc_per_node", "1",
                       "--rdzv_backend", "c10d", "--rdzv_endpoint", "n1:29400", "--rdzv_id", "chaos",
                       "--max_restarts", "3", "-r", "1", "-t", "1", "--log_dir", f"logs-n{i}", peer,
                       "--epochs", str(epochs), "--train-limit", "6000", "--test-limit", "500", "--data", "preloaded"]
                agents[i] = subprocess.Popen(cmd, cwd=d, env=env, stdin=subprocess.DEVNULL,
                                             stdout=open(os.path.join(d, f"node{i}.log"), "w"),
                                             stderr=subprocess.STDOUT, start_new_session=True)

            def text(i):
                return open(os.path.join(d, f"node{i}.log"), errors="replace").read()

            def epochs_done():
                return max([int(m.group(1)) for i in (1, 2, 3)
                            for m in re.finditer(r'"impl": "python".*?"epoch": (\d+)', text(i))] or [0])

            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and epochs_done() < 2:
                if any(a.poll() is not None for a in agents.values()):
                    break
                time.sleep(0.05)
            at = epochs_done()
            if at < 2:
                problems.append(f"torchrun's job never trained 2 epochs (at {at})")
                raise RuntimeError("; ".join(problems))
            before = {i: len(text(i)) for i in (2, 3)}
            t_fault = time.monotonic()
            subprocess.run([netns_sh, mode, prefix, "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=30)
            ends = {}
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and len(ends) < 2:
                for i in (2, 3):
                    if i not in ends and agents[i].poll() is not None:
                        ends[i] = (agents[i].returncode, time.monotonic() - t_fault)
                time.sleep(0.05)
            later = max([int(m.group(1)) for i in (2, 3)
                         for m in re.finditer(r'"impl": "python".*?"epoch": (\d+)', text(i)[before[i]:])] or [0])
            errors = sorted({m.group(0)[:140] for i in (2, 3) for m in
                             re.finditer(r"(RendezvousConnectionError|RendezvousError|RendezvousTimeoutError|"
                                         r"TimeoutError|RuntimeError)[^\n]*", text(i)[before[i]:])})
            survived = later == epochs and all(rc == 0 for rc, _ in ends.values()) and len(ends) == 2
            ev = (f"torchrun {mode:<4} host 1 after epoch {at}: " +
                  ("the job SURVIVED" if survived else "the job was LOST") +
                  f"; survivors' agents: " + ", ".join(f"host {i} exited {rc} after {t:.1f} s"
                                                        for i, (rc, t) in sorted(ends.items())) +
                  ("" if len(ends) == 2 else f", {2 - len(ends)} still running after 180 s") +
                  f"; epochs trained after the fault: {max(0, later - at)}")
            h.log(ev, always=True)
            for e in errors[:3]:
                h.log(f"      {e}", always=True)
            results.append(dict(name=f"torchrun-{mode}", ok=True, problems=[], injected=[], lost=[],
                                survived=survived, ends={str(i): v for i, v in ends.items()}, errors=errors[:3]))
        except Exception as e:  # noqa: BLE001
            h.log(f"FAIL  torchrun {mode}: {e}", always=True)
            results.append(dict(name=f"torchrun-{mode}", ok=False, problems=[str(e)], injected=[], lost=[]))
        finally:
            kill_agents(agents)
            subprocess.run([netns_sh, "down", prefix], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=120)
    return results


def nodes_inplace_suite(h):
    """In-place recovery across hosts: three hosts (network namespaces), one `ctorchrun --rdzv-backend
    c10d --recovery in-place` agent with one worker each (world size 3; the store is host 1's). Mid-epoch
    2 the worker on host 3 is SIGKILLed; in epoch 3 the worker on host 2 is SIGSTOPped (a hang: its
    peers time out and ask host 2's agent, through host 1's store, to kill it). Each must be replaced on
    its own host while the others keep their processes: no new rendezvous round, every agent exits 0,
    and the final parameters are bit-identical to an undisturbed run in the same lab."""
    netns_sh = os.path.join(ROOT, "scripts", "lab", "netns.sh")
    if subprocess.run([netns_sh, "check"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT).returncode != 0:
        h.log("CTORCH_SKIPPED: netns.sh check: no network namespaces here", always=True)
        return None
    workload = "fashion-nodes"
    per_epoch = WORKLOADS[workload]["steps_per_rank_world"][3]
    prefix = lab_up(netns_sh, 3)
    host_ns = {i: os.stat(f"/run/netns/{prefix}-h{i}").st_ino for i in (1, 2, 3)}
    results = []

    def run(name, faults):
        d = os.path.join(h.work, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        run_id = uuid.uuid4().hex
        # In-place recovery across hosts signs its commands with a key all agents share.
        env = dict(os.environ, **{MARKER: run_id, "CTORCH_JOB_SECRET": "chaos-" + run_id + "-0123456789"})
        agents, problems, injected = {}, [], []
        t0 = time.monotonic()

        def text(i):
            return open(os.path.join(d, f"node{i}.log"), errors="replace").read()

        def progress():
            best = 0
            for i in (1, 2, 3):
                for m in re.finditer(r"default0\]:epoch (\d+)/\d+\s+step\s+(\d+)/(\d+)", text(i)):
                    best = max(best, (int(m.group(1)) - 1) * int(m.group(3)) + int(m.group(2)))
            return best

        def worker_on(i):
            for pid, penv in marked_processes(run_id):
                if netns_of(pid) == host_ns[i] and proc_exe_name(pid) == "ctorch-train" and "RANK" in penv:
                    return pid
            return None

        try:
            for i in (1, 2, 3):
                cmd = [netns_sh, "exec", prefix, str(i), h.ctorchrun, "--nnodes", "3", "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400", "--rdzv-id", "chaos",
                       "--max-restarts", "3", "--recovery", "in-place", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                       "--log-dir", f"logs-n{i}", h.trainer] + WORKLOADS[workload]["args"] + COMMON_ARGS + \
                      ["--step-delay-ms", str(WORKLOADS[workload]["delay_ms"])]
                out = open(os.path.join(d, f"node{i}.log"), "w")
                agents[i] = subprocess.Popen(cmd, cwd=d, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            for host, sig, target in faults:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and progress() < target:
                    if any(a.poll() is not None for a in agents.values()):
                        break
                    time.sleep(0.02)
                pid = worker_on(host)
                if progress() < target or pid is None:
                    problems.append(f"could not hit host {host}'s worker at step {target} (at {progress()}, pid {pid})")
                    break
                others = {i: worker_on(i) for i in (1, 2, 3) if i != host}
                os.kill(pid, sig)
                injected.append((host, signal.Signals(sig).name, progress()))
                h.log(f"{name}: {signal.Signals(sig).name} to host {host}'s worker (pid {pid}) at step {progress()}")
                # Back to training with the same processes elsewhere.
                step_at, deadline = progress(), time.monotonic() + 60
                while time.monotonic() < deadline and progress() <= step_at + 1:
                    time.sleep(0.02)
                now = {i: worker_on(i) for i in others}
                for i, p in others.items():
                    if now.get(i) != p:
                        problems.append(f"host {i}'s worker was restarted too (pid {p} -> {now.get(i)})")
            for i in (1, 2, 3):
                try:
                    rc = agents[i].wait(timeout=240)
                except subprocess.TimeoutExpired:
                    rc = None
                if rc != 0:
                    problems.append(f"host {i}'s agent exited {rc}, expected 0")
            logs = {i: text(i) for i in (1, 2, 3)}
            if any(re.search(r"rendezvous round [1-9]\d* complete", t) for t in logs.values()):
                problems.append("a new rendezvous round ran: the group was restarted, not repaired in place")
            for host, sig, _ in injected:
                if "in place; the other workers keep running" not in logs[host]:
                    problems.append(f"host {host}'s agent did not replace its worker in place")
                if sig == "SIGSTOP" and "stopped answering its peers" not in logs[host]:
                    problems.append(f"host {host}'s agent was not asked to evict its hung worker")
        finally:
            kill_agents(agents)
        deadline = time.monotonic() + 60  # (only stops a hang: SIGKILLed sessions go at once)
        while marked_processes(run_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = marked_processes(run_id)
        if left:
            problems.append(f"processes left: {[(p, proc_exe_name(p)) for p, _ in left]}")
        return d, problems, injected, time.monotonic() - t0

    try:
        ref_dir, ref_problems, _, ref_s = run("nodes-inplace-reference", [])
        if ref_problems:
            raise RuntimeError(f"the undisturbed lab run failed: {ref_problems}")
        d, problems, injected, secs = run("nodes-inplace", [(3, signal.SIGKILL, per_epoch + 4),
                                                             (2, signal.SIGSTOP, 2 * per_epoch + 4)])
        diff = compare_weights(os.path.join(ref_dir, "model.pt"), os.path.join(d, "model.pt")) \
            if os.path.exists(os.path.join(d, "model.pt")) else "no model.pt"
        if diff:
            problems.append(f"final parameters differ from the undisturbed run: {diff}")
        ok = not problems
        h.log(f"{'PASS' if ok else 'FAIL'}  nodes in-place: {', '.join(f'{s} host {x} at step {st}' for x, s, st in injected)}"
              f"; {'bit-identical' if not diff else 'NOT identical'}; {secs:.1f} s (undisturbed {ref_s:.1f} s)",
              always=True)
        for pr in problems:
            h.log(f"      problem: {pr}", always=True)
        results.append(dict(name="nodes-inplace", ok=ok, problems=problems, injected=injected, lost=[]))
    finally:
        subprocess.run([netns_sh, "down", prefix], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return results


FAILOVER_NOTICED_RE = re.compile(r"store failover: .*; moving to the standby store of node")
REFORMED_RE = re.compile(r"rendezvous round \d+ complete: node \d+ of 2, world size 2")
WAITED_OUT_RE = re.compile(r"join timeout|rendezvous '[^']*' timed out after|last call for")


def failover_order(after, host, moved):
    """Problems with one survivor's store failover, from its log after the fault: the loss noticed,
    then `moved` (the takeover, or the move to the successor), then the round of 2 complete, with no
    join timeout or last call waited out in between."""
    lines = after.splitlines()

    def first(match, start=0):
        return next((i for i in range(start, len(lines)) if match(lines[i])), None)
    noticed = first(FAILOVER_NOTICED_RE.search)
    if noticed is None:
        return [f"host {host} did not notice the store's loss (no 'store failover: ...; moving to the standby store')"]
    took = first(lambda l: moved in l, noticed)
    if took is None:
        return [f"host {host}: no '{moved}' after it noticed the loss"]
    reformed = first(REFORMED_RE.search, took)
    if reformed is None:
        return [f"host {host}: no round of world size 2 after '{moved}'"]
    waited = [l for l in lines[noticed:reformed] if WAITED_OUT_RE.search(l)]
    if waited:
        return [f"host {host} waited out a timeout during the failover: {waited[0][:200]}"]
    return []


def last_accuracy(text):
    """The final test accuracy rank 0 reports in its closing line."""
    found = re.findall(r"done: .*test accuracy (\d+\.\d+)%", text)
    return float(found[-1]) if found else None


def plan_faults(rng, kinds, workload, world, count):
    """Target global steps spread over the run (never in the last few steps), one per fault."""
    w = WORKLOADS[workload]
    total = w["steps_per_rank_world"][world] * w["epochs"]
    lo, hi = 6, total - 6
    span = (hi - lo) / count
    return [(k, int(lo + span * i + rng.uniform(0, span * 0.6))) for i, k in enumerate(kinds)]


def build_suite(args, rng):
    """[(name, workload, world, [(kind, target step)], seed)]"""
    scen = []

    def add(name, workload, world, kinds):
        scen.append((name, workload, world, plan_faults(rng, kinds, workload, world, len(kinds)),
                     rng.randrange(1 << 30)))

    kinds = args.kinds.split(",") if args.kinds else KINDS
    consumer = args.program == "consumer"
    if args.suite == "consumer" or (args.suite == "quick" and consumer):
        # The user's own loop (the CTest subset of label `chaos`): every kind, two per run so that the
        # whole suite stays short; the second fault hits the restarted run.
        for i in range(0, len(kinds), 2):
            pair = kinds[i:i + 2]
            add("consumer-" + "+".join(pair), "consumer", 2, pair)
    elif args.suite == "quick":
        # One fault of each kind on the small synthetic run (the CTest subset; the full and long
        # suites add the Fashion-MNIST CNN).
        for k in kinds:
            add(f"{k}", "synthetic", 2, [k])
    elif args.suite == "pipeline":
        # A 2-stage pipeline of the trainer (the CTest subset): a killed, crashed, hung worker and a
        # kill during a snapshot's shard writes, two per run.
        add("pipeline-kill+snapshot-kill", "fashion-pipeline", 2, ["worker-kill", "snapshot-kill"])
        add("pipeline-segv+stop", "fashion-pipeline", 2, ["worker-segv", "worker-stop"])
    elif args.suite == "full":
        if consumer:
            for k in kinds:
                add(f"{k}-consumer", "consumer", 2, [k, k])
            add("mixed-consumer-w3", "consumer", 3, [rng.choice(kinds) for _ in range(3)])
            return scen
        for k in kinds:
            add(f"{k}-synthetic", "synthetic", 2, [k, k])
            add(f"{k}-fashion", "fashion", 2, [k])
        add("mixed-synthetic-w3", "synthetic", 3, [rng.choice(kinds) for _ in range(3)])
    elif args.suite == "inplace":
        # ctorchrun --recovery in-place: a killed, crashed or hung worker is replaced alone and the
        # survivors go on from memory (the CTest subset: the trainer on both workloads, 2 and 3 ranks,
        # and a user's own loop).
        if consumer:
            add("inplace-consumer", "consumer-seeded", 2, ["worker-kill", "worker-stop"])
            add("inplace-consumer-w3", "consumer-seeded", 3, ["worker-segv"])
            add("inplace-consumer-norecover", "consumer-norecover", 2, ["worker-kill", "worker-kill"])
            add("inplace-consumer-fsdp", "consumer-fsdp", 2, ["worker-kill", "worker-segv"])
            return scen
        if shard_copies(args):
            # A sharded run with shard copies (--trainer-args '--sharding full --shard-copies 1'): single
            # losses heal from the next rank's copy; two neighbours lost at once reload the files.
            add("inplace-sharded-w2", "synthetic", 2, ["worker-kill", "worker-segv"])
            add("inplace-sharded-w3", "synthetic", 3, ["worker-kill", "worker-kill-pair", "worker-segv"])
            return scen
        add("inplace-kill-synthetic", "synthetic", 2, ["worker-kill", "worker-kill"])
        add("inplace-stop-synthetic", "synthetic", 2, ["worker-stop"])
        add("inplace-w3-synthetic", "synthetic", 3, ["worker-segv", "worker-kill"])
        add("inplace-fashion", "fashion", 2, ["worker-kill", "worker-stop"])
    elif args.suite == "long":
        left, i = args.faults, 0
        while left > 0:
            n = min(args.per_run, left)
            workload = "consumer" if consumer else "fashion" if i % 3 == 2 else "synthetic"
            add(f"long-{i:02d}-{workload}", workload, args.world, [rng.choice(kinds) for _ in range(n)])
            left -= n
            i += 1
    return scen


def shard_copies(args, workload=None):
    """True when the runs keep shard copies (in-place recovery of a sharded run): the trainer's
    arguments say so, or the workload's own (a consumer's)."""
    if workload is not None and "--shard-copies" in WORKLOADS[workload]["args"]:
        return WORKLOADS[workload]["args"][WORKLOADS[workload]["args"].index("--shard-copies") + 1] == "1"
    return args.program == "trainer" and re.search(r"--shard-copies[ =]1\b", args.trainer_args or "") is not None


def uses_consumer(args):
    return args.suite == "consumer" or args.program == "consumer"


def main():
    here = ROOT
    ap = argparse.ArgumentParser(description="Seeded fault injection into ctorchrun + ctorch-train (or consumer) runs.")
    ap.add_argument("--suite", choices=["quick", "full", "long", "self-test", "integrity", "slurm", "nodes", "consumer",
                                        "pipeline", "inplace", "nodes-inplace", "nodes-store", "nodes-store-torchrun"],
                    default="quick")
    ap.add_argument("--recovery", choices=["restart", "in-place"], default="",
                    help="ctorchrun's --recovery for the faulty runs (default: in-place for the inplace suite, "
                         "else restart)")
    ap.add_argument("--program", choices=["trainer", "consumer"], default="trainer",
                    help="quick, full, long, slurm: fault the trainer (default) or the consumer "
                         "(tests/consumer, a user's loop on ctorch::ResilientTraining)")
    ap.add_argument("--spare-workers", type=int, default=0,
                    help="with --recovery in-place: ctorchrun's --spare-workers (processes started ahead)")
    ap.add_argument("--preloaded-workers", default="",
                    help="with --recovery in-place: ctorchrun's --preloaded-workers (default: ctorchrun's, auto)")
    ap.add_argument("--trainer-args", default="",
                    help="more ctorch-train arguments for every trainer run, reference and faulty (e.g. '--sharding full')")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", type=int, default=50, help="long suite: faults in all")
    ap.add_argument("--repeat", type=int, default=1, help="nodes suites: runs of each fault (kill, cut)")
    ap.add_argument("--per-run", type=int, default=4, help="long suite: faults per run")
    ap.add_argument("--world", type=int, default=2, choices=[2, 3], help="long suite: workers per run")
    ap.add_argument("--kinds", default="", help=f"comma-separated subset of {','.join(KINDS)}")
    ap.add_argument("--only", default="", help="run only scenarios whose name contains this")
    ap.add_argument("--ctorchrun", default=os.path.join(here, "build", "launcher", "agent", "ctorchrun"))
    ap.add_argument("--trainer", default=os.path.join(here, "build", "trainer", "app", "ctorch-train"))
    ap.add_argument("--consumer", default=os.path.join(here, "build", "tests", "consumer", "consumer"),
                    help="the consumer program (the consumer CTest leaves it here: "
                         "ctest --test-dir build -R 'consumer: find_package')")
    ap.add_argument("--work", default="", help="directory for runs and logs (default: a new temporary one)")
    ap.add_argument("--reference-cache", default="",
                    help="directory whose uninterrupted reference runs every chaos process using it shares "
                         "(one per program build, workload, world size and arguments; CTest's chaos tests)")
    ap.add_argument("--keep", action="store_true", help="keep the directories of passed runs")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if not args.recovery:
        args.recovery = "in-place" if args.suite == "inplace" else "restart"
    for k in (args.kinds.split(",") if args.kinds else []):
        if k not in KINDS + EXTRA_KINDS:
            ap.error(f"--kinds: unknown fault kind '{k}' (known: {', '.join(KINDS + EXTRA_KINDS)})")
    for p in (args.ctorchrun, args.trainer):
        if not os.access(p, os.X_OK):
            ap.error(f"'{p}' is not an executable (build it: scripts/build.sh --target ctorchrun ctorch-train)")
    if uses_consumer(args) and not os.access(args.consumer, os.X_OK):
        ap.error(f"'{args.consumer}' is not an executable (the consumer test builds it: "
                 f"ctest --test-dir build -R 'consumer: find_package')")
    if args.program == "consumer" and args.suite in ("integrity", "nodes", "nodes-store", "self-test"):
        ap.error(f"--program consumer: the {args.suite} suite runs the trainer only")

    h = Harness(args)
    if args.suite == "self-test":
        ok = self_test(h)
        if ok and not args.keep and not args.work:
            shutil.rmtree(h.work, ignore_errors=True)
        return 0 if ok else 1
    if args.suite in ("integrity", "slurm", "nodes", "nodes-inplace", "nodes-store", "nodes-store-torchrun"):
        results = {"integrity": integrity, "slurm": slurm_suite, "nodes": nodes_suite,
                   "nodes-inplace": nodes_inplace_suite,
                   "nodes-store": lambda h: nodes_suite(h, victim=1, failover=True),
                   "nodes-store-torchrun": nodes_store_torchrun}[args.suite](h)
        if results is None:
            return 0  # skipped
        failed = sum(1 for r in results if not r["ok"])
        h.log(f"{len(results) - failed} passed, {failed} failed", always=True)
        if not failed and not args.keep and not args.work:
            shutil.rmtree(h.work, ignore_errors=True)
        return 0 if failed == 0 else 1
    rng = random.Random(args.seed)
    suite = build_suite(args, rng)
    h.log(f"chaos: suite {args.suite} seed {args.seed}: {len(suite)} scenarios, work {h.work}", always=True)
    results = []
    for name, workload, world, faults, seed in suite:
        if args.only and args.only not in name:
            continue
        try:
            results.append(h.run_scenario(name, workload, world, faults, seed))
        except Exception as e:  # noqa: BLE001 - a harness error fails the scenario, the rest still runs
            h.log(f"FAIL  {name}: harness error {type(e).__name__}: {e}", always=True)
            results.append(dict(name=name, ok=False, problems=[str(e)], injected=[], lost=[]))
    passed = sum(1 for r in results if r["ok"])
    failed = len(results) - passed
    injected = sum(len(r["injected"]) for r in results)
    survived = sum(len(r["injected"]) for r in results if r["ok"])
    identical = sum(1 for r in results if r.get("identical"))
    h.log(f"faults injected {injected}, survived {survived}; bit-identical runs {identical}/{len(results)}",
          always=True)
    if shard_copies(args) or any(shard_copies(args, r.get("workload")) for r in results if r.get("workload")):
        healed = sum(r.get("healed", 0) for r in results)
        reloads = [why for r in results for why in r.get("reloads", [])]
        h.log(f"  shards healed from a neighbour's copy {healed}, reloads from the files {len(reloads)}", always=True)
        for why in reloads:
            h.log(f"    reloaded: {why}", always=True)
        # The heal itself must have been exercised, not only its fallback.
        if results and healed == 0 and any(r.get("injected") for r in results):
            h.log("FAIL  no lost shard was healed from a copy: every fault fell back to the files", always=True)
            return 1
    by_kind = {}
    for r in results:
        for l in r["lost"]:
            by_kind.setdefault(l["kind"], []).append(l)
    for k in KINDS + EXTRA_KINDS:
        ls = by_kind.get(k)
        if not ls:
            continue
        rs = [l["restart_s"] for l in ls if l["restart_s"] is not None]
        lo = [l["lost_s"] for l in ls if l["lost_s"] is not None]
        if rs and lo:
            h.log(f"  {k:<14} n={len(ls):<3} back to training {sum(rs) / len(rs):5.2f} s (max {max(rs):.2f}), "
                  f"time lost {sum(lo) / len(lo):5.2f} s (max {max(lo):.2f})", always=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    h.log(f"{passed} passed, {failed} failed", always=True)
    if not failed and not args.keep and not args.work:
        shutil.rmtree(h.work, ignore_errors=True)
    return 0 if failed == 0 and results else 1


if __name__ == "__main__":
    sys.exit(main())
