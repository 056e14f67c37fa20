"""Metrics that show where the time goes: `RUN_DIR/metrics.jsonl`, console lines or a bar."""

from __future__ import annotations

import contextlib
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
from hpctrain.distributed import (
    all_gather_vectors,
    all_hostnames,
    all_reduce_max,
    all_reduce_sum,
)
from hpctrain.errors import install_hint

if TYPE_CHECKING:
    from hpctrain.observe.trackers import Trackers

log = logging.getLogger("hpctrain")

# Log records the ETA looks back over: recent enough to follow a change of speed, long enough
# not to jump at each line (an evaluation or a save lands in one interval of the window).
ETA_WINDOW = 10


# The points of a step where a rank meets the others, in order: the model's call (DDP's buffer
# broadcast, FSDP2's first all-gather), the last micro-step's backward (the gradient
# reduction) and the step boundary's all-reduce (the Trainer's flags).
SYNC_POINTS = ("model_call", "backward", "boundary")


class ArrivalClock:
    """When this rank reaches each of the step's `SYNC_POINTS`, in seconds after it left the
    last step boundary's all-reduce. Every rank leaves that all-reduce at the same moment,
    so these times compare across ranks without a common clock: at each point, a rank's
    time less the earliest rank's is how long the earliest waited for it there (when a sync
    point between hides a delay from the next one, it shows at the first point after it)."""

    def __init__(self) -> None:
        self.departed: float | None = None
        self.marks: dict[str, float] = {}

    def start_step(self) -> None:
        self.marks = {}

    def mark(self, point: str) -> None:
        """The first arrival at `point` in this step (later calls, such as micro-steps and
        an evaluation's forwards, do not move it)."""
        self.marks.setdefault(point, time.perf_counter())

    def leave_boundary(self) -> None:
        self.departed = time.perf_counter()

    def arrivals(self) -> list[float] | None:
        """The step's arrival times at `SYNC_POINTS`, or None (the first step, which no
        boundary precedes, or a point not reached)."""
        if self.departed is None or any(point not in self.marks for point in SYNC_POINTS):
            return None
        return [self.marks[point] - self.departed for point in SYNC_POINTS]


class GpuForwardTimer:
    """Each rank's forward on its GPU, from CUDA events recorded around it each step and read
    at log steps only (after the log step's synchronize: no new wait per step). The host's
    times follow the kernel launches, not the GPU's work: a throttled GPU shows only here.

    `event_class`: `torch.cuda.Event` (a fake of its `record`/`elapsed_time` in tests).
    """

    def __init__(self, event_class: Any = None) -> None:
        self.event_class = event_class or torch.cuda.Event
        self.pairs: list[tuple[Any, Any]] = []
        self.start: Any = None

    def forward_starts(self) -> None:
        if self.start is None:
            self.start = self.event_class(enable_timing=True)
            self.start.record()

    def backward_starts(self) -> None:
        if self.start is not None:
            end = self.event_class(enable_timing=True)
            end.record()
            self.pairs.append((self.start, end))
        self.start = None

    def read(self) -> tuple[float, int]:
        """Seconds of forward over the steps since the last read, and their number (the
        events must have completed: call after a synchronize)."""
        total = sum(start.elapsed_time(end) for start, end in self.pairs) / 1000
        count = len(self.pairs)
        self.pairs = []
        return total, count


class StragglerWatch:
    """Names the rank the others wait for, wherever in its step it is slow: from the ranks'
    arrivals at the step's sync points (`ArrivalClock`), and on GPUs from each rank's forward
    on its device (`GpuForwardTimer`). A rank straggles when the earliest rank waits for it
    more than `ratio - 1` times the rest of its step (it takes `ratio` times the others'
    time), or when its GPU's forward takes more than `ratio` times the other ranks' median,
    for `patience` logged steps in a row; warned once per such occurrence.

    Every rank gets the same per-rank figures (one all-gather), so every rank takes the same
    decisions here (the host-name gather at a warning is a collective of all ranks).
    """

    def __init__(self, ratio: float = 1.5, patience: int = 3) -> None:
        self.ratio, self.patience = ratio, patience
        self.streak = 0
        self.gpu_streak = 0
        self.hosts: list[str] | None = None

    def observe(
        self,
        compute_s: list[float],
        lateness_s: list[float] | None = None,
        step_s: float = 0.0,
        gpu_forward_s: list[float] | None = None,
    ) -> dict[str, Any]:
        """One log interval's per-rank figures (per step) -> the record's fields.

        `compute_s`: each rank's host time from its step's start to its backward (less data
        wait); `lateness_s`: how long the earliest rank waited for each rank at the step's
        sync points; `step_s`: the mean step time; `gpu_forward_s`: each GPU's forward.
        """
        median = statistics.median(compute_s)
        fields: dict[str, Any] = {
            "compute_time_s_median": median,
            "compute_time_s_worst": max(compute_s),
        }
        if lateness_s is None:
            if len(compute_s) == 1:
                fields["slowest_rank"] = 0  # one process
            # else the first logged steps, before any step's arrivals are known: no name
            return fields
        wait = max(lateness_s)
        slowest = lateness_s.index(wait)
        fields["slowest_rank"] = slowest
        fields["wait_for_slowest_s"] = wait
        others = max(0.0, step_s - wait)  # the step of a rank that did not straggle
        self.streak = self.streak + 1 if wait > (self.ratio - 1) * others > 0 else 0
        if self.streak == self.patience:
            self.warn(
                slowest,
                f"holds the others {wait * 1000:.0f} ms per step at its sync points (steps "
                f"of {step_s * 1000:.0f} ms: {(others + wait) / max(others, 1e-9):.1f}x "
                f"the others' time), for {self.patience} logged steps in a row",
            )
        if gpu_forward_s:
            gpu_worst = max(gpu_forward_s)
            gpu_slowest = gpu_forward_s.index(gpu_worst)
            rest = statistics.median(gpu_forward_s[:gpu_slowest] + gpu_forward_s[gpu_slowest + 1 :])
            fields.update(
                gpu_forward_s_median=statistics.median(gpu_forward_s),
                gpu_forward_s_worst=gpu_worst,
                slowest_gpu_rank=gpu_slowest,
            )
            slow = gpu_worst > self.ratio * rest > 0
            self.gpu_streak = self.gpu_streak + 1 if slow else 0
            if self.gpu_streak == self.patience:
                self.warn(
                    gpu_slowest,
                    f"runs its forward on its GPU in {gpu_worst * 1000:.0f} ms, "
                    f"{gpu_worst / rest:.1f}x the other ranks' median of {rest * 1000:.0f} "
                    f"ms, for {self.patience} logged steps in a row",
                )
        return fields

    def warn(self, rank: int, what: str) -> None:
        if self.hosts is None:
            self.hosts = all_hostnames()
        if is_main_rank():
            log.warning("straggler: rank %d on %s %s", rank, self.hosts[rank], what)


def is_main_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


class IntervalMeter:
    """Sums over the steps since the last log line: step time, data wait, compute time (this
    rank's, from the start of a step to its first gradient collective), the arrivals at the
    step's sync points, the GPU's forward time, loss, samples, the steps' targets.

    The loss and metric values a step adds are this rank's shares of the step's values
    (`train.step`: each micro-batch's mean weighed by its share of the step's targets on
    every rank), so their sum over the ranks is the step's value; the logged value is their
    mean over the steps that had targets. A step without any (`targets` 0) is counted
    (`empty_steps`) and left out of that mean: it would log a loss of 0.
    """

    def __init__(self) -> None:
        self.stragglers = StragglerWatch()
        self.clock = ArrivalClock()
        self.gpu_forward: GpuForwardTimer | None = None  # set for CUDA devices
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.samples = 0
        self.step_time = 0.0
        self.data_wait = 0.0
        self.compute_time = 0.0
        self.targets = 0  # the steps' targets, summed (every rank has the same)
        self.empty_steps = 0  # steps without any target on any rank
        self.arrivals = [0.0] * len(SYNC_POINTS)
        self.arrival_steps = 0
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
        targets: int = 1,
    ) -> None:
        """One step: `values` are this rank's shares of the step's loss and metrics, summed
        over the ranks at a log step; `targets` the step's targets on every rank."""
        self.steps += 1
        self.targets += targets
        self.empty_steps += not targets
        self.samples += samples
        self.step_time += step_time
        self.data_wait += data_wait
        self.compute_time += compute_time
        for name, value in values.items():
            self.sums[name] = self.sums[name] + value if name in self.sums else value.clone()

    def add_arrivals(self) -> None:
        """Add the step's arrivals at its sync points (`ArrivalClock`): called once it reached
        the boundary's all-reduce (after a log step's record: they count in the next one)."""
        arrivals = self.clock.arrivals()
        if arrivals is not None:
            self.arrivals = [a + b for a, b in zip(self.arrivals, arrivals, strict=True)]
            self.arrival_steps += 1

    def summarize(self, device: torch.device, world_size: int) -> dict[str, float]:
        """Reduce over ranks (one all-reduce of sums, one of the worst data wait, one
        all-gather of each rank's compute time, arrivals and GPU forward time: the
        straggler check)."""
        steps = max(1, self.steps)
        local_wait = self.data_wait / self.step_time if self.step_time > 0 else 0.0
        names = sorted(self.sums)
        totals = all_reduce_sum(
            [
                float(self.samples),
                self.step_time,
                local_wait,
                self.data_wait,
                *(float(self.sums[n]) for n in names),
            ],
            device,
        )
        samples, step_time_sum, wait_sum, wait_seconds = totals[:4]
        worst = all_reduce_max(local_wait, device)
        with_targets = self.steps - self.empty_steps
        # steps without targets add nothing: their mean would be 0/0 (NaN, as a loss that is
        # not known, rather than a 0.0 that looks like a perfect fit)
        out = {
            name: total / with_targets if with_targets else math.nan
            for name, total in zip(names, totals[4:], strict=True)
        }
        mean_step_time = step_time_sum / (steps * world_size)
        out.update(
            {
                "targets": self.targets / steps,
                "empty_steps": self.empty_steps,
                "samples_per_s": samples / max(1e-9, step_time_sum / world_size),
                "step_time_s": mean_step_time,
                "data_wait_fraction": min(1.0, wait_sum / world_size),
                "data_wait_fraction_worst": min(1.0, worst),
                # the interval's sums (mean rank): what `status --goodput` adds up
                "interval_steps": self.steps,
                "data_wait_s": wait_seconds / world_size,
            }
        )
        gpu_s, gpu_steps = self.gpu_forward.read() if self.gpu_forward else (0.0, 0)
        mine = [
            self.compute_time / steps,
            *(a / max(1, self.arrival_steps) for a in self.arrivals),
            float(self.arrival_steps),
            gpu_s / max(1, gpu_steps),
            float(gpu_steps),
        ]
        ranks = all_gather_vectors(mine, device)
        compute = [r[0] for r in ranks]
        lateness = None
        if world_size > 1 and all(r[1 + len(SYNC_POINTS)] > 0 for r in ranks):
            points = range(1, 1 + len(SYNC_POINTS))
            earliest = [min(r[i] for r in ranks) for i in points]
            lateness = [max(r[i] - earliest[i - 1] for i in points) for r in ranks]
        gpu = [r[-2] for r in ranks] if all(r[-1] > 0 for r in ranks) else None
        out.update(self.stragglers.observe(compute, lateness, mean_step_time, gpu))
        return out


def peak_memory_mb(device: torch.device) -> float:
    """The peak memory since the last call (at log steps: the interval's), then reset.

    On CUDA the peak allocated memory (`reset_peak_memory_stats`); on CPU the process's peak
    resident memory (Linux's VmHWM, reset through /proc/self/clear_refs; where that cannot
    be read or reset, the peak since the process started, as `getrusage` gives it).
    """
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    try:
        status = Path("/proc/self/status").read_text()
        peak_kib = next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")
        )
    except (OSError, StopIteration, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    return peak_kib / 1024


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
                    "logging.tensorboard=true needs the tensorboard extra: "
                    + install_hint("tensorboard")
                ) from None
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self._file = self.path.open("a")
        self.start = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # The wall time it was written, in the file only (the trackers keep their own): the
        # goodput report (`hpctrain.resilience.goodput`) places the record on the job's timeline.
        stamped = {**record, "time": time.time()}
        if self.first and record.get("kind", "train") == "train":
            stamped.update(self.first)
            self.first = {}
        self._file.write(json.dumps(stamped) + "\n")
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
            self._print(eval_line(record, self.num_epochs))
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
        trackers: "finished", "preempted" (saved, to be requeued), "interrupted" (Ctrl-C, saved)
        or "failed"."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.trackers is not None:
            self.trackers.close(status)
        self._file.close()


# Fields that count things: shown as integers even where a sum over ranks made them floats.
COUNT_WORDS = ("samples", "tokens", "targets", "records", "count", "num_")


def _fmt(name: str, value: Any) -> str:
    is_count = any(word in name for word in COUNT_WORDS) and "_per_" not in name
    if isinstance(value, float) and is_count and value.is_integer():
        return str(int(value))  # "30", not "30.0000"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def eval_line(record: dict[str, Any], num_epochs: int) -> str:
    """An evaluation record as a console line, its epoch counted from 1 as the training lines
    count it (`epoch=10/10`, where the record holds 9), counts as integers."""
    words = []
    for name, value in record.items():
        if name == "kind":
            continue
        text = epoch_text(value, num_epochs) if name == "epoch" else _fmt(name, value)
        words.append(f"{name}={text}")
    return "eval " + " ".join(words)


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
    empty = record.get("empty_steps")
    return (
        f"step {step}/{total_steps} epoch {epoch_text(record['epoch'], num_epochs)} "
        f"loss {record['loss']:.4f} lr {record['lr']:.2e} {rate} "
        f"data-wait {record['data_wait_fraction']:.1%} "
        f"(worst {record['data_wait_fraction_worst']:.1%}) "
        f"step {record['step_time_s'] * 1000:.0f} ms ETA {format_duration(eta_s)}"
        + (f" ({empty} steps without a target, not in the loss)" if empty else "")
    )
