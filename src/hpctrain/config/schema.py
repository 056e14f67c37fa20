"""The typed config tree. YAML files and `a.b=c` overrides only fill these dataclasses.

Each field may carry metadata that the loader checks before any work starts:
`choices` (allowed values), `min` and `max` (the allowed range; `max_reason` says why), `key` (the YAML name when it is a
Python keyword, e.g. `checkpoint.async`), and `help` (shown in the README's reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _f(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with a default, a help line and optional checks."""
    if isinstance(default, (list, dict)):
        factory = default.copy
        return field(default_factory=factory, metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = _f(
        "small_cnn",
        "model for the built-in image_classification task: small_cnn, vit_tiny or a torchvision model name (resnet18, resnet50, vit_b_16, ...)",
    )
    num_classes: int = _f(0, "number of classes; 0 takes it from the training index", min=0)
    image_size: int = _f(64, "side of the square crop fed to the model, in pixels", min=8)
    channels_last: bool = _f(False, "use the channels_last memory format (CNNs on GPUs)")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: str = _f(
        "",
        "training shards: an index.json path/URL or a shard pattern (dir/train-{000000..000009}.tar)",
    )
    val: str = _f("", "validation shards, same forms as data.train; empty disables evaluation")
    batch_size: int = _f(64, "samples per batch on each rank", min=1)
    workers_per_rank: int = _f(
        2, "loader worker processes per rank (0: load in the training process)", min=0
    )
    shuffle_buffer: int = _f(
        1000, "samples held in each worker's shuffle buffer (0 or 1: no sample shuffle)", min=0
    )
    remainder: str = _f(
        "drop",
        "training samples that do not fill equal batches on every rank",
        choices=("drop", "pad"),
    )
    on_error: str = _f(
        "fail",
        "a shard that cannot be read after retries: fail the run, or skip and count",
        choices=("fail", "skip"),
    )
    max_retries: int = _f(
        5, "retries of a failed shard read (connection reset, 5xx) before on_error applies", min=0
    )
    prefetch_factor: int = _f(4, "batches prefetched by each worker", min=1)
    pin_memory: bool = _f(True, "pin host memory of batches (GPUs only)")
    persistent_workers: bool = _f(True, "keep loader workers alive across epochs")
    sample_log: bool = _f(
        False, "append the keys of every trained sample to RUN_DIR/samples/rank-<r>.jsonl"
    )
    allow_pipe: bool = _f(
        False,
        "run the shell command of a pipe:COMMAND shard pattern given in data.train/data.val "
        "(never one named by an index)",
    )
    timeout_s: float = _f(
        600.0,
        "seconds the training process waits for a loader worker's next batch before failing "
        "the step, naming the worker and the shard it reads; 0: wait for ever",
        min=0.0,
    )
    max_image_pixels: int = _f(
        89_478_485,
        "largest image (width x height) a loader decodes; a larger one (a decompression bomb) "
        "is a sample error handled by data.on_error; 0: no limit. Default: PIL's",
        min=0,
    )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    max_steps: int = _f(0, "optimizer steps to run; 0: run train.max_epochs epochs", min=0)
    max_epochs: int = _f(0, "epochs to run when train.max_steps is 0", min=0)
    strategy: str = _f(
        "ddp",
        "data parallelism over ranks; a single process is never wrapped",
        choices=("none", "ddp", "fsdp"),
    )
    precision: str = _f(
        "auto",
        "auto: bf16 on GPUs that support it, fp32 elsewhere",
        choices=("auto", "fp32", "bf16", "fp16"),
    )
    optimizer: str = _f("adamw", "optimizer", choices=("adamw", "sgd"))
    lr: float = _f(1e-3, "peak learning rate", min=0.0)
    weight_decay: float = _f(0.05, "weight decay (not applied to norms and biases)", min=0.0)
    momentum: float = _f(0.9, "SGD momentum", min=0.0)
    schedule: str = _f(
        "cosine", "learning-rate schedule after warmup", choices=("cosine", "constant")
    )
    warmup_steps: int = _f(0, "linear warmup steps", min=0)
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step", min=1)
    grad_clip: float = _f(0.0, "clip gradients to this global norm; 0 disables", min=0.0)
    log_every: int = _f(10, "steps between metric lines", min=1)
    eval_every: int = _f(0, "steps between evaluations over data.val; 0: only at the end", min=0)
    compile: bool = _f(False, "torch.compile the model")
    activation_checkpointing: bool = _f(
        False, "recompute activations of each block in the backward pass"
    )
    reshard_after_forward: bool = _f(True, "FSDP2: free gathered parameters after forward")
    sync_batchnorm: bool = _f(
        False,
        "ddp/fsdp on GPUs: BatchNorm statistics over all ranks (SyncBatchNorm), for small per-GPU batches",
    )
    deterministic: bool = _f(False, "deterministic algorithms (bitwise-repeatable runs on CPU)")
    overfit_batches: int = _f(
        0, "train on the first N batches only (a sanity check before a long job)", min=0
    )
    debug: bool = _f(
        False,
        "debug mode: one process, in-process loading, anomaly detection, errors raised at once",
    )
    collective_timeout_s: float = _f(
        600.0,
        "seconds any collective (training, checkpoint, flags) waits for the other ranks before the job fails; a hung rank then ends the job instead of holding the allocation",
        min=1.0,
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str = _f(
        "", "where checkpoints go: a local path or an fsspec URL; empty: RUN_DIR/checkpoints"
    )
    every_steps: int = _f(0, "save every N optimizer steps; 0 disables", min=0)
    every_minutes: float = _f(0.0, "save every N minutes of training; 0 disables", min=0.0)
    keep_last: int = _f(3, "committed checkpoints kept, newest first", min=1)
    keep_every: int = _f(
        0, "also keep every checkpoint whose step is a multiple of N; 0 disables", min=0
    )
    async_save: bool = _f(False, "save in the background with dcp.async_save", key="async")
    verify: str = _f(
        "crc32c",
        "checkpoint verification: crc32c (per item, computed while saving, checked while "
        "loading), sha256 (also hashes every file on rank 0: slower) or size (sizes only)",
        choices=("crc32c", "sha256", "size"),
    )
    resume: str = _f("latest", "latest, none, or a checkpoint path to resume from")
    signals: list[str] = _f(["USR2", "TERM"], "signals that request checkpoint-and-requeue")
    deadline_margin_s: float = _f(
        180.0, "save this long before SLURM_JOB_END_TIME; 0 disables", min=0.0
    )


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    tensorboard: bool = _f(False, "write TensorBoard event files (needs the tensorboard extra)")
    progress: str = _f(
        "auto",
        "progress bar in a terminal, plain lines elsewhere",
        choices=("auto", "bar", "lines"),
    )


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    profile: str = _f("generic", "cluster profile from configs/clusters/")
    account: str = _f("", "account, e.g. abc@a100 on Jean Zay")
    partition: str = _f("", "partition; empty takes the profile's")
    constraint: str = _f("", "node constraint (-C); empty takes the profile's")
    qos: str = _f("", "quality of service; empty takes the profile's default")
    nodes: int = _f(1, "nodes", min=1)
    gpus_per_node: int = _f(0, "tasks (GPUs) per node; 0 takes the profile's", min=0)
    cpus_per_task: int = _f(0, "CPUs per task; 0 takes the profile's", min=0)
    time: str = _f("", "wall time (HH:MM:SS or minutes); empty takes the profile's default")
    max_requeues: int = _f(3, "automatic requeues after a time limit or preemption", min=0)
    signal_margin_s: int = _f(
        120,
        "seconds before the time limit when SLURM sends the signal",
        min=1,
        max=65535,
        max_reason="sbatch --signal takes at most 65535 s",
    )
    setup: list[str] = _f([], "shell lines run before training (module load ...)")
    folder: str = _f("", "where job scripts and logs go; empty: RUN_DIR/slurm")


@dataclass(frozen=True, kw_only=True)
class Config:
    run_dir: str = _f("runs/default", "run folder: resolved config, metrics, checkpoints, logs")
    # below 2**63 like every integer key (config.load.INT_RANGE): torch and the data plan
    # take signed 64-bit seeds; numpy's global seed takes seed % 2**32
    seed: int = _f(0, "seeds model init, data order and augmentations", min=0)
    task: str = _f(
        "image_classification", "built-in task name or module.path:ClassName of your own"
    )
    task_options: dict[str, Any] = _f({}, "free-form options handed to a custom task")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
