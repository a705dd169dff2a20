#!/usr/bin/python3
"""Draws bench/parameter_server.sh's results (its SUMMARY lines: median ms per step) as a PNG: step time
against workers, one panel per place (one host; the namespace lab at each bandwidth) and model.

  /usr/bin/python3 bench/plot_parameter_server.py bench/results/parameter-server-DATE.txt -o docs/img/x.png

Needs matplotlib (Debian: python3-matplotlib, which the host's /usr/bin/python3 has).
"""
import argparse
import re
import sys

STYLE = {  # config: (label, colour, marker)
    "allreduce-shm": ("allreduce, shared memory (DDP default, one host)", "tab:green", "s"),
    "allreduce": ("allreduce, Gloo over TCP", "tab:blue", "o"),
    "ps1": ("parameter server, 1 server", "tab:red", "^"),
    "ps2": ("parameter server, 2 servers", "tab:orange", "v"),
}
MODELS = {"small": "small: simple-cnn, 0.17 M parameters", "large": "large: ResNet-18, 11.2 M parameters"}


def place_label(place):
    """lab-1gbit -> 'namespace lab, 1 Gbit/s per host link'."""
    m = re.fullmatch(r"lab-(\d+)([mg])bit", place)
    if not m:
        return place
    return f"namespace lab, {m.group(1)} {m.group(2).upper()}bit/s per host link (tc tbf)"


def read(path):
    medians = {}
    pattern = re.compile(r"SUMMARY (\S+) (\S+) (\d+) (\S+) ([\d.]+) ")
    with open(path) as f:
        for line in f:
            m = pattern.match(line)
            if m:
                place, model, workers, config, ms = m.groups()
                medians.setdefault((place, model), {}).setdefault(config, {})[int(workers)] = float(ms)
    if not medians:
        sys.exit(f"{path}: no SUMMARY lines (is it bench/parameter_server.sh's output?)")
    return medians


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    medians = read(args.results)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    places = []  # in the order the results name them
    for place, _ in medians:
        if place not in places:
            places.append(place)
    fig, axes = plt.subplots(len(places), 2, figsize=(10, 3.6 * len(places)), squeeze=False)
    for row, place in enumerate(places):
        for col, model in enumerate(("small", "large")):
            ax = axes[row][col]
            if (place, model) not in medians:
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{model} model: not run here", ha="center", va="center", fontsize=9)
                continue
            for config, by_workers in sorted(medians.get((place, model), {}).items(),
                                             key=lambda kv: list(STYLE).index(kv[0]) if kv[0] in STYLE else 99):
                label, colour, marker = STYLE.get(config, (config, None, "x"))
                xs = sorted(by_workers)
                ax.plot(xs, [by_workers[x] for x in xs], marker=marker, color=colour, label=label)
            where = "one host (127.0.0.1)" if place == "host" else place_label(place)
            ax.set_title(f"{MODELS[model]}\n{where}", fontsize=9)
            ax.set_xlabel("workers")
            ax.set_ylabel("ms per step (median)")
            ax.set_xticks([2, 4])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.output, dpi=80)


if __name__ == "__main__":
    main()
