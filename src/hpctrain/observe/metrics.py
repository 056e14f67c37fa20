"""Metrics that show where the time goes: `RUN_DIR/metrics.jsonl`, console lines or a bar."""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpctrain.config import ConfigError
from hpctrain.distributed import all_gather_floats, all_hostnames, all_reduce_max, all_reduce_sum

if TYPE_CHECKING:
    from hpctrain.observe.trackers import Trackers

log = logging.getLogger("hpctrain")

# Log records the ETA looks back over: recent enough to follow a change of speed, long enough
# not to jump at each line (an evaluation or a save lands in one interval of the window).
ETA_WINDOW = 10


class StragglerWatch:
    """Names a rank that computes slowly: its compute time per step stays above `ratio` times
    the median rank's for `patience` logged steps in a row; warned once per such occurrence.

    Every rank gets the same per-rank times (one all-gather), so every rank takes the same
    decisions here (the host-name gather at a warning is a collective of all ranks).
    """

    def __init__(self, ratio: float = 1.5, patience: int = 3) -> None:
        self.ratio, self.patience = ratio, patience
        self.streak = 0
        self.hosts: list[str] | None = None

    def observe(self, compute_s: list[float]) -> dict[str, Any]:
        """Per-rank compute times of one log interval → the record's fields (and the warning)."""
        median = statistics.median(compute_s)
        worst = max(compute_s)
        slowest = compute_s.index(worst)
        self.streak = self.streak + 1 if worst > self.ratio * median > 0 else 0
        if self.streak == self.patience:
            if self.hosts is None:
                self.hosts = all_hostnames()
            if is_main_rank():
                log.warning(
                    "straggler: rank %d on %s computes %.0f ms per step, %.1fx the median "
                    "rank's %.0f ms, for %d logged steps in a row",
                    slowest,
                    self.hosts[slowest],
                    worst * 1000,
                    worst / median,
                    median * 1000,
                    self.patience,
                )
        return {
            "compute_time_s_median": median,
            "compute_time_s_worst": worst,
            "slowest_rank": slowest,
        }


def is_main_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


class IntervalMeter:
    """Sums over the steps since the last log line: step time, data wait, compute time (this
    rank's, from the start of a step to its first gradient collective), loss, samples."""

    def __init__(self) -> None:
        self.stragglers = StragglerWatch()
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.samples = 0
        self.step_time = 0.0
        self.data_wait = 0.0
        self.compute_time = 0.0
        # Tensors, summed on the device: reading them (a sync) happens only at log steps.
        self.sums: dict[str, torch.Tensor] = {}

    def add(
        self,
        *,
        samples: int,
        step_time: float,
        data_wait: float,
        values: dict[str, torch.Tensor],
        compute_time: float = 0.0,
    ) -> None:
        self.steps += 1
        self.samples += samples
        self.step_time += step_time
        self.data_wait += data_wait
        self.compute_time += compute_time
        for name, value in values.items():
            self.sums[name] = self.sums[name] + value if name in self.sums else value.clone()

    def summarize(self, device: torch.device, world_size: int) -> dict[str, float]:
        """Reduce over ranks (one all-reduce of sums, one of the worst data wait, one
        all-gather of each rank's compute time: the straggler check)."""
        steps = max(1, self.steps)
        local_wait = self.data_wait / self.step_time if self.step_time > 0 else 0.0
        names = sorted(self.sums)
        totals = all_reduce_sum(
            [
                float(self.samples),
                self.step_time,
                local_wait,
                *(float(self.sums[n]) for n in names),
            ],
            device,
        )
        samples, step_time_sum, wait_sum = totals[:3]
        worst = all_reduce_max(local_wait, device)
        out = {
            name: total / (steps * world_size)
            for name, total in zip(names, totals[3:], strict=True)
        }
        mean_step_time = step_time_sum / (steps * world_size)
        out.update(
            {
                "samples_per_s": samples / max(1e-9, step_time_sum / world_size),
                "step_time_s": mean_step_time,
                "data_wait_fraction": min(1.0, wait_sum / world_size),
                "data_wait_fraction_worst": min(1.0, worst),
            }
        )
        out.update(self.stragglers.observe(all_gather_floats(self.compute_time / steps, device)))
        return out


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class MetricMonitor:
    """`checkpoint.monitor` over the evaluations of a run: which are among the best, and how
    many evaluations have passed since the best (`train.early_stop_patience`).

    Its state travels in the checkpoint manifests (`state_dict`), so that a resumed run goes
    on counting where the checkpoint left off.

    Args:
        name: the key of the evaluation record to watch ("val_accuracy"); "" disables.
        mode: "max" or "min": which values are better.
        keep_best: how many best values make a checkpoint worth saving (`checkpoint.keep_best`).
        patience: evaluations in a row without a better value before `should_stop`; 0: never.
    """

    def __init__(self, name: str, mode: str = "max", keep_best: int = 0, patience: int = 0):
        if not name and (keep_best or patience):
            key = "checkpoint.keep_best" if keep_best else "train.early_stop_patience"
            raise ConfigError(f"{key} needs checkpoint.monitor (the evaluation metric to rank by)")
        self.name, self.mode, self.keep_best, self.patience = name, mode, keep_best, patience
        self.best: list[float] = []  # the keep_best (at least 1) best values so far, best first
        self.evals_since_best = 0
        self.last: tuple[int, float] | None = None  # (step, value) of the last evaluation

    def better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b

    def observe(self, record: dict[str, Any]) -> bool:
        """Take an evaluation record; True when its value is among the `keep_best` best so
        far (a checkpoint of this step should then be saved)."""
        if not self.name:
            return False
        if self.name not in record:
            known = ", ".join(k for k in record if k not in ("kind", "step", "epoch"))
            raise ConfigError(
                f"checkpoint.monitor={self.name!r}: not in the evaluation record ({known})"
            )
        value = float(record[self.name])
        self.last = (int(record["step"]), value)
        if not math.isfinite(value):  # a diverged evaluation is never best
            self.evals_since_best += 1
            return False
        if self.best and not self.better(value, self.best[0]):
            self.evals_since_best += 1
        else:
            self.evals_since_best = 0
        kept = max(1, self.keep_best)
        enters = len(self.best) < kept or self.better(value, self.best[-1])
        if enters:
            self.best = sorted([*self.best, value], reverse=self.mode == "max")[:kept]
        return enters and self.keep_best > 0

    def score_at(self, step: int) -> float | None:
        """The monitored value of the evaluation at `step`, if the last one was there."""
        if self.last is not None and self.last[0] == step:
            return self.last[1]
        return None

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.evals_since_best >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "best": self.best, "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue from a saved state; one of another metric (or none) starts afresh."""
        if not state or state.get("name") != self.name:
            return
        self.best = [float(v) for v in state["best"]][: max(1, self.keep_best)]
        self.evals_since_best = int(state["evals_since_best"])


class MetricsWriter:
    """Rank 0 appends one JSON object per logged step; the console gets a line or a bar;
    trackers (W&B, MLflow; `hpctrain.observe.trackers`) get every record too."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        progress: str,
        total_steps: int,
        tensorboard: bool,
        trackers: Trackers | None = None,
        first: dict[str, Any] | None = None,
        num_epochs: int = 0,
        start_step: int = 0,
    ) -> None:
        """`first`: fields of this process's first training record only (the mesh), in
        metrics.jsonl, not sent to the trackers. `num_epochs`: the epochs the run spans (0:
        unknown, not shown); `start_step`: the step it resumed at."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.num_epochs = num_epochs
        self.eta = Eta(total_steps)
        self.first = dict(first or {})
        self.path = run_dir / "metrics.jsonl"
        self.bar: Any = None
        self.tb: Any = None
        self.trackers = trackers if enabled else None
        if not enabled:
            return
        use_bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
        if use_bar:
            from tqdm import tqdm

            # `initial`: a resumed run's rate and ETA count this process's steps only
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RuntimeError(
                    "logging.tensorboard=true needs the tensorboard extra: pip install 'hpctrain[tensorboard]'"
                ) from None
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self._file = self.path.open("a")
        self.start = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.first and record.get("kind", "train") == "train":
            self._file.write(json.dumps({**record, **self.first}) + "\n")
            self.first = {}
        else:
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.trackers is not None:
            self.trackers.log(record)
        if self.tb is not None:
            for name, value in record.items():
                if isinstance(value, (int, float)) and name != "step":
                    self.tb.add_scalar(
                        f"{record.get('kind', 'train')}/{name}", value, record["step"]
                    )
        if record.get("kind") == "eval":
            line = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k != "kind")
            self._print(f"eval {line}")
            return
        if self.bar is not None:  # tqdm shows the step of the total and its own ETA
            self.bar.update(record["step"] - self.bar.n)
            rate = {"tok_s": f"{record['tokens_per_s']:.0f}"} if "tokens_per_s" in record else {}
            self.bar.set_postfix(
                epoch=epoch_text(record["epoch"], self.num_epochs),
                loss=f"{record['loss']:.4f}",
                **(rate or {"img_s": f"{record['samples_per_s']:.0f}"}),
                wait=f"{record['data_wait_fraction']:.0%}",
            )
            return
        eta_s = self.eta.update(record["step"], record["step_time_s"])
        self._print(console_line(record, self.total_steps, self.num_epochs, eta_s))

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self, status: str = "finished") -> None:
        """Close the file, the bar and the trackers; `status` is how the run ends for the
        trackers: "finished", "preempted" (saved, to be requeued) or "failed"."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.trackers is not None:
            self.trackers.close(status)
        self._file.close()


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


class Eta:
    """Seconds left to `total_steps`, from the wall-clock time of the recent logged steps:
    evaluations, saves and data waits are part of what remains, so they count (as in tqdm's
    and the Hugging Face Trainer's estimates). Before a second log record, the step time."""

    def __init__(self, total_steps: int, window: int = ETA_WINDOW) -> None:
        self.total_steps = total_steps
        self.recent: deque[tuple[int, float]] = deque(maxlen=window)  # (step, monotonic s)

    def update(self, step: int, step_time_s: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self.recent.append((step, now))
        first_step, first_time = self.recent[0]
        per_step = (now - first_time) / (step - first_step) if step > first_step else step_time_s
        return max(0, self.total_steps - step) * per_step


def format_duration(seconds: float) -> str:
    """`4:05`, `1:02:03` (h:mm:ss, as `hpctrain convert` prints its ETA)."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def epoch_text(epoch: int, num_epochs: int) -> str:
    """The epoch a step is in, counted from 1 (`3/10`): `epoch` is the record's, from 0."""
    return f"{epoch + 1}/{num_epochs}" if num_epochs else str(epoch + 1)


def console_line(record: dict[str, Any], total_steps: int, num_epochs: int, eta_s: float) -> str:
    """One training record as a console line: where the run is, how it learns, how fast, when
    it ends (tokens/s for tasks that count tokens, causal_lm; else samples/s)."""
    step = record["step"]
    if "tokens_per_s" in record:
        rate = f"{record['tokens_per_s']:.0f} tokens/s"
    else:
        rate = f"{record['samples_per_s']:.1f} samples/s"
    return (
        f"step {step}/{total_steps} epoch {epoch_text(record['epoch'], num_epochs)} "
        f"loss {record['loss']:.4f} lr {record['lr']:.2e} {rate} "
        f"data-wait {record['data_wait_fraction']:.1%} "
        f"(worst {record['data_wait_fraction_worst']:.1%}) "
        f"step {record['step_time_s'] * 1000:.0f} ms ETA {format_duration(eta_s)}"
    )
