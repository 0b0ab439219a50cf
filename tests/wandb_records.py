"""Read back what W&B wrote offline: the records of run_dir/wandb/offline-run-*/run-*.wandb.

The file is ':W&B' + a 2-byte magic + a 1-byte version, then a LevelDB-style log (32 KiB blocks; each chunk
a 7-byte header: crc32 4, length 2, type 1 = full / 2 first / 3 middle / 4 last) of protobuf `Record`s."""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32768


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B data file"
    pos, raw, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            raw.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            raw.append(buf + chunk)
    out = []
    for r in raw:
        rec = pb.Record()
        rec.ParseFromString(r)
        out.append(rec)
    return out


def history(run_dir: Path) -> list[dict]:
    """Every logged row ({key: value}, with '_step'), in order, over all offline runs of run_dir."""
    rows = []
    for f in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        for rec in records(f):
            if rec.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    return rows


def config(run_dir: Path) -> dict:
    for f in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        for rec in records(f):
            if rec.WhichOneof("record_type") == "run" and rec.run.config.update:
                return {i.key: json.loads(i.value_json) for i in rec.run.config.update}
    return {}
