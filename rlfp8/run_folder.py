"""RunFolder: a run's folder, owned by that one run.

    folder, cfg = RunFolder.start(argv)        # compose; claim a fresh folder or open one to resume; lock it
    ckpt, state = folder.resume_point()        # newest complete checkpoint + its driver state (resume only)
    scratch = folder.scratch_dir()             # RAM folder for adapters, removed on any exit
    folder.save_checkpoint(step, save_trainer, driver_state, keep)
    folder.close()

Guarantees (the README's "What the run folder guarantees" says the same to users):
- One live run per folder: `run.lock` holds an flock and the owner's pid / host / start time. The
  kernel drops the flock when the owner dies (also on kill -9), so a dead owner's lock is taken over
  and a live owner's refuses the second run, naming it.
- A fresh run never writes into a folder that already holds a run (config.yaml, metrics.jsonl or
  checkpoints/): it refuses, or with `new_run=true` (and always without `run_dir`) takes the next
  free folder R-2, R-3, ... and prints which.
- `resume=true run_dir=R`: R's config.yaml is the config; only the overrides given are applied, and
  those that change the model, adapter, algorithm, data or seed are refused naming the keys unless
  `force=true`.
- A checkpoint is complete when its COMPLETE marker (written last) exists. It holds everything that
  decides the next step (trainer: adapter, optimizer, scheduler, RNG; driver: data cursor, RNG,
  metrics row count). Pruning keeps the newest `keep_checkpoints` and never the one just written.
- Scratch (/dev/shm/rlfp8-<pid>-<name>) goes away on normal exit, an exception, SIGTERM and SIGINT;
  leftovers of dead processes (kill -9) are removed when the next run starts.
"""
from __future__ import annotations

import atexit
import base64
import fcntl
import json
import logging
import os
import random
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

from rlfp8.config import ConfigError, command_line_value, compose, compose_resume, to_dict, with_new_defaults

log = logging.getLogger("rlfp8")

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, CHECKPOINTS)      # any of them: the folder holds a run
SCRATCH_PREFIX = "rlfp8-"
# Keys a resume may not change without force=true (a prefix covers its whole group).
RESUME_FIXED = ("recipe", "seed", "model.path", "model.dtype", "adapter", "algo", "data", "trainer.weights",
                "engine.precision")


class RunFolderError(ConfigError):
    """The run folder cannot be used as asked (held by a live run, holds another run, nothing to resume)."""


# ---------------------------------------------------------------------------------------------- lock
def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # exists, owned by someone else
        return True
    return True


class RunLock:
    """An exclusive flock on run_dir/run.lock plus a JSON record of the owner (pid, host, start)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None

    def owner(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            return {}

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)      # not inherited by children (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            o = self.owner()
            raise RunFolderError(
                f"run_dir={self.path.parent} is in use by a live run (pid {o.get('pid', '?')} on host "
                f"{o.get('host', '?')}, started {o.get('started', '?')}); wait for it or stop it, or pick "
                f"another run_dir") from None
        previous = self.owner()
        if previous.get("pid"):
            log.warning("run folder %s: taking over the lock of a run that is gone (pid %s on %s, started %s)",
                        self.path.parent, previous.get("pid"), previous.get("host"), previous.get("started"))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        """Clears the owner record (never unlinks: a waiting opener would lock a dead inode)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)              # closing drops the flock
            self.fd = None


# ---------------------------------------------------------------------------------------------- scratch
def scratch_base(run_dir: Path) -> Path:
    """RAM-backed /dev/shm when writable, else the run folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else run_dir


def clean_dead_scratch(base: Path) -> list[Path]:
    """Remove rlfp8-<pid>-* folders under `base` whose process is gone (leftovers of kill -9)."""
    removed = []
    for p in base.glob(f"{SCRATCH_PREFIX}*-*"):
        pid = p.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if p.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.info("removed %d scratch folder(s) of dead runs under %s", len(removed), base)
    return removed


class _ExitCleanup:
    """Runs registered callbacks once, at interpreter exit or on SIGTERM/SIGINT (then the signal's
    previous behaviour continues: Ray's handler, KeyboardInterrupt, or death by the signal)."""

    def __init__(self):
        self.callbacks: list[Callable[[], None]] = []
        self.installed = False

    def add(self, fn: Callable[[], None]) -> None:
        self.callbacks.append(fn)
        if not self.installed:
            self.installed = True
            atexit.register(self.run)
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    previous = signal.getsignal(sig)
                    signal.signal(sig, lambda s, f, prev=previous: self._on_signal(s, f, prev))
                except ValueError:          # not the main thread: atexit still covers normal exits
                    pass

    def run(self) -> None:
        while self.callbacks:
            fn = self.callbacks.pop()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - cleanup must go on
                log.warning("cleanup failed: %s", e)

    def _on_signal(self, sig, frame, previous) -> None:
        self.run()
        if callable(previous):
            previous(sig, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)


EXIT_CLEANUP = _ExitCleanup()


# ---------------------------------------------------------------------------------------------- exact resume
def step_seed(seed: int, step: int) -> int:
    """The engine's sampling seed for RL step `step` (0-based): a function of (seed, step) only, so a
    resumed step samples what the uninterrupted run sampled."""
    import hashlib
    return int.from_bytes(hashlib.blake2b(f"rlfp8/{seed}/step{step}".encode(), digest_size=8).digest(), "little") >> 2


def driver_rng_state() -> dict:
    import torch
    return {"python": _jsonable(random.getstate()),
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def restore_driver_rng(state: dict) -> None:
    import torch
    random.setstate(_tupled(state["python"]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, tuple) else x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


# ---------------------------------------------------------------------------------------------- the folder
class RunFolder:
    def __init__(self, path: Path, resume: bool):
        self.path = Path(path)
        self.resume = resume
        self.lock = RunLock(self.path)
        self._scratch: Path | None = None

    # -- opening ------------------------------------------------------------------------------------
    @classmethod
    def start(cls, argv: list[str]) -> tuple["RunFolder", dict]:
        """Compose the config from the command line and take the folder it names (see module doc)."""
        if command_line_value(argv, "resume", False) is True:
            run_dir = command_line_value(argv, "run_dir")
            if not run_dir:
                raise ConfigError("resume=true needs run_dir=<the run's folder>")
            folder = cls.open(Path(str(run_dir)))
            cfg = folder.resume_config(argv, force=command_line_value(argv, "force", False) is True)
        else:
            cfg = to_dict(compose(argv))
            folder = cls.create(cfg)
        cfg["run_dir"] = str(folder.path)
        return folder, cfg

    @classmethod
    def create(cls, cfg: dict) -> "RunFolder":
        """Claim a folder for a fresh run: run_dir as given, or (new_run=true / no run_dir) the next free one."""
        if cfg["run_dir"]:
            wanted = Path(cfg["run_dir"]).expanduser().resolve()
            new_run = bool(cfg["new_run"])
        else:
            wanted = (Path("runs") / f"{cfg['recipe']}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
            new_run = True
        for n in range(1, 1000):
            path = wanted if n == 1 else wanted.with_name(f"{wanted.name}-{n}")
            folder = cls(path, resume=False)
            path.mkdir(parents=True, exist_ok=True)
            try:
                folder.lock.acquire()
            except RunFolderError:
                if new_run:
                    continue
                raise
            if not folder.holds_run():
                if n > 1:
                    print(f"rlfp8-train: {wanted} holds a run; new_run=true: this run uses {path}", flush=True)
                folder._after_lock()
                return folder
            folder.lock.release()
            if not new_run:
                raise RunFolderError(
                    f"run_dir={path} already holds a run ({', '.join(folder.markers())}); nothing was changed. "
                    f"resume=true continues it; new_run=true starts a new run in the next free folder "
                    f"{path.name}-2, ...")
        raise RunFolderError(f"run_dir={wanted}: no free folder among {wanted.name}-2 .. -999")

    @classmethod
    def open(cls, path: Path) -> "RunFolder":
        """Open an existing run's folder to resume it (locked)."""
        path = Path(path).expanduser().resolve()
        if not (path / CONFIG_FILE).exists():
            raise RunFolderError(f"resume=true run_dir={path}: no {CONFIG_FILE} there (not a run folder)")
        folder = cls(path, resume=True)
        folder.lock.acquire()
        folder._after_lock()
        return folder

    def _after_lock(self) -> None:
        EXIT_CLEANUP.add(self.lock.release)
        clean_dead_scratch(scratch_base(self.path))
        clean_dead_scratch(self.path)
        log.info("run folder: %s (%s)", self.path, "resume" if self.resume else "new run")

    def markers(self) -> list[str]:
        return [m for m in RUN_MARKERS if (self.path / m).exists()]

    def holds_run(self) -> bool:
        return bool(self.markers())

    def saved_config(self) -> dict:
        import yaml
        p = self.path / CONFIG_FILE
        try:
            return yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise RunFolderError(f"{p}: not readable YAML ({e})") from None

    def resume_config(self, argv: list[str], force: bool = False) -> dict:
        """The saved config with only the command line's overrides applied; refuses changes to
        RESUME_FIXED keys (naming them) unless force=true."""
        saved = with_new_defaults(self.saved_config())
        cfg = to_dict(compose_resume(saved, argv))
        changed = [k for k in _changed_keys(saved, cfg) if _fixed_on_resume(k)]
        if changed and not force:
            self.lock.release()
            raise RunFolderError(
                f"resume=true run_dir={self.path}: the overrides change {', '.join(changed)} of the saved run "
                f"(model, adapter, algorithm, data or seed); force=true applies them anyway")
        if changed:
            log.warning("resume with force=true: changed %s", ", ".join(changed))
        cfg["resume"] = True
        return cfg

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        d = self.path / CHECKPOINTS
        return sorted(p for p in d.glob("step_*") if (p / "COMPLETE").exists()) if d.exists() else []

    def latest_checkpoint(self) -> Path | None:
        done = self.checkpoints()
        return done[-1] if done else None

    def resume_point(self) -> tuple[Path | None, dict | None]:
        """(newest complete checkpoint, its driver state); metrics.jsonl is cut back to the rows it had
        when that checkpoint was written, so every step keeps exactly one row. A run stopped before its
        first checkpoint starts over from step 0 with its saved config: (None, None)."""
        if not self.resume:
            return None, None
        ckpt = self.latest_checkpoint()
        if ckpt is None:
            log.warning("resume=true: %s/%s holds no complete checkpoint yet; starting the run over from step 0 "
                        "with its saved config", self.path, CHECKPOINTS)
            self.truncate_metrics(0, 0)
            return None, None
        state = json.loads((ckpt / "driver.json").read_text())
        self.truncate_metrics(state.get("metrics_rows"), state["step"])
        return ckpt, state

    def truncate_metrics(self, rows: int | None, step: int) -> None:
        path = self.path / METRICS_FILE
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        lines = [ln for ln in lines if ln.endswith("\n")]              # a line cut by a kill is dropped
        if rows is not None:
            kept = lines[:rows]
        else:                                                           # checkpoints without the count
            kept = [ln for ln in lines if _row_step(ln) is not None and _row_step(ln) <= step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)

    def save_checkpoint(self, step: int, save_trainer: Callable[[str], Any], driver_state: dict,
                        keep: int) -> Path:
        """Write checkpoints/step_<step>: the trainer's part (save_trainer(dir)), driver.json with the
        metrics row count, then the COMPLETE marker; prune older ones."""
        d = self.path / CHECKPOINTS / f"step_{step:06d}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        save_trainer(str(d))
        state = {"step": step, **driver_state, "metrics_rows": self._metrics_rows()}
        (d / "driver.json").write_text(json.dumps(state))
        (d / "COMPLETE").write_text(time.strftime("%Y-%m-%d %H:%M:%S"))      # last: the marker of a whole one
        self.prune(keep, current=d)
        return d

    def _metrics_rows(self) -> int:
        path = self.path / METRICS_FILE
        return sum(1 for ln in path.read_text().splitlines(keepends=True) if ln.endswith("\n")) if path.exists() else 0

    def prune(self, keep: int, current: Path) -> list[Path]:
        """Delete all but the newest `keep` complete checkpoints (never `current`) and incomplete ones
        older than `current` (kills during a save)."""
        keep_set = set(self.checkpoints()[-keep:]) | {current}
        removed = []
        for p in sorted((self.path / CHECKPOINTS).glob("step_*")):
            complete = (p / "COMPLETE").exists()
            if p not in keep_set and (complete or p.name < current.name):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed

    # -- scratch and end ----------------------------------------------------------------------------
    def scratch_dir(self) -> Path:
        """This process's scratch folder (adapters on their way to the engine); removed on any exit."""
        if self._scratch is None:
            self._scratch = scratch_base(self.path) / f"{SCRATCH_PREFIX}{os.getpid()}-{self.path.name}"
            self._scratch.mkdir(parents=True, exist_ok=True)
            EXIT_CLEANUP.add(lambda p=self._scratch: shutil.rmtree(p, ignore_errors=True))
        return self._scratch

    def close(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self.lock.release()


def _fixed_on_resume(key: str) -> bool:
    return key != "model.resolved_path" and any(key == p or key.startswith(p + ".") for p in RESUME_FIXED)


def _row_step(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose value differs between two nested dicts (present in either)."""
    out = []
    for k in sorted(set(old) | set(new), key=str):
        a, b, full = old.get(k), new.get(k), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_keys(a, b, full + ".")
        elif a != b:
            out.append(full)
    return out
