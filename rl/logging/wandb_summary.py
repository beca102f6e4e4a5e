"""A W&B run's summary read back from its files, with no network: `read_summary(path)`.

`path` may be a `wandb-summary.json` (what an online run's files hold, or a summary exported from the
W&B UI) or a directory holding one, a run directory (`wandb/offline-run-*` or `wandb/run-*`: its
`files/wandb-summary.json`, else its `run-<id>.wandb`), a `run-<id>.wandb` file, or a training
run's `run.out_dir` (its `wandb/` runs; an offline run that was resumed is several directories with
one id, read in order).

An offline run writes no wandb-summary.json (wandb 0.31: only its transaction log, `run-<id>.wandb`),
so that log is read here: wandb's LevelDB-style record log (a 7-byte file header ":W&B", 0xBEE1,
version 0; 32 KiB blocks of records, each a 7-byte header - CRC-32 of type + data, length, type
FULL / FIRST / MIDDLE / LAST - then data), each record a protobuf `wandb.proto.wandb_internal_pb2.Record`
(needs the wandb package; a wandb-summary.json does not). The summary is the run record's, then every
summary record's updates and removals in order, as W&B itself builds it.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from collections.abc import Iterator

SUMMARY_JSON = "wandb-summary.json"
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: str) -> Iterator[bytes]:
  """The data of each record of a `.wandb` transaction log, in order (ValueError on a bad file)."""
  with open(path, "rb") as f:
    data = f.read()
  if data[:_HEADER] != struct.pack("<4sHB", b":W&B", 0xBEE1, 0):
    raise ValueError(f"{path}: not a W&B transaction log (version 0)")
  pos, pending = _HEADER, b""
  while pos + _HEADER <= len(data):
    if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header is padding
      pos += _BLOCK - pos % _BLOCK
      continue
    crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
    if (crc, length, kind) == (0, 0, 0):  # zero padding: nothing after it
      return
    chunk = data[pos + _HEADER : pos + _HEADER + length]
    if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
      raise ValueError(f"{path}: bad record checksum at byte {pos}")
    pos += _HEADER + length
    if kind == _FULL:
      yield chunk
    elif kind == _FIRST:
      pending = chunk
    elif kind == _MIDDLE:
      pending += chunk
    elif kind == _LAST:
      yield pending + chunk


def _key(item) -> str:
  return item.key or "/".join(item.nested_key)


def log_summary(path: str, summary: dict | None = None) -> dict:
  """The summary a `.wandb` log builds, applied on top of `summary` (an earlier segment's)."""
  from wandb.proto import wandb_internal_pb2 as pb  # the optional package, only for .wandb logs

  summary = {} if summary is None else summary
  for data in records(path):
    record = pb.Record()
    record.ParseFromString(data)
    kind = record.WhichOneof("record_type")
    updates = record.run.summary if kind == "run" else record.summary if kind == "summary" else None
    if updates is None:
      continue
    for item in updates.update:
      summary[_key(item)] = json.loads(item.value_json)
    for item in updates.remove:
      summary.pop(_key(item), None)
  return summary


def _run_sources(path: str) -> list[str]:
  """The files that hold `path`'s summary, oldest segment first."""
  if os.path.isfile(path):
    return [path]
  for own in (os.path.join(path, SUMMARY_JSON), os.path.join(path, "files", SUMMARY_JSON)):
    if os.path.exists(own):
      return [own]
  logs = sorted(glob.glob(os.path.join(path, "run-*.wandb")))
  if logs:
    return logs[-1:]
  # offline-run-<time>-<id> / run-<time>-<id>, by time
  runs = sorted(
    glob.glob(os.path.join(path, "wandb", "*run-*-*")), key=lambda r: r.split("run-")[-1]
  )
  ids = {os.path.basename(r).rsplit("-", 1)[1] for r in runs}
  if len(ids) > 1:
    raise ValueError(
      f"{path}/wandb holds several W&B runs ({sorted(ids)}): give one run's directory"
    )
  sources = [s for r in runs for s in _run_sources(r)]
  if not sources:
    raise ValueError(
      f"{path}: no {SUMMARY_JSON}, run-*.wandb or wandb/ run directory (was run.wandb.mode set?)"
    )
  return sources


def read_summary(path: str) -> dict:
  """The W&B run summary of `path` (see the module docstring for what `path` may be)."""
  summary: dict = {}
  for source in _run_sources(path):
    if source.endswith(".wandb"):
      summary = log_summary(source, summary)
    else:
      with open(source) as f:
        summary.update(json.load(f))
  return summary
