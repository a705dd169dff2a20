#!/usr/bin/env python3
"""The library's rooms and which way their includes run (docs/library-layout.md).

Fails, naming the file and the include, when a room includes one above it, when a function
declared in a room's header is defined only in a room above it, when a folder under
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
    "snapshot": 3, "amp": 3,
    # Resilience stands below the ways of sharing a step (issue 59.1): it knows them only as
    # ctorch::Stateful (ctorch/stateful.hpp), which each implements in its own room.
    "resilience": 4,
    "ddp": 5, "zero": 5,
    "fsdp": 6, "parameter_server": 6, "cuda_graph": 6, "pipeline": 6,
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
    "snapshot": "snapshot", "resilience": "resilience", "sharded_snapshot": "resilience", "stateful": "resilience",
    "tensorboard": "tensorboard", "optim": "optim", "pipeline": "pipeline", "memory_format": "core", "cuda_graph": "cuda_graph",
    # The umbrella (issue 59.6) includes every public header: it stands on the top floor.
    "ctorch": "pipeline",
}
# Names too common to say where a function lives (operators, entry points, overloads everywhere).
COMMON_NAMES = {"main", "operator", "to_string", "swap", "hash"}
IDENT = re.compile(r"([A-Za-z_]\w*)\s*\($")
KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "catch", "decltype", "alignof", "static_assert",
            "noexcept", "requires", "throw", "defined", "alignas"}


def statements(text):
    """(depth-kinds, statement) for each statement at namespace scope: the text since the previous
    ';', '{' or '}', with whether it ends a declaration (';') or opens a body ('{'). Comments,
    strings and preprocessor lines are blanked first; class and struct bodies, function bodies and
    initialisers are skipped (only namespace scope is looked at)."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])'", "''", text)
    text = re.sub(r"^\s*#[^\n]*(?:\\\n[^\n]*)*", "", text, flags=re.M)
    stack, current, out = [], [], []
    for ch in text:
        if ch in ";{}":
            stmt = " ".join("".join(current).split())
            current = []
            at_namespace = all(k == "ns" for k in stack)
            if ch == "{":
                kind = "ns" if re.match(r"^(?:inline\s+)?namespace\b", stmt) or stmt.startswith('extern ""') else "block"
                if at_namespace and kind == "block":
                    out.append(("{", stmt))
                stack.append(kind)
            elif ch == "}":
                if stack:
                    stack.pop()
            elif at_namespace:
                out.append((";", stmt))
        else:
            current.append(ch)
    return out


def function_name(stmt):
    """The name a namespace-scope statement declares or defines as a function, else None: the last
    identifier before the outermost '(' ("a::b::name(" gives name), not a keyword, not a macro call
    on its own, not a variable initialised with parentheses of a type (best effort)."""
    if re.match(r"^(?:class|struct|union|enum|using|typedef|template\s*<[^>]*>\s*(?:class|struct))\b", stmt):
        return None
    stmt = re.sub(r"^template\s*<.*?>\s*", "", stmt)
    depth, start = 0, None
    for i, ch in enumerate(stmt):
        if ch == "(":
            if depth == 0:
                start = i
                break
            depth += 1
    if start is None or "=" in stmt[:start] or "operator" in stmt[:start]:
        return None
    m = IDENT.search(stmt[:start + 1])
    if not m or m.group(1) in KEYWORDS or m.group(1).isupper():
        return None
    # a type and a name before it: "std::string foo(", "ItemDict newItemDict(", "void a::b(" ...
    if not re.search(r"[\w>&*\]]\s+(?:[\w:~]+::)?~?\w+\s*\($", stmt[:start + 1]) and "::" not in stmt[:start]:
        return None
    return m.group(1)


def declared_and_defined(path):
    """Free functions a file declares (';' at namespace scope) and those it defines (a body)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    declared, defined = set(), set()
    for end, stmt in statements(text):
        name = function_name(stmt)
        if not name or name in COMMON_NAMES:
            continue
        (declared if end == ";" else defined).add(name)
    return declared, defined


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
    # Calls point down too (issue 59.3): a function declared in a room's header is defined in that
    # room or one below, never only above it (the include check cannot see a call that runs up a
    # floor through a declaration below and a definition above).
    defined_in = {}
    declared_by = []
    for room, path in files:
        declared, defined = declared_and_defined(path)
        for name in defined:
            defined_in.setdefault(name, set()).add(room)
        if path.endswith(".hpp"):
            declared_by += [(room, path, name) for name in sorted(declared)]
    for room, path, name in declared_by:
        rooms = defined_in.get(name)
        if rooms and all(FLOORS[r] > FLOORS[room] for r in rooms):
            where = ", ".join(f"{r} (floor {FLOORS[r]})" for r in sorted(rooms))
            problems.append(f"{os.path.relpath(path, root)} ({room}, floor {FLOORS[room]}) declares {name}(), "
                            f"defined only in {where}: a call runs up")
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
    print(f"{len(files)} files of {len(FLOORS)} rooms checked ({len(declared_by)} functions declared in headers, "
          f"{len(defined_in)} defined), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")))
