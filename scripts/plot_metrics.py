#!/usr/bin/python3
"""Plots ctorch-train's metrics file (JSONL) to a PNG: training loss and learning rate over epochs,
test loss and accuracy after each evaluation.

  /usr/bin/python3 scripts/plot_metrics.py run/metrics.jsonl [-o run/metrics.png]

Needs matplotlib (Debian: python3-matplotlib; scripts/setup.sh installs it). Records of steps that a
resumed run redid appear once (the last one written wins).
"""
import argparse
import json
import sys


def read(path):
    records = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{number}: not JSON ({e})")
            records[(r.get("kind"), r.get("step"))] = r
    by_kind = {}
    for (kind, _), r in sorted(records.items(), key=lambda kv: (kv[0][0] or "", kv[0][1] or 0)):
        by_kind.setdefault(kind, []).append(r)
    return by_kind


def task(train, evals):
    """classification, regression, or None (unknown): from the loss kind the records carry (ctorch-train
    writes loss_kind: nll, cross_entropy or mse), not from the presence of accuracy, which a run stopped
    before its first evaluation lacks."""
    kinds = {r["loss_kind"] for r in train + evals if r.get("loss_kind")}
    if kinds:
        return "regression" if kinds == {"mse"} else "classification"
    if any(r.get("accuracy") is not None for r in evals):
        return "classification"
    if evals:  # files of older versions: their classification evals always carry accuracy
        return "regression"
    return None


def resume_marks(data):
    """The points (in epochs) where a process continued the run from a snapshot, in order: the run's
    curve goes on there, and the plot marks each with a dashed line."""
    return sorted({r["epoch"] for r in data.get("resume", [])})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="the JSONL file ctorch-train wrote (--metrics-file)")
    p.add_argument("-o", "--output", help="PNG to write (default: the metrics file with .png)")
    args = p.parse_args()
    output = args.output or (args.metrics.rsplit(".", 1)[0] + ".png")
    data = read(args.metrics)
    train, evals = data.get("train", []), data.get("eval", [])
    if not train and not evals:
        sys.exit(f"{args.metrics}: no train or eval records")

    kind = task(train, evals)
    import matplotlib  # here, so that read() and task() work (and are tested) without it

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        left.plot([r["epoch"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if evals:
        left.plot([r["epoch"] for r in evals], [r["loss"] for r in evals], "o-", label="test loss")
    left.set_xlabel("epoch")
    left.set_ylabel("loss")
    left.grid(alpha=0.3)
    left.legend()
    if train:
        lr = left.twinx()
        lr.plot([r["epoch"] for r in train], [r["lr"] for r in train], color="gray", ls=":", lw=1)
        lr.set_ylabel("learning rate", color="gray")
    acc = [r for r in evals if r.get("accuracy") is not None]
    if acc:
        right.plot([r["epoch"] for r in acc], [100 * r["accuracy"] for r in acc], "o-", color="tab:green")
        right.set_ylabel("test accuracy (%)")
        best = max(acc, key=lambda r: r["accuracy"])
        right.set_title(f"best {100 * best['accuracy']:.2f}% after epoch {best['epoch']:g}")
    elif kind == "regression":
        right.text(0.5, 0.5, "no accuracy (regression)", ha="center", va="center")
    else:
        right.text(0.5, 0.5, "no evaluation yet (stopped before the first)", ha="center", va="center")
    right.set_xlabel("epoch")
    right.grid(alpha=0.3)
    marks = resume_marks(data)
    for i, at in enumerate(marks):
        for ax in (left, right):
            ax.axvline(at, color="tab:red", ls="--", lw=0.8, alpha=0.7,
                       label="resumed from a snapshot" if (i == 0 and ax is left) else None)
    if marks:
        left.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    resumed = f", {len(marks)} resume(s) marked" if marks else ""
    print(f"wrote {output} ({kind or 'task unknown'}{resumed})")


if __name__ == "__main__":
    main()
