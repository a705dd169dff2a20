#!/usr/bin/env python3
"""The library's rooms and which way their includes run (docs/library-layout.md).

Fails, naming the file and the include, when a room includes one above it, when a folder under
trainer/src/ or a public header is in no room, when a public header includes an internal one, or
when models/ or data/ include more of the library than their one small header.
Usage: check_layout.py PROJECT_ROOT
"""
import os
import re
import sys

# Floors, from the ground up. A room may include its own floor and those below.
FLOORS = {
    "core": 1,
    "comm": 2, "sampler": 2, "tensorboard": 2, "optim": 2,
    "snapshot": 3, "ddp": 3, "amp": 3, "zero": 3,
    "fsdp": 4, "parameter_server": 4, "cuda_graph": 4, "pipeline": 4,
    "resilience": 5,
}
# Each public header (trainer/include/ctorch/<name>.hpp) belongs to the room that implements it.
PUBLIC = {
    "errors": "core", "error_file": "core", "stop_signal": "core", "process_tuning": "core",
    "version": "core", "durable_io": "core", "state_dict": "core", "module_traversal": "core",
    "distributed": "comm", "distributed_env": "comm", "collectives": "comm", "flat_collectives": "comm",
    "hybrid_shard_groups": "comm",
    "sampler": "sampler", "ddp": "ddp", "comm_hook": "ddp", "amp": "amp",
    "fsdp_unit": "fsdp", "unit_sequential": "fsdp", "fully_sharded_data_parallel": "fsdp",
    "zero_redundancy_optimizer": "zero", "parameter_server": "parameter_server",
    "snapshot": "snapshot", "resilience": "resilience", "sharded_snapshot": "resilience",
    "tensorboard": "tensorboard", "optim": "optim", "pipeline": "pipeline", "memory_format": "core", "cuda_graph": "cuda_graph",
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([A-Za-z0-9_]+)/([A-Za-z0-9_/]+)\.hpp[>"]', re.M)


def includes(path):
    with open(path, encoding="utf-8") as f:
        return INCLUDE.findall(f.read())


def room_of(folder, name):
    if folder == "ctorch":
        return PUBLIC.get(name)
    return folder if folder in FLOORS else None


def main(root):
    problems = []
    src = os.path.join(root, "trainer", "src")
    public = os.path.join(root, "trainer", "include", "ctorch")
    for folder in sorted(os.listdir(src)):
        if os.path.isdir(os.path.join(src, folder)) and folder not in FLOORS:
            problems.append(f"trainer/src/{folder}/ is in no room: give it a floor in tests/layout/check_layout.py "
                            "and docs/library-layout.md")
    files = []
    for folder in FLOORS:
        d = os.path.join(src, folder)
        if os.path.isdir(d):
            files += [(folder, os.path.join(d, n)) for n in sorted(os.listdir(d)) if n.endswith((".cpp", ".hpp"))]
    for name in sorted(os.listdir(public)):
        if not name.endswith(".hpp"):
            continue
        room = PUBLIC.get(name[:-4])
        if room is None:
            problems.append(f"trainer/include/ctorch/{name} is in no room: add it to PUBLIC in tests/layout/check_layout.py")
            continue
        path = os.path.join(public, name)
        files.append((room, path))
        for folder, inc in includes(path):
            if folder in FLOORS:
                problems.append(f"trainer/include/ctorch/{name} (installed) includes the internal {folder}/{inc}.hpp")
    for room, path in files:
        for folder, inc in includes(path):
            target = room_of(folder, inc)
            if target and FLOORS[target] > FLOORS[room]:
                problems.append(f"{os.path.relpath(path, root)} ({room}, floor {FLOORS[room]}) includes "
                                f"{folder}/{inc}.hpp ({target}, floor {FLOORS[target]}): an include runs up")
    allowed = {"models": {"fsdp_unit"}, "data": set()}
    for lib, names in allowed.items():
        for dirpath, _, filenames in os.walk(os.path.join(root, lib)):
            for n in filenames:
                if not n.endswith((".cpp", ".hpp")):
                    continue
                path = os.path.join(dirpath, n)
                for folder, inc in includes(path):
                    if folder == "ctorch" and inc in PUBLIC and inc not in names:
                        problems.append(f"{os.path.relpath(path, root)} includes ctorch/{inc}.hpp: {lib}/ may use "
                                        f"{', '.join('ctorch/' + x + '.hpp' for x in sorted(names)) or 'no library header'}")
    for p in problems:
        print("FAIL:", p)
    print(f"{len(files)} files of {len(FLOORS)} rooms checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")))
