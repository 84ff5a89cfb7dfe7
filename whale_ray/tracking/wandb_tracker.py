"""Weights & Biases in offline mode (where `wandb` is installed): the run is written under <run_dir>/wandb for
`wandb sync` later, and a relaunch continues it by its id (another offline-run-*-<id> folder, which `wandb sync`
uploads after the first). Nothing goes to the network: no login, no error reports, no system metrics (they would
describe the driver, and probe cloud metadata addresses), no console capture; one line names the folder.

wandb-core writes a run's transaction log (run-<id>.wandb) in blocks, and a process killed before it flushed loses
the tail: what a relaunch continues from is what the log holds (`held`), not what the last launch sent."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import wandb
from wandb.proto import wandb_internal_pb2 as pb

from whale_ray.tracking.records import AXES, Point

SETTINGS = {"mode": "offline", "silent": True, "console": "off", "x_disable_stats": True,
            "x_disable_machine_info": True, "save_code": False}
HEADER = b":W&B"  # then a magic number and a version: 7 bytes
BLOCK = 32768  # LevelDB's log format after the header: records in 32 KiB blocks, each chunk [crc32, length, kind]
FULL, FIRST, LAST = 1, 2, 4


def transaction_log(path: Path) -> Iterator[pb.Record]:
    """The records of a run's .wandb file, in order, up to a torn tail."""
    data = Path(path).read_bytes()
    if not data.startswith(HEADER):
        return
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's zero padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        body = data[pos + 7:pos + 7 + length]
        if kind == 0 or len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
            return
        pos += 7 + length
        chunks = body if kind in (FULL, FIRST) else chunks + body
        if kind in (FULL, LAST):
            yield pb.Record.FromString(chunks)


def launches(folder: Path, run_id: str) -> list[Path]:
    """The .wandb files of a run's offline folders under `folder`, oldest first: offline-run-<time>-<id>, and
    <id>-1, -2, ... for a folder name taken in the same second."""
    found = []
    for path in Path(folder).glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"):
        named = re.fullmatch(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?", path.parent.name)
        if named:
            found.append(((named[1], int(named[2] or 0)), path))
    return [path for _, path in sorted(found)]


def _name(item: Any) -> str:
    """A config, summary or history item's key (wandb-core writes it as a path, nested_key)."""
    return item.key or ".".join(item.nested_key)


class WandbTracker:
    def __init__(self, section: Any, run_dir: Path, experiment: str):
        self.project, self.group, self.dir = section.project, experiment, Path(run_dir).resolve()
        self.target = str(self.dir / "wandb")
        self.run: Any = None
        self.held: dict[str, Any] | None = None  # after open: params and points per axis on record in the log
        self.step = 0  # W&B's own step (_step): every point, across launches

    def open(self, name: str, tags: dict[str, str], resume: dict[str, Any] | None) -> dict[str, Any]:
        if resume:
            self.held = self._held(resume["id"])
        os.environ["WANDB_ERROR_REPORTING"] = "false"  # read as wandb's service starts: no error reports sent
        wandb.setup(settings=wandb.Settings(**SETTINGS))  # the process' settings too: its telemetry stays off
        self.run = wandb.init(dir=str(self.dir), project=self.project, group=self.group, name=name,
                              id=(resume or {}).get("id"), resume="allow" if resume else None,
                              config={"tags": tags}, reinit="create_new", settings=wandb.Settings(**SETTINGS))
        for axis in AXES:  # each axis its own step counter: weight steps, harness iterations, cycles
            self.run.define_metric(f"{axis}_step")
            self.run.define_metric(f"{axis}/*", step_metric=f"{axis}_step")
        self.run.define_metric("ledger/*", step_metric="cycle_step")  # the ledgers as they were at each cycle
        print(f"wandb: offline run {self.run.id} in {self.run.settings.sync_dir} "
              f"(upload with: wandb sync {self.target})", flush=True)
        return {"id": self.run.id}

    def _held(self, run_id: str) -> dict[str, Any]:
        """What the earlier launches' logs of the run hold: the params or not, the points of each axis (sent in
        order, so a count), and W&B's next step."""
        params, steps, rows = False, {axis: set() for axis in AXES}, 0
        for path in launches(Path(self.target), run_id):
            for record in transaction_log(path):
                kind = record.WhichOneof("record_type")
                if kind == "config":
                    params = params or any(not _name(item).startswith("_") for item in record.config.update)
                elif kind == "history":
                    rows += 1
                    for item in record.history.item:
                        if _name(item).endswith("_step") and _name(item)[:-5] in steps:
                            steps[_name(item)[:-5]].add(json.loads(item.value_json))
        self.step = rows
        return {"params": params, **{axis: len(steps[axis]) for axis in AXES}}

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_point(self, point: Point) -> None:
        """Its files and tags first: a point whose row is in the log has them there too."""
        for name, text in point.texts.items():
            self._keep(name, lambda dest, text=text: dest.write_text(text))
        self.run.summary.update(point.tags)
        self.run.log({**point.metrics, f"{point.axis}_step": point.step}, step=self.step, commit=True)
        self.step += 1

    def log_files(self, files: dict[str, Path]) -> None:
        """Each file under its name (harness/accepted/<id>.py, report/index.html), copied into the run's files: the
        run directory may change or go before `wandb sync`."""
        for name, path in files.items():
            self._keep(name, lambda dest, path=path: shutil.copyfile(path, dest))

    def _keep(self, name: str, write: Callable[[Path], Any]) -> None:
        dest = Path(self.run.dir) / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        write(dest)
        self.run.save(str(dest), base_path=self.run.dir, policy="now")

    def close(self, status: str) -> None:
        self.run.summary.update({"whale_status": status})
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
