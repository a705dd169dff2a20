#!/usr/bin/python3
# The Python side of the snapshot interop tests (tests/snapshot/snapshot_python_test.cpp). Needs
# Debian's python3-torch: run with /usr/bin/python3.
#   check_snapshot.py inspect <snapshot>...          open C++ snapshots with torch.load, check it all
#   check_snapshot.py rewrite <in> <resaved> <tampered>
#                     torch.load + torch.save; and the same with EPOCHS_RUN changed (old digest)
#   check_snapshot.py resave <in> <out>              torch.load + torch.save
#   check_snapshot.py others <dir>                   foreign.pt (torch.save of another dict),
#                     legacy.pt (pre-zip format), module.pt (a pickled nn.Module)
import hashlib
import pickle
import pickletools
import struct
import sys
import zipfile

import torch


# ---- The canonical encoding of docs/snapshot.md ("Content digest"), independent of the C++ one ----
def enc(v, out):
    if v is None:
        out += b"N"
    elif isinstance(v, bool):
        out += b"B" + (b"\x01" if v else b"\x00")
    elif isinstance(v, int):
        out += b"I" + struct.pack("<q", v)
    elif isinstance(v, float):
        out += b"F" + struct.pack("<d", v)
    elif isinstance(v, str):
        b = v.encode("utf-8")
        out += b"S" + struct.pack("<Q", len(b)) + b
    elif isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        name = str(t.dtype).replace("torch.", "").encode()
        out += b"T" + struct.pack("<Q", len(name)) + name
        out += struct.pack("<Q", t.dim()) + b"".join(struct.pack("<Q", s) for s in t.shape)
        data = t.numpy().tobytes() if t.numel() else b""
        out += struct.pack("<Q", len(data)) + data
    elif isinstance(v, list):
        out += b"L" + struct.pack("<Q", len(v))
        for x in v:
            enc(x, out)
    elif isinstance(v, tuple):
        out += b"U" + struct.pack("<Q", len(v))
        for x in v:
            enc(x, out)
    elif isinstance(v, dict):
        items = []
        for k, x in v.items():
            kb = bytearray()
            enc(k, kb)
            items.append((bytes(kb), x))
        items.sort(key=lambda kv: kv[0])
        out += b"D" + struct.pack("<Q", len(items))
        for kb, x in items:
            out += kb
            enc(x, out)
    else:
        raise TypeError(f"cannot encode {type(v)}")


def digest(v):
    out = bytearray()
    enc(v, out)
    return "blake2b-256:" + hashlib.blake2b(bytes(out), digest_size=32).hexdigest()


def expected_value(name, like):
    # The C++ test fills every state entry with this pattern (see snapshot_python_test.cpp).
    if like.dtype == torch.int64:
        return torch.full_like(like, len(name))
    return (torch.arange(like.numel(), dtype=torch.float32) * 0.01 + len(name)).reshape(like.shape)


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.ReLU(),
                               torch.nn.Linear(3, 2))


GRADS = [0.25, -0.5, 0.125]  # the gradient of every element at steps 1, 2, 3


def make_optimizer(kind, params):
    # The hyper-parameters the C++ test trains with.
    if kind == "SGD":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "Adam":
        return torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.99))
    raise AssertionError(f"optimizer type {kind}")


def check(cond, what):
    if not cond:
        raise AssertionError(what)


# What torch.load(weights_only=True) - the default since PyTorch 2.6 - lets a pickle reference.
WEIGHTS_ONLY_GLOBALS = {"torch._utils _rebuild_tensor_v2", "collections OrderedDict"}


def pickle_globals(path):
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        data = z.read(name)
    return {str(arg) for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL")}


def inspect(path):
    # Only tensor rebuilds and plain containers: no torch.jit._pickle helpers, which the
    # weights-only loader refuses.
    extra = {g for g in pickle_globals(path)
             if g not in WEIGHTS_ONLY_GLOBALS and not (g.startswith("torch ") and g.endswith("Storage"))}
    check(not extra, f"globals a weights-only torch.load refuses: {sorted(extra)}")
    try:
        snap = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        # PyTorch 1.13's weights-only loader lacks the BINFLOAT opcode (any float); later ones have it.
        if "Unsupported operand 71" not in str(e):
            raise
        snap = torch.load(path, weights_only=False)
    keys = ["CTORCH_SNAPSHOT", "MODEL_STATE", "OPTIMIZER_TYPE", "OPTIMIZER_STATE",
            "LR_SCHEDULER_STATE", "EPOCHS_RUN", "STEP_IN_EPOCH", "GLOBAL_STEP", "SAMPLER_STATE",
            "RNG_STATE", "USER_STATE"]
    check(sorted(snap.keys()) == sorted(keys), f"top-level keys {sorted(snap.keys())}")
    h = snap["CTORCH_SNAPSHOT"]
    check(h["magic"] == "ctorch-snapshot" and h["format_version"] == 1, f"header {h}")
    check(h["world_size"] == 3 and h["model_name"] == "interop-mlp", f"header {h}")
    check(h["config"] == {"lr": "0.1", "batch_size": "8"}, f"config {h['config']}")
    check(h["config_hash"] == digest(h["config"]), "config_hash")
    check(h["created_utc"].endswith("Z") and h["created_unix"] > 1.6e9, "creation time")
    check(h["ctorch_version"].startswith("ctorch "), h["ctorch_version"])
    check(h["torch_version"].startswith("1.13") or h["torch_version"].startswith("2."), h["torch_version"])
    stored = h.pop("content_digest")
    check(stored == digest(snap), f"content digest: stored {stored}, python computes {digest(snap)}")
    h["content_digest"] = stored

    check(snap["EPOCHS_RUN"] == 4 and snap["STEP_IN_EPOCH"] == 5 and snap["GLOBAL_STEP"] == 2, "progress")
    check(snap["LR_SCHEDULER_STATE"] == {"last_epoch": 4, "gamma": 0.5}, str(snap["LR_SCHEDULER_STATE"]))
    s = snap["SAMPLER_STATE"]
    check(s == {"epoch": 4, "consumed": 5, "world_size": 3, "dataset_size": 100, "seed": 7,
                "shuffle": True, "drop_last": False}, f"sampler {s}")

    user = snap["USER_STATE"]
    kind = snap["OPTIMIZER_TYPE"]
    sd = snap["MODEL_STATE"]
    # Model: Python's state_dict names, in Python's order.
    model = make_model()
    check(list(sd.keys()) == list(model.state_dict().keys()),
          f"MODEL_STATE keys {list(sd.keys())} vs Python {list(model.state_dict().keys())}")
    # Values: C++ filled every entry with expected_value() and took steps 1 and 2. Buffers are
    # untouched by the optimizer: exactly the pattern. Parameters: Python replays the two steps.
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(expected_value(name, t))
    params = dict(model.named_parameters())
    for name, t in sd.items():
        if name not in params:
            check(torch.equal(t, expected_value(name, t)), f"buffer {name}")
    replay = make_optimizer(kind, list(model.parameters()))
    for grad in GRADS[:2]:
        for p in model.parameters():
            p.grad = torch.full_like(p, grad)
        replay.step()
    for name, p in params.items():
        diff = (sd[name] - p.detach()).abs().max().item()
        check(diff <= 1e-6, f"{kind} steps 1-2 replayed in Python differ for {name}: {diff}")

    model = make_model()
    model.load_state_dict(sd, strict=True)

    # RNG: the CPU generator state continues exactly as it did in C++.
    torch.set_rng_state(snap["RNG_STATE"]["cpu"])
    check(torch.equal(torch.rand(5), user["rand_after_capture"]), "CPU RNG state")
    check(isinstance(snap["RNG_STATE"]["cuda"], list), "cuda states list")
    check(snap["RNG_STATE"]["ranks"] == [], "per-rank RNG states (none gathered)")

    # Optimizer: a Python optimizer with other hyper-parameters takes the state (hyper-parameters
    # included) and takes step 3 like C++ did.
    params = list(model.parameters())
    if kind == "SGD":
        opt = torch.optim.SGD(params, lr=1.0, momentum=0.1)
    elif kind == "Adam":
        opt = torch.optim.Adam(params, lr=1.0)
    else:
        raise AssertionError(f"optimizer type {kind}")
    opt.load_state_dict(snap["OPTIMIZER_STATE"])
    g = opt.param_groups[0]
    if kind == "SGD":
        check(g["lr"] == 0.05 and g["momentum"] == 0.9 and g["nesterov"] is False, f"group {g}")
        check(all(opt.state[p]["momentum_buffer"].shape == p.shape for p in params), "momentum buffers")
    else:
        check(g["lr"] == 0.01 and g["betas"] == (0.8, 0.99), f"group {g}")
        check(all(int(opt.state[p]["step"]) == 2 for p in params), "Adam step")
    for p in params:
        p.grad = torch.full_like(p, GRADS[2])
    opt.step()
    after = dict(model.named_parameters())
    for name, t in user["params_after_step3"].items():
        diff = (after[name].detach() - t).abs().max().item()
        check(diff <= 1e-6, f"{kind} step 3 in Python differs from C++ for {name}: {diff}")
    print(f"OK {kind}: {len(sd)} state entries, digest {stored[:24]}...")


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "inspect":
        for path in args:
            inspect(path)
    elif mode == "rewrite":
        src, resaved, tampered = args
        snap = torch.load(src)
        torch.save(snap, resaved)
        snap["EPOCHS_RUN"] += 1
        torch.save(snap, tampered)
    elif mode == "resave":
        torch.save(torch.load(args[0]), args[1])
    elif mode == "others":
        directory = args[0]
        torch.save({"weights": torch.ones(3), "epoch": 3}, f"{directory}/foreign.pt")
        torch.save({"weights": torch.ones(3)}, f"{directory}/legacy.pt",
                   _use_new_zipfile_serialization=False)
        torch.save(torch.nn.Linear(2, 2), f"{directory}/module.pt")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
