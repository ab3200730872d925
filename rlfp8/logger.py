"""Run logging: resolved config, metrics JSONL, Weights & Biases, a console line, a final plot.

Everything a run records lives in its run folder::

    run_dir/config.yaml     the resolved config (written at start, next to the metrics)
    run_dir/metrics.jsonl   one JSON object per logged step: {"step", "time" (unix s), ...metrics}
    run_dir/wandb_id.txt    the W&B run id, so resume=true continues the same W&B run
    run_dir/wandb/          W&B's own files (offline runs: ``wandb sync run_dir/wandb/offline-*``)
    run_dir/plot.png        reward, mismatch KL and step time over steps (written by finish())

The JSONL is the record of truth; W&B is a mirror and may fail or be missing: every W&B error is
logged as a warning and W&B is switched off for the rest of the run, never raising into training.
Note that W&B drops rows whose step is <= the last step it already holds, so after a resume the
steps between the checkpoint and the crash are not re-logged there (they are in the JSONL).

``wandb_mode``: "online", "offline", "disabled", or "auto" = online when ``WANDB_API_KEY`` is set
or a W&B key is in the netrc file (``wandb login``), offline otherwise.
"""
from __future__ import annotations

import json
import logging
import math
import netrc
import os
import secrets
import string
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled", "auto")

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id.txt"
PLOT_FILE = "plot.png"

# console line: (metric key, label, format) shown when the key is present in a log() call
CONSOLE_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/reward", "eval", "{:.3f}"),
    ("mismatch/kl_k3", "kl_k3", "{:.2e}"),
    ("time/step", "step_time", "{:.1f}s"),
)
TIME_PARTS = ("time/rollout", "time/train", "time/sync")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _plain(x: Any) -> Any:
    """Config / metric value -> YAML/JSON-safe python (tensors and numpy scalars -> numbers,
    Path -> str, tuples -> lists, non-finite floats -> None)."""
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 0) == 0 and not isinstance(x, (str, bytes)):
        try:
            x = x.item()
        except Exception:  # noqa: BLE001 - fall through to str()
            return str(x)
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_plain(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return str(x)


def _config_to_dict(config: Any) -> dict:
    if config is None:
        return {}
    try:  # an OmegaConf DictConfig: resolve interpolations
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            config = OmegaConf.to_container(config, resolve=True)
    except ImportError:
        pass
    if not isinstance(config, Mapping):
        raise ValueError(f"RunLogger: config must be a dict (the resolved config), got {type(config).__name__}")
    return _plain(config)


def wandb_logged_in() -> bool:
    """True when a W&B API key is available without a prompt: WANDB_API_KEY, or a netrc entry for
    the W&B host (``WANDB_BASE_URL``, default api.wandb.ai). Reads no network."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    candidates = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for c in candidates:
        path = Path(c).expanduser()
        if not path.is_file():
            continue
        try:
            auth = netrc.netrc(str(path)).authenticators(host)
        except (netrc.NetrcParseError, OSError):
            continue
        if auth and auth[2]:
            return True
    return False


def resolve_wandb_mode(mode: str) -> str:
    """"auto" -> "online" if ``wandb_logged_in()`` else "offline"; other modes unchanged."""
    if mode not in WANDB_MODES:
        raise ValueError(f"logger.wandb.mode={mode!r}; allowed values are {WANDB_MODES}")
    if mode == "auto":
        return "online" if wandb_logged_in() else "offline"
    return mode


def read_metrics(metrics_jsonl: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl; a line that does not parse (a crash mid-write) is skipped."""
    rows = []
    path = Path(metrics_jsonl)
    if not path.exists():
        return rows
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------
def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(row["step"])
            ys.append(float(v))
    return xs, ys


def make_plot(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Write a 3-panel PNG over steps: reward ("reward/mean" and "eval/reward" where present),
    mismatch KL ("mismatch/kl_k3", log scale when all values are > 0), step time ("time/rollout",
    "time/train", "time/sync" stacked when present, plus "time/step" as a line). Panels without
    data say so. Uses matplotlib's Agg canvas directly (no pyplot, no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted(read_metrics(metrics_jsonl), key=lambda r: r["step"])
    fig = Figure(figsize=(13, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax_r, ax_kl, ax_t = fig.subplots(1, 3)

    # reward
    xs, ys = _series(rows, "reward/mean")
    ex, ey = _series(rows, "eval/reward")
    if xs:
        ax_r.plot(xs, ys, label="train reward/mean", color="C0")
    if ex:
        ax_r.plot(ex, ey, "o-", label="eval/reward", color="C1")
    if xs or ex:
        ax_r.legend(fontsize=8)
    else:
        _no_data(ax_r, "reward")
    ax_r.set_title("reward")

    # mismatch KL
    kx, ky = _series(rows, "mismatch/kl_k3")
    if kx:
        ax_kl.plot(kx, ky, color="C2")
        if all(v > 0 for v in ky):
            ax_kl.set_yscale("log")
    else:
        _no_data(ax_kl, "mismatch/kl_k3")
    ax_kl.set_title("mismatch KL (k3, engine vs trainer)")

    _plot_step_time(ax_t, rows)

    for ax in (ax_r, ax_kl, ax_t):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out



def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot_step_time(ax, rows: list[dict]) -> None:
    """The time/* parts stacked where present, plus time/step as a line."""
    parts = [(k, _series(rows, k)) for k in TIME_PARTS]
    parts = [(k, s) for k, s in parts if s[0]]
    tx, ty = _series(rows, "time/step")
    if parts:
        steps = sorted({x for _, (px, _) in parts for x in px})
        stacks = []
        for _, (px, py) in parts:
            d = dict(zip(px, py))
            stacks.append([d.get(s, 0.0) for s in steps])
        ax.stackplot(steps, *stacks, labels=[k.split("/", 1)[1] for k, _ in parts], alpha=0.7)
    if tx:
        ax.plot(tx, ty, color="black", linewidth=1, label="step")
    if parts or tx:
        ax.legend(fontsize=8, loc="upper right")
        ax.set_ylim(bottom=0)
    else:
        _no_data(ax, "step time")
    ax.set_title("step time [s]")


# --------------------------------------------------------------------------------------------
# the logger
# --------------------------------------------------------------------------------------------
class RunLogger:
    """Logs one training run to ``run_dir`` (files listed in the module docstring) and W&B.

    Usage::

        logger = RunLogger(run_dir, resolved_cfg, wandb_mode="auto", project="rlfp8", resume=resume)
        if resume: logger.truncate_after(ckpt_step)
        for step in ...: logger.log(step, {"reward/mean": ..., "mismatch/kl_k3": ..., "time/step": ...})
        plot_png = logger.finish()

    A fresh run (resume=False) starts a new metrics.jsonl and a new W&B run id; resume=True appends
    to the existing metrics.jsonl and continues the W&B run whose id is in wandb_id.txt.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: Mapping | None = None,
        wandb_mode: str = "auto",
        project: str = "rlfp8",
        name: str | None = None,
        resume: bool = False,
        console: bool = True,
        console_every: int = 1,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config = _config_to_dict(config)
        self.wandb_mode = resolve_wandb_mode(wandb_mode)
        self.project = project
        self.name = name
        self.resume = bool(resume)
        self.console = console
        self.console_every = console_every
        self.metrics_path = self.run_dir / METRICS_FILE
        self.config_path = self.run_dir / CONFIG_FILE
        self.plot_path = self.run_dir / PLOT_FILE
        self._wandb_run = None
        self._finished = False

        self._write_config()
        if not self.resume:
            self.metrics_path.write_text("")
        self._file = self.metrics_path.open("a")
        self._init_wandb()

    # -- files ---------------------------------------------------------------------------------
    def _write_config(self) -> None:
        import yaml

        tmp = self.config_path.with_suffix(".yaml.tmp")
        tmp.write_text(yaml.safe_dump(self.config, sort_keys=False, default_flow_style=False))
        os.replace(tmp, self.config_path)

    def truncate_after(self, step: int) -> int:
        """Drop metrics.jsonl rows with step > ``step`` (and unparsable lines) when resuming from
        the checkpoint of ``step``; returns the number of rows kept."""
        self._file.close()
        rows = [r for r in read_metrics(self.metrics_path) if r["step"] <= step]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.metrics_path)
        self._file = self.metrics_path.open("a")
        return len(rows)

    # -- W&B -----------------------------------------------------------------------------------
    def _wandb_id(self) -> str:
        id_path = self.run_dir / WANDB_ID_FILE
        if self.resume and id_path.exists():
            run_id = id_path.read_text().strip()
            if run_id:
                return run_id
        # W&B's own ids are 8 characters of [a-z0-9]; its generator moved between versions.
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        id_path.write_text(run_id + "\n")
        return run_id

    def _init_wandb(self) -> None:
        if self.wandb_mode == "disabled":
            return
        try:
            import wandb
        except Exception as e:  # noqa: BLE001 - W&B is optional at run time
            log.warning("wandb is not importable (%s); logging to %s only", e, self.metrics_path)
            return
        try:
            run_id = self._wandb_id()
            self._wandb_run = wandb.init(
                project=self.project,
                name=self.name,
                id=run_id,
                resume="allow" if self.resume else None,
                dir=str(self.run_dir),
                config=self.config,
                mode=self.wandb_mode,
                allow_val_change=True,
            )
        except Exception as e:  # noqa: BLE001 - never crash a run because of W&B
            log.warning("wandb.init failed (%s: %s); continuing without W&B, metrics go to %s",
                        type(e).__name__, e, self.metrics_path)
            self._wandb_run = None

    @property
    def wandb_run(self):
        """The live ``wandb.Run`` (None when disabled, missing or failed)."""
        return self._wandb_run

    # -- logging -------------------------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append {"step", "time", **metrics} to metrics.jsonl, mirror to W&B, print a line."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"RunLogger.log: step must be an int, got {step!r}")
        clean = {str(k): _plain(v) for k, v in metrics.items() if k not in ("step", "time")}
        row = {"step": step, "time": time.time(), **clean}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            try:
                self._wandb_run.log({k: v for k, v in clean.items() if v is not None}, step=step)
            except Exception as e:  # noqa: BLE001
                log.warning("wandb.log failed (%s: %s); W&B switched off for this run", type(e).__name__, e)
                self._close_wandb()
        if self.console and step % self.console_every == 0:
            self._print(step, clean)

    def _print(self, step: int, m: Mapping[str, Any]) -> None:
        parts = [f"step {step}"]
        for key, label, fmt in CONSOLE_FIELDS:
            v = m.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                parts.append(f"{label} {fmt.format(v)}")
        line = " | ".join(parts)
        try:
            from tqdm import tqdm

            tqdm.write(line)  # does not break a live progress bar
        except Exception:  # noqa: BLE001
            print(line, flush=True)

    # -- end -----------------------------------------------------------------------------------
    def _close_wandb(self) -> None:
        run, self._wandb_run = self._wandb_run, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("wandb finish failed (%s: %s)", type(e).__name__, e)

    def finish(self) -> Path:
        """Close W&B and the JSONL, write run_dir/plot.png; returns the plot's path. Idempotent."""
        if not self._finished:
            self._finished = True
            self._close_wandb()
            self._file.close()
            try:
                make_plot(self.metrics_path, self.plot_path)
            except Exception as e:  # noqa: BLE001 - a plot never fails a finished run
                log.warning("plot failed (%s: %s)", type(e).__name__, e)
        return self.plot_path

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
