"""Summary of bench/ddp_step.sh's runs (its 'config=... impl=... key=value' lines on stdin, in round
order): per configuration the median over the runs of each phase's per-run median, the reduction's
cost to the step (backward minus backward under no_sync), and the ratios of the step time, each the
median of the per-round ratios: like for like (the same threads and allocator on both sides) first,
Python's defaults beside them, labelled."""
import statistics
import sys

FIELDS = ("median_ms", "data_ms", "zero_ms", "forward_ms", "backward_ms", "backward_nosync_ms", "optimizer_ms",
          "faults_per_step", "maxrss_mib")
runs = {}
order = []
for line in sys.stdin:
    kv = dict(item.split("=", 1) for item in line.split() if "=" in item)
    if "config" not in kv or "median_ms" not in kv:
        continue
    if kv["config"] not in runs:
        order.append(kv["config"])
    runs.setdefault(kv["config"], []).append(kv)
if not runs:
    sys.exit("ddp_step_summary: no runs on stdin")
PREFERRED = ("cpp-shm", "cpp", "cpp-torch-pool", "cpp-torch-pool-glibc", "python-like", "python-threads",
             "python-default")
order = [c for c in PREFERRED if c in runs] + [c for c in order if c not in PREFERRED]

med = {}
for config, rs in runs.items():
    med[config] = {f: statistics.median(float(r.get(f, "nan")) for r in rs) for f in FIELDS}
    med[config]["reduction_ms"] = med[config]["backward_ms"] - med[config]["backward_nosync_ms"]
    med[config]["threads"] = rs[0].get("threads", "?")

first = next(iter(runs.values()))[0]
print(f"\nmodel {first['model']}, world {first['world']}, batch {first['batch']}/rank, {first['steps']} steps per run, "
      f"{len(next(iter(runs.values())))} runs per configuration; medians over the runs of rank 0's per-run medians (ms)")
head = ("configuration", "step", "data", "zero", "forward", "backward", "reduction", "optimizer", "faults/step",
        "peak RSS MiB", "threads")
print(f"{head[0]:22}" + "".join(f"{h:>13}" for h in head[1:]))
for config in order:
    m = med[config]
    print(f"{config:22}{m['median_ms']:13.2f}{m['data_ms']:13.2f}{m['zero_ms']:13.2f}{m['forward_ms']:13.2f}"
          f"{m['backward_ms']:13.2f}{m['reduction_ms']:13.2f}{m['optimizer_ms']:13.2f}{m['faults_per_step']:13.0f}"
          f"{m['maxrss_mib']:13.1f}{m['threads']:>13}")
print("(step = zero + forward + backward + optimizer; reduction = backward - backward under no_sync, what the\n"
      " gradient reduction and waiting for the other ranks add; faults = minor page faults of rank 0 per step)")


def ratio(a, b, what):
    # Per round: the i-th run of each configuration ran in the same round, minutes apart at most, so
    # their ratio is robust to the machine's speed moving between rounds (a shared VM's does).
    if a in runs and b in runs:
        per_round = [float(x["median_ms"]) / float(y["median_ms"]) for x, y in zip(runs[a], runs[b])]
        print(f"  {a:22} / {b:16} {statistics.median(per_round):6.3f} ({min(per_round):.3f}-{max(per_round):.3f})"
              f"   {what}")


print("\nratios of the step time (< 1: ctorch faster): the median of the per-round ratios (their range)")
print(" like for like (the same threads and the same allocator on both sides):")
ratio("cpp-shm", "python-like", "ctorch as ctorch-train runs it (its kernels, shared-memory gradients)")
ratio("cpp", "python-like", "ctorch's Reducer through Gloo, as Python's DDP")
ratio("cpp-torch-pool", "python-like", "and torch's max_pool2d: the same kernels, DDP alone")
print(" the same threads, both on glibc's default allocator:")
ratio("cpp-torch-pool-glibc", "python-threads", "torch's kernels and glibc's defaults on both sides")
print(" against Python as it runs by default (its launcher's threads, glibc's defaults):")
ratio("cpp-shm", "python-default", "ctorch as shipped against Python's defaults")
ratio("cpp", "python-default", "")
