# Exercises a TCPStore server (ours) with PyTorch's own client: python3 store_ops.py HOST PORT
import datetime
import os
import sys

import torch
import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])
print(f"torch {torch.__version__}", flush=True)
kwargs = {}
if "use_libuv" in (dist.TCPStore.__init__.__doc__ or ""):
    # PyTorch 2.2+: honour USE_LIBUV as torch.distributed's rendezvous does (Debian builds lack libuv).
    kwargs["use_libuv"] = os.environ.get("USE_LIBUV", "1") == "1"
s = dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=20), **kwargs)
s.set("a", "hello")
assert s.get("a") == b"hello"
assert s.add("cnt", 5) == 5 and s.add("cnt", 2) == 7
assert s.compare_set("a", "hello", "world") == b"world"
assert s.compare_set("a", "nope", "x") == b"world"
assert s.compare_set("fresh", "", "v") == b"v"
s.wait(["a", "cnt"])
try:
    s.wait(["missing"], datetime.timedelta(milliseconds=200))
    raise SystemExit("wait on a missing key returned")
except RuntimeError as e:
    assert "imeout" in str(e), str(e)
# A fresh client: the one that timed out may have a stale reply pending (1.13 has no CANCEL_WAIT).
s2 = dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=20), **kwargs)
n = s2.num_keys()
assert n == 4, n  # init/, /a, /cnt, /fresh
assert s2.delete_key("a") is True and s2.delete_key("a") is False
p = dist.PrefixStore("/worker/attempt_0", s2)
p.set("x", "1")
assert s2.get("/worker/attempt_0/x") == b"1"
print("STORE-OPS-OK", flush=True)
