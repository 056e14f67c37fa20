"""GPU utilisation and memory for each train record of `metrics.jsonl` (NVML, CUDA only).

At every logged step each rank reads NVML through torch (`torch.cuda.utilization`,
`torch.cuda.device_memory_used`; both need the `nvidia-ml-py` package, hpctrain's `gpu`
extra) and the ranks' readings are gathered over the CPU flag group in one collective:

- `gpu_util_pct`: mean over ranks of the percent of NVML's last sample period (1/6 to 1 s)
  in which a kernel ran; `gpu_util_pct_worst`: the least busy rank's (a straggler or a
  starved loader shows there first);
- `gpu_memory_used_mb`: mean over ranks of the device memory in use as `nvidia-smi` shows it
  (every process on the GPU, plus the CUDA context, unlike `peak_memory_mb` which counts
  tensors only); `gpu_memory_used_mb_worst`: the fullest rank's (the one that would OOM);
- `gpu_memory_total_mb`: the largest device's memory.

Without NVML (no package, no driver library, or an error) the fields are left out, with one
logged line saying why. On CPUs they are not written at all.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.errors import install_hint

log = logging.getLogger("hpctrain")

MB = 2**20


def summarize_rows(rows: torch.Tensor) -> dict[str, float]:
    """Per-rank rows of (utilisation %, memory used MB, memory total MB) -> the record fields."""
    util, used, total = rows[:, 0], rows[:, 1], rows[:, 2]
    return {
        "gpu_util_pct": float(util.mean()),
        "gpu_util_pct_worst": float(util.min()),
        "gpu_memory_used_mb": float(used.mean()),
        "gpu_memory_used_mb_worst": float(used.max()),
        "gpu_memory_total_mb": float(total.max()),
    }


class GpuCounters:
    """Reads NVML at log steps; `read()` is collective over `group` when ranks are several.

    Args:
        device: the rank's device; counters are read only for a CUDA device.
        group: a CPU (gloo) process group of all ranks, or None for one process.
    """

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device, self.group = device, group
        self.available = False
        if device.type != "cuda":
            return
        reason = ""
        try:
            self.read_local()
            self.available = True
        except Exception as exc:  # ModuleNotFoundError (no pynvml), pynvml.NVMLError, ...
            reason = f"{type(exc).__name__}: {exc}"
        if group is not None:
            # Every rank must agree, or some would enter the gather of `read` alone.
            flag = torch.tensor([float(self.available)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            if not flag.item() and self.available:
                self.available, reason = False, "NVML is not available on another rank"
        if not self.available:
            log.info(
                "GPU utilisation and memory are not logged: NVML is not available (%s); "
                "%s (nvidia-ml-py)",
                reason,
                install_hint("gpu"),
            )

    def read_local(self) -> tuple[float, float, float]:
        """This rank's (utilisation %, memory used MB, memory total MB)."""
        util = float(torch.cuda.utilization(self.device))
        used = torch.cuda.device_memory_used(self.device) / MB
        total = torch.cuda.get_device_properties(self.device).total_memory / MB
        return util, used, total

    def read(self) -> dict[str, float]:
        """The record fields (see the module docstring), or {} without NVML."""
        if not self.available:
            return {}
        try:
            row = torch.tensor([self.read_local()], dtype=torch.float64)
        except Exception as exc:  # an NVML error mid-run: this record goes without counters
            log.warning("GPU counters not read at this step: %s: %s", type(exc).__name__, exc)
            row = torch.full((1, 3), float("nan"), dtype=torch.float64)
        if self.group is not None:  # every rank joins, whether its own reading worked or not
            rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(rows, row, group=self.group)
            row = torch.cat(rows)
        return {} if row.isnan().any() else summarize_rows(row)
