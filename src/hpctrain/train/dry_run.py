"""A dry run: the Trainer built as for a real run, short of the GPU, its weights and its files.

A benchmark's (or the GPU script's) "config valid" must mean "this run will start": loading a
config checks its keys and values, but not what the Trainer checks when it is built (the
cross-key rules of `Trainer.check_config`, the plan for the GPU and the world size, the index,
the task, the model, the loaders, the step count). `check_startup` runs those same methods,
on the CPU in one process:

- the device facts are given (a GPU's when none is here: `pretend_gpu`), and the world size
  is the run's, so `plan_training` decides and refuses as it will on the nodes;
- the model is built on the meta device (no memory, no initialisation) and not wrapped: DDP
  and FSDP2 need the run's process group; the tensor-parallel plan is checked for;
- the loaders are built for the run's data-parallel rank 0 (no worker starts), which gives
  the steps per epoch the real run will have;
- no run folder, lock or checkpoint is touched.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

import hpctrain.models.init_from as init_from
from hpctrain.checkpoint.interval import DEFAULT_FAILURE_RATE, FailureRate
from hpctrain.config import Config
from hpctrain.distributed import DistEnv
from hpctrain.parallel.parallelize import check_tensor_parallel
from hpctrain.parallel.precision import DeviceFacts
from hpctrain.train.optim import build_optimizer, freeze_parameters
from hpctrain.train.preemption import PreemptionFlag
from hpctrain.train.trainer import Trainer


@dataclass(frozen=True)
class StartupReport:
    """What the dry run found the run will be."""

    strategy: str
    mesh: str
    precision: str
    num_parameters: int
    steps_per_epoch: int
    total_steps: int

    def describe(self) -> str:
        return (
            f"{self.strategy} ({self.mesh}), {self.precision}, "
            f"{self.num_parameters / 1e6:.1f} M parameters, {self.total_steps} steps "
            f"({self.steps_per_epoch} per epoch)"
        )


def pretend_gpu(name: str = "dry run (a pretend A100)", capability: int = 80) -> DeviceFacts:
    """The facts of a GPU that is not here: compute capability `capability` (80: an A100),
    the kernels of this torch build, and what `torch.compile` would lack (triton)."""
    archs = [
        int(arch.removeprefix("sm_"))
        for arch in torch.cuda.get_arch_list()
        if arch.startswith("sm_") and arch.removeprefix("sm_").isdigit()
    ]
    blocker = ""
    if importlib.util.find_spec("triton") is None:
        blocker = "inductor needs triton for GPUs (pip install triton)"
    return DeviceFacts(
        type="cuda",
        name=name,
        capability=divmod(capability, 10),
        min_capability=min(archs, default=0),
        compile_blocker=blocker,
    )


def check_startup(
    cfg: Config, facts: DeviceFacts, world_size: int = 1, local_world_size: int = 0
) -> StartupReport:
    """Build `cfg`'s run as the Trainer does, on the CPU, for `world_size` ranks on `facts`.

    Raises what the Trainer would raise when built (`ConfigError` and the like).
    """
    env = DistEnv(
        rank=0,
        local_rank=0,
        world_size=world_size,
        local_world_size=local_world_size or world_size,
        master_addr="localhost",
        master_port=0,
        source="single",
    )
    check = _DryRunTrainer(cfg, env, facts)
    return StartupReport(
        strategy=check.plan.strategy,
        mesh=check.plan.describe_mesh(),
        precision=check.precision.name,
        num_parameters=sum(p.numel() for p in check.model.parameters()),
        steps_per_epoch=check.steps_per_epoch,
        total_steps=check.total_steps,
    )


class _DryRunTrainer(Trainer):
    """The Trainer's own checks and builders, with the parts that need the GPU, the process
    group or the run folder left out (see the module doc)."""

    def __init__(self, cfg: Config, env: DistEnv, facts: DeviceFacts) -> None:
        self.facts = facts
        super().__init__(cfg, env, torch.device("cpu"))

    def device_facts(self) -> DeviceFacts:
        return self.facts

    def build_model(self) -> None:
        init_from.check(self.cfg, self.task)
        with torch.device("meta"):
            model = self.task.build_model()
        freeze_parameters(model, self.cfg.train.freeze)
        if self.plan.tp > 1:
            check_tensor_parallel(model, self.plan)
        self.model = model
        self.optimizer = build_optimizer(model, self.cfg.train)

    def build_run_state(self, failure_rate: FailureRate = DEFAULT_FAILURE_RATE) -> None:
        PreemptionFlag(self.cfg.checkpoint.signals, self.cfg.checkpoint.deadline_margin_s)
