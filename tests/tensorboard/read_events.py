#!/usr/bin/env python3
"""Reads TensorBoard event files the way TensorBoard does, with nothing of ctorch's writer: its own
CRC-32C, TensorBoard's Event and Summary messages (tests/tensorboard/proto, compiled here with protoc
--python_out into a temporary directory) and protobuf's own parser.

Checks every record's framing (length and data, each with its masked CRC-32C), that every record
parses as an Event and serializes back to the same bytes (field order, proto3 defaults, no unknown
field), that each file opens with file_version "brain.Event:2", and that every summary value is a
tagged simple_value. Then builds the run as TensorBoard's Python loader does: files in name order,
the first SessionLog START taken for the run's start, each later START hiding the points before it
at steps >= its step. With --metrics, that view must hold exactly ctorch-train's metrics.jsonl:
each <kind>/<field> scalar (docs/tensorboard.md), at the record's step, in order, as float32.

Usage: read_events.py PATH [--metrics metrics.jsonl] [--json OUT]
PATH is an event file or a directory of them. Exit 0: all holds; 1: a check failed (said on
stderr); 77: protoc or python3-protobuf is missing (scripts/setup.sh installs them).
"""
import argparse
import importlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

PROTO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proto")
PROTO_FILES = ["tensorboard/compat/proto/summary.proto", "tensorboard/compat/proto/event.proto"]
PREFIX = "events.out.tfevents."

# The metrics file's numbers that become scalars, by record kind (docs/tensorboard.md).
SCALARS = {
    "train": ["loss", "lr", "samples_per_s"],
    "epoch": ["loss", "samples_per_s"],
    "eval": ["loss", "accuracy"],
}


class Failure(Exception):
    pass


def crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


TABLE = crc32c_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked(crc):
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def compile_protos(tmp):
    """event_pb2 from the .proto files, or None when protoc or the protobuf module is missing."""
    protoc = shutil.which("protoc")
    if protoc is None:
        return None
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        return None
    subprocess.run([protoc, "-I", PROTO_ROOT, "--python_out", tmp] + PROTO_FILES, check=True)
    # Regular packages, first on the path: an installed tensorboard package does not stand in.
    for d in ["tensorboard", "tensorboard/compat", "tensorboard/compat/proto"]:
        open(os.path.join(tmp, d, "__init__.py"), "a").close()
    sys.path.insert(0, tmp)
    return importlib.import_module("tensorboard.compat.proto.event_pb2")


def unknown_fields(message):
    """How many unknown fields `message` and the messages in it hold."""
    try:
        from google.protobuf.unknown_fields import UnknownFieldSet  # protobuf >= 4.22
        count = len(UnknownFieldSet(message))
    except ImportError:
        count = len(message.UnknownFields())
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        repeated = getattr(field, "is_repeated", None)  # newer protobufs; `label` before
        if callable(repeated):
            repeated = repeated()
        if repeated is None:
            repeated = field.label == field.LABEL_REPEATED
        items = value if repeated else [value]
        count += sum(unknown_fields(item) for item in items)
    return count


def records(path):
    with open(path, "rb") as f:
        data = f.read()
    at, index = 0, 0
    while at < len(data):
        where = f"{path}: record {index} at byte {at}"
        if len(data) - at < 12:
            raise Failure(f"{where}: {len(data) - at} bytes left, a record header takes 12")
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        if masked(crc32c(header)) != length_crc:
            raise Failure(f"{where}: the length's CRC {length_crc:#010x} is not {masked(crc32c(header)):#010x}")
        if len(data) - at - 12 < length + 4:
            raise Failure(f"{where}: {length} bytes of data announced, fewer left")
        body = data[at + 12:at + 12 + length]
        (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        if masked(crc32c(body)) != body_crc:
            raise Failure(f"{where}: the data's CRC {body_crc:#010x} is not {masked(crc32c(body)):#010x}")
        yield where, body
        at += 16 + length
        index += 1


def bits(value):
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", value))[0]


def read_file(path, event_pb2):
    events = []
    for where, body in records(path):
        event = event_pb2.Event()
        event.ParseFromString(body)
        if unknown_fields(event):
            raise Failure(f"{where}: fields that TensorBoard's Event does not have")
        if event.SerializeToString(deterministic=True) != body:
            raise Failure(f"{where}: protobuf serializes the parsed event to other bytes")
        what = event.WhichOneof("what")
        e = {"wall_time": event.wall_time, "step": event.step, "what": what}
        if what == "file_version":
            e["file_version"] = event.file_version
        elif what == "session_log":
            e["status"] = event_pb2.SessionLog.SessionStatus.Name(event.session_log.status)
        elif what == "summary":
            e["values"] = []
            for v in event.summary.value:
                if not v.tag or v.WhichOneof("value") != "simple_value":
                    raise Failure(f"{where}: a summary value that is not a tagged simple_value")
                finite = math.isfinite(v.simple_value)
                e["values"].append({"tag": v.tag, "bits": bits(v.simple_value),
                                    "value": v.simple_value if finite else None})
        else:
            raise Failure(f"{where}: an event with nothing in it")
        events.append(e)
    if not events:
        raise Failure(f"{path}: no event at all")
    first = events[0]
    if first["what"] != "file_version" or first["file_version"] != "brain.Event:2" or first["wall_time"] <= 0:
        raise Failure(f"{path}: the first event is not file_version 'brain.Event:2' with a wall time: {first}")
    return events


def run_view(files):
    """The scalars TensorBoard's Python loader shows for these files (in name order)."""
    scalars, starts, seen_start = {}, [], False
    for index, f in enumerate(files):
        for e in f["events"]:
            if e["what"] == "session_log" and e["status"] == "START":
                starts.append({"file": index, "step": e["step"]})
                if seen_start:  # a restart: the points at steps >= its step are out of date
                    for tag in scalars:
                        scalars[tag] = [p for p in scalars[tag] if p[0] < e["step"]]
                seen_start = True
            for v in e.get("values", []):
                scalars.setdefault(v["tag"], []).append([e["step"], v["bits"]])
    return scalars, starts


def expected_from_metrics(path):
    expected = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            for field in SCALARS.get(record["kind"], []):
                if record.get(field) is None:
                    continue
                expected.setdefault(f"{record['kind']}/{field}", []).append([record["step"], bits(record[field])])
    return expected


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--metrics")
    parser.add_argument("--json")
    args = parser.parse_args()
    assert crc32c(b"123456789") == 0xE3069283, "this reader's own CRC-32C is wrong"
    with tempfile.TemporaryDirectory(prefix="ctorch-tb-proto-") as tmp:
        event_pb2 = compile_protos(tmp)
        if event_pb2 is None:
            print("CTORCH_SKIPPED: needs protoc and python3-protobuf (Debian's protobuf-compiler and "
                  "python3-protobuf; scripts/setup.sh installs them)")
            return 77
        if os.path.isdir(args.path):
            paths = sorted(os.path.join(args.path, n) for n in os.listdir(args.path) if n.startswith(PREFIX))
        else:
            paths = [args.path]
        if not paths:
            raise Failure(f"{args.path}: no {PREFIX}* file")
        files = [{"name": os.path.basename(p), "events": read_file(p, event_pb2)} for p in paths]
    scalars, starts = run_view(files)
    total = sum(len(f["events"]) for f in files)
    print(f"read {total} events in {len(files)} file(s): every CRC holds, every record is an Event")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"files": files, "starts": starts, "scalars": scalars}, out)
    if args.metrics:
        expected = expected_from_metrics(args.metrics)
        if sorted(expected) != sorted(scalars):
            raise Failure(f"tags {sorted(scalars)} in TensorBoard's view, {sorted(expected)} in {args.metrics}")
        for tag, points in expected.items():
            if scalars[tag] != points:
                raise Failure(f"{tag}: TensorBoard's view {scalars[tag]} differs from {args.metrics}'s {points}")
        print(f"metrics match: {sum(len(p) for p in expected.values())} points in {len(expected)} tags "
              f"({', '.join(sorted(expected))})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print(f"FAIL: {e}", file=sys.stderr)
        sys.exit(1)
