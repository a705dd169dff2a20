#!/usr/bin/env python3
"""Measures every CTest test of a build, one at a time, and writes the table CTest schedules with
(tests/schedule.tsv, read by tests/CMakeLists.txt): per test, the thirds of a core it keeps busy
(PROCESSORS: its CPU seconds, its own and its reaped children's, over its wall seconds, times 3,
rounded, 1 to 6) and its wall seconds (COST: the long ones start first).

    tests/schedule.py measure BUILD_DIR [-R REGEX] [--out PROFILE.tsv]   # ~25 min on 2 cores, serial
    tests/schedule.py table PROFILE.tsv [PROFILE.tsv ...] > tests/schedule.tsv
    tests/schedule.py slowest PROFILE.tsv [N]                            # a markdown table
    tests/schedule.py compare BEFORE.log AFTER.log [N]  # CTest logs (a lane's run): the N slowest
                                                        # of each, with the other's time

Measure on a quiet machine: a test's share of a core is what it takes when nothing else runs. With
several profiles (the two lanes), a test gets the larger of its figures."""
import json
import os
import re
import signal
import subprocess
import sys
import time

SLOTS_PER_CORE = 3


def tests_of(build, regex):
    info = json.loads(subprocess.check_output(["ctest", "--show-only=json-v1"], cwd=build))
    rx = re.compile(regex) if regex else None
    for t in info["tests"]:
        if rx and not rx.search(t["name"]):
            continue
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        if props.get("DISABLED") or "command" not in t:
            continue
        env = dict(os.environ)
        for kv in props.get("ENVIRONMENT", []):
            k, _, v = kv.partition("=")
            env[k] = v
        yield t["name"], t["command"], props.get("WORKING_DIRECTORY", build), env, float(props.get("TIMEOUT", 600))


def measure(build, regex, out):
    rows = []
    with open(out, "w") as f:
        f.write("# wall_s\tcpu_s\texit\ttest\n")
        for name, cmd, cwd, env, timeout in tests_of(build, regex):
            start = time.monotonic()
            p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            deadline = start + timeout
            while True:  # wait4: the rusage of the test and of every descendant it reaped
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    os.killpg(p.pid, signal.SIGKILL)
                time.sleep(0.02)
            wall = time.monotonic() - start
            cpu = ru.ru_utime + ru.ru_stime
            code = os.waitstatus_to_exitcode(status)
            f.write(f"{wall:.2f}\t{cpu:.2f}\t{code}\t{name}\n")
            f.flush()
            print(f"{wall:7.1f} s {cpu:7.1f} cpu-s exit {code:3d}  {name[:100]}", flush=True)
            rows.append((wall, cpu, code, name))
    return rows


def read(path):
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        wall, cpu, code, name = line.rstrip("\n").split("\t", 3)
        yield float(wall), float(cpu), int(code), name


def processors(wall, cpu):
    return max(1, min(2 * SLOTS_PER_CORE, round(SLOTS_PER_CORE * cpu / max(wall, 0.05))))


def table(paths):
    best = {}
    for path in paths:
        for wall, cpu, _, name in read(path):
            p, w = best.get(name, (0, 0.0))
            best[name] = (max(p, processors(wall, cpu)), max(w, wall))
    print("# PROCESSORS (thirds of a core)\tseconds\ttest name  (made by tests/schedule.py; see tests/CMakeLists.txt)")
    for name, (p, w) in sorted(best.items(), key=lambda kv: (-kv[1][1], kv[0])):
        print(f"{p}\t{w:.1f}\t{name}")


def slowest(path, n):
    rows = sorted(read(path), reverse=True)[:n]
    print("| s | CPU s | cores | test |\n|---:|---:|---:|---|")
    for wall, cpu, _, name in rows:
        print(f"| {wall:.1f} | {cpu:.1f} | {cpu / max(wall, 0.05):.2f} | {name} |")


CTEST_LINE = re.compile(r"^\s*\d+/\d+ Test\s+#\d+: (.*?) \.{3,}\s*(\S.*?)\s+([0-9.]+) sec\s*$")


def ctest_log(path):
    """Per test, its seconds in a CTest run's output (the last line for it: a repeated test's last)."""
    times = {}
    for line in open(path, errors="replace"):
        m = CTEST_LINE.match(line)
        if m:
            times[m.group(1)] = float(m.group(3))
    return times


def compare(before_path, after_path, n):
    before, after = ctest_log(before_path), ctest_log(after_path)
    for title, ranked, other, cols in (("before", before, after, ("before s", "after s")),
                                       ("after", after, before, ("after s", "before s"))):
        print(f"\nThe {n} slowest {title} ({len(ranked)} tests, {sum(ranked.values()):.0f} test-seconds in all):\n")
        print(f"| {cols[0]} | {cols[1]} | test (what it proves) |\n|---:|---:|---|")
        for name, secs in sorted(ranked.items(), key=lambda kv: -kv[1])[:n]:
            o = other.get(name)
            print(f"| {secs:.1f} | {'-' if o is None else f'{o:.1f}'} | {name.replace('|', '/')} |")


def main(argv):
    if len(argv) >= 2 and argv[0] == "measure":
        build = argv[1]
        regex = argv[argv.index("-R") + 1] if "-R" in argv else None
        out = argv[argv.index("--out") + 1] if "--out" in argv else "schedule-profile.tsv"
        rows = measure(build, regex, out)
        print(f"measured {len(rows)} tests: {sum(r[0] for r in rows):.0f} s, {sum(r[1] for r in rows):.0f} CPU s -> {out}")
    elif len(argv) >= 2 and argv[0] == "table":
        table(argv[1:])
    elif len(argv) >= 2 and argv[0] == "slowest":
        slowest(argv[1], int(argv[2]) if len(argv) > 2 else 30)
    elif len(argv) >= 3 and argv[0] == "compare":
        compare(argv[1], argv[2], int(argv[3]) if len(argv) > 3 else 30)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
