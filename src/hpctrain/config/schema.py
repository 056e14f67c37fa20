"""The typed config tree. YAML files and `a.b=c` overrides only fill these dataclasses.

Each field may carry metadata that the loader checks before any work starts:
`choices` (allowed values), `min` and `max` (the allowed range; `max_reason` says why), `above`
(a bound the value must exceed), `key` (the YAML name when it is a
Python keyword, e.g. `checkpoint.async`), and `help` (shown in docs/config-reference.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

from hpctrain.config.fields import _f
from hpctrain.config.slurm_schema import SlurmConfig


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters on the model's linear layers (`hpctrain.models.lora`; docs/fine-tuning.md)."""

    rank: int = _f(
        0,
        "rank of the LoRA adapters on the model.lora.targets linear layers; the base weights "
        "(model.init_from) stay frozen and out of the optimizer and the checkpoints; 0: off",
        min=0,
    )
    alpha: float = _f(
        16.0, "LoRA scale numerator: a layer adds (alpha / rank) B A x to its output", above=0.0
    )
    dropout: float = _f(0.0, "dropout on the adapters' input (training only)", min=0.0, max=0.9)
    targets: list[str] = _f(
        [],
        "module-name globs of the linear layers that get adapters (a bare name matches at any "
        "depth: 'wq'); a glob that matches no linear layer is an error; empty: the model's "
        "default (the GPT and imported Llama-family models: wq, wk, wv, wo, w1, w2, w3; "
        "torchvision ViTs: mlp.0, mlp.3)",
    )
    modules_to_save: list[str] = _f(
        [],
        "module-name globs trained in full beside the adapters and saved with them (peft's "
        "modules_to_save, e.g. 'fc'); a head model.init_from re-initialises (another number of "
        "classes) is trained in full anyway",
    )
    init_from: str = _f(
        "",
        "adapters to start from: a peft adapter folder (adapter_config.json + "
        "adapter_model.safetensors) or an hpctrain LoRA run or checkpoint folder; empty: "
        "fresh adapters (B = 0: the model starts as its base)",
    )
    base_dtype: str = _f(
        "fp32",
        "dtype the frozen base weights are held in: bf16 halves their bytes (needs "
        "train.precision bf16, the compute dtype); the adapters keep fp32 master weights",
        choices=("fp32", "bf16"),
    )
    quantize_base: str = _f(
        "none",
        "QLoRA: the adapted layers' base weights in 4-bit NormalFloat (nf4, torchao's NF4Tensor; "
        "pip install -e '.[qlora]'), dequantized per layer in the forward pass",
        choices=("none", "nf4"),
    )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = _f(
        "",
        "model of a built-in task; empty: the task's default. image_classification: small_cnn "
        "(default), vit_tiny or a torchvision classifier (resnet18, resnet50, vit_b_16, ...); "
        "segmentation: unet (default) or a torchvision segmentation model (fcn_resnet50, "
        "deeplabv3_resnet50, lraspp_mobilenet_v3_large, ...); causal_lm: gpt-tiny (default), "
        "gpt-125m, gpt-350m, gpt-1b, gpt-3b or gpt-8b",
    )
    num_classes: int = _f(0, "number of classes; 0 takes it from the training index", min=0)
    image_size: int = _f(64, "side of the square crop fed to the model, in pixels", min=8)
    channels_last: bool = _f(False, "use the channels_last memory format (CNNs on GPUs)")
    init_from: str = _f(
        "",
        "weights to start a new run from (step 0, fresh optimizer; a run with checkpoints "
        "resumes instead): causal_lm: a Hugging Face folder (config.json + *.safetensors) of "
        "LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM, which also sets the shape; "
        "any task: an hpctrain run/checkpoint folder or a state dict file (.pt, .pth, "
        ".safetensors: an export, a torchvision download; a head of another size starts anew)",
    )
    init_from_ema: bool = _f(
        False, "model.init_from a run or checkpoint folder: start from its EMA weights"
    )
    lora: LoraConfig = field(default_factory=LoraConfig)
    init_from_reinit_mismatched: bool = _f(
        False,
        "model.init_from a run or weights file: re-initialise its tensors whose first dimension "
        "differs from the model's (token embeddings of another vocabulary, K/V projections of "
        "other heads) instead of refusing them; a classifier head of another number of "
        "classes starts anew without it",
    )


@dataclass(frozen=True, kw_only=True)
class AugmentConfig:
    scale_min: float = _f(
        0.5,
        "training crops: smallest fraction of the image's area a RandomResizedCrop keeps",
        min=0.01,
        max=1.0,
    )
    scale_max: float = _f(
        1.0, "training crops: largest fraction of the image's area kept", min=0.01, max=1.0
    )
    hflip: bool = _f(
        True, "random horizontal flips in training (turn off for digits, text, left/right labels)"
    )


@dataclass(frozen=True, kw_only=True)
class ClassificationConfig:
    image_field: str = _f(
        "",
        "image_classification: the sample field holding the image (jpg, img.png, left.jpg...); "
        "empty: the sample's one image field that is not a target (mask/seg/label/depth)",
    )
    multi_label: bool = _f(
        False,
        "several labels per sample: BCE-with-logits loss, evaluation mAP and F1 instead of "
        "accuracy; the target is classification.target_field",
    )
    target_field: str = _f(
        "",
        "the target field: an int field (default cls) for one label; with multi_label a json "
        "list of class ids or an npy multi-hot vector (default: the sample's one json/npy field)",
    )


@dataclass(frozen=True, kw_only=True)
class SegmentationConfig:
    image_field: str = _f(
        "",
        "segmentation: the sample field holding the image; empty: the sample's one image "
        "field that is not a target (jpg, png, img.jpg...)",
    )
    mask_field: str = _f(
        "",
        "the field holding the class-id mask (a palette or greyscale PNG, an npy array); "
        "empty: the sample's one image field named as a target (mask.png, seg.png...)",
    )
    ignore_index: int = _f(
        255, "mask value left out of the loss and the metrics (unlabelled pixels)", min=0
    )


@dataclass(frozen=True, kw_only=True)
class CausalLMConfig:
    """The GPT's shape for task causal_lm (`hpctrain.models.gpt`): each key overrides
    the preset's value (`model.name`); 0 / null keep it. These were `model.*` keys: the old
    names still load, with a warning (`config.load.MOVED_KEYS`)."""

    dim: int = _f(0, "causal_lm: model width; 0: the preset's", min=0)
    n_layers: int = _f(0, "causal_lm: transformer blocks; 0: the preset's", min=0)
    n_heads: int = _f(0, "causal_lm: attention heads; 0: the preset's", min=0)
    n_kv_heads: int = _f(
        0, "causal_lm: key/value heads (grouped-query attention); 0: the preset's", min=0
    )
    ffn_dim: int = _f(0, "causal_lm: SwiGLU hidden size; 0: the preset's", min=0)
    vocab_size: int = _f(
        0, "causal_lm: vocabulary (at least the tokenizer's); 0: the index's tokenizer's", min=0
    )
    tie_embeddings: bool | None = _f(
        None, "causal_lm: share the embedding and output matrices; null: the preset's"
    )


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """One source of a mixture (`data.train` as a list; see docs/data.md "Mixing several datasets")."""

    path: str = _f("", "the source's shards: an index.json path/URL or a shard pattern")
    weight: float = _f(1.0, "relative share of the training samples (> 0)", above=0.0)
    name: str = _f("", "names its metrics (samples_seen/<name>); empty: the index's folder name")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: str | list[SourceConfig] = _f(
        "",
        "training shards: an index.json path/URL or a shard pattern (dir/train-{000000..000009}.tar); "
        "or a mixture: a list of {path, weight, name}",
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
    tokenizer: str = _f(
        "",
        "language models: the tokenizer the token shards must have been converted with, checked "
        "against the index before any work: '' takes the index's, 'bytes' the built-in one, or "
        "the path of a tokenizer.json, sentencepiece *.model or *.tiktoken file (compared by sha256)",
    )
    samples_per_epoch: int = _f(
        0,
        "a mixture's epoch in samples (all ranks); 0: the sum of its sources' samples",
        min=0,
        max=3_000_000_000,  # hpctrain.data.mixture.MAX_SLOTS (config imports no data code)
        max_reason="the largest epoch a mixture plans",
    )
    seq_len: int = _f(
        0,
        "0: samples as stored; N > 0: token shards (an index with a tokenizer) are read as "
        "packed sequences of N+1 token ids (batch fields `tokens` and `positions`, see "
        "data.document_mask), cut every N tokens from "
        "each shard's token stream; the tail shorter than a sequence is dropped and counted",
        min=0,
    )
    document_mask: bool = _f(
        True,
        "with data.seq_len (causal_lm): a token attends only to the earlier tokens of its own "
        "document, RoPE counting from the document's start (batch field `positions`); false: "
        "plain causal attention across the documents of a sequence",
    )
    loss_mask: bool = _f(
        True,
        "with data.seq_len (causal_lm) and instruction data (token shards with a loss mask, "
        "hpctrain convert --response-field/--messages-field): the loss and the evaluation "
        "average over the masked targets only (batch field `loss_mask`); false: over every "
        "token, the masks ignored (for comparison)",
    )
    resume_changed: str = _f(
        "refuse",
        "a resume whose data.train (one source) holds other shards than the checkpoint's "
        "(re-converted or replaced in place, shards added): refuse (the rest of the epoch "
        "would read other samples by their positions), or new_epoch: the checkpoint's epoch "
        "ends there and the next one plans the new shards. A mixture's saved sources must "
        "stay as they were (new ones may follow them)",
        choices=("refuse", "new_epoch"),
    )

    def train_paths(self) -> list[tuple[str, str]]:
        """(dotted key, path) of every training source: one, or each of a mixture's."""
        if isinstance(self.train, str):
            return [("data.train", self.train)]
        return [(f"data.train[{i}].path", s.path) for i, s in enumerate(self.train)]


@dataclass(frozen=True, kw_only=True)
class LrGroupConfig:
    """One entry of `train.lr_groups` (see docs/training.md "Fine-tuning: freezing and learning-rate groups")."""

    pattern: str = _f("", "parameter-name glob (fnmatch: * also matches dots), e.g. 'head.*'")
    lr_scale: float = _f(
        1.0, "multiplier of train.lr for the parameters it matches (> 0)", above=0.0
    )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    max_steps: int = _f(0, "optimizer steps to run; 0: run train.max_epochs epochs", min=0)
    max_epochs: int = _f(0, "epochs to run when train.max_steps is 0", min=0)
    strategy: str = _f(
        "ddp",
        "data parallelism over ranks; a single process is never wrapped. hsdp: FSDP2 shards "
        "inside groups of train.shard_degree ranks (a node) and replicates across them; "
        "fsdp is FSDP2 (fully_shard), also spelled fsdp2",
        choices=("none", "ddp", "fsdp", "hsdp"),
        aliases={"fsdp2": "fsdp"},
    )
    tp_degree: int = _f(
        1,
        "tensor parallelism of the causal_lm GPT over this many ranks of a node (1: off), "
        "with train.strategy=fsdp or hsdp on the remaining ranks",
        min=1,
    )
    shard_degree: int = _f(
        0,
        "train.strategy=hsdp: data-parallel ranks per shard group; 0: those of one node "
        "(SLURM's tasks per node, or LOCAL_WORLD_SIZE, over train.tp_degree)",
        min=0,
    )
    precision: str = _f(
        "auto",
        "auto: bf16 on GPUs that support it, fp16 (with a gradient scaler) on GPUs with neither bf16 nor TF32 (V100, T4), fp32 on CPUs",
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
    deterministic: bool = _f(
        False,
        "deterministic algorithms (bitwise-repeatable runs on CPU); on GPUs also a fixed cuBLAS workspace, and ops without a deterministic CUDA kernel warn instead of failing",
    )
    overfit_batches: int = _f(
        0, "train on the first N batches only (a sanity check before a long job)", min=0
    )
    debug: bool = _f(
        False,
        "debug mode: one process, in-process loading, anomaly detection, errors raised at once",
    )
    heartbeat_timeout_s: float = _f(
        30.0,
        "under a job script: the least seconds a rank may go without progress (a step, an evaluation, a save) before its watcher writes its stacks, kills it and the attempt restarts as a hang; learnt above it from the run (train.heartbeat_factor x the slowest recent step); below train.collective_timeout_s (docs/clusters.md, timeouts); 0: not watched",
        min=0.0,
    )
    heartbeat_factor: float = _f(
        5.0,
        "the allowance of a step, an evaluation or a save: this many times the slowest recent one (at least train.heartbeat_timeout_s)",
        min=1.0,
    )
    collective_timeout_s: float = _f(
        600.0,
        "seconds any collective (training, checkpoint, flags) waits for the other ranks before the job fails; a hung rank then ends the job instead of holding the allocation",
        min=1.0,
    )
    step_timeout_s: float = _f(
        0.0,
        "seconds a training step may take before the rank writes the Python stacks of its threads to RUN_DIR/hangs/ and ends the job (a hang outside collectives: a stuck read, a deadlock); 0 disables",
        min=0.0,
    )
    first_step_timeout_s: float = _f(
        1800.0,
        "with train.step_timeout_s: the allowance of the first step of each process (at least train.step_timeout_s), which compiles, autotunes and starts the loader and NCCL; 0: that step is not timed",
        min=0.0,
    )
    early_stop_patience: int = _f(
        0,
        "stop after N evaluations in a row without a better checkpoint.monitor; 0 disables",
        min=0,
    )
    ema_decay: float = _f(
        0.0,
        "keep an fp32 exponential moving average of the weights (sharded like the model), "
        "updated after every optimizer step with this decay (e.g. 0.999) and checkpointed; "
        "0 disables",
        min=0.0,
    )
    ema_eval: bool = _f(
        False, "evaluate with the EMA weights (train.ema_decay) instead of the trained ones"
    )
    freeze: list[str] = _f(
        [],
        "parameter-name globs kept frozen (no gradient, no optimizer state), e.g. "
        "['tok_embeddings.*', 'blocks.0.*']; a glob that matches no parameter is an error",
    )
    lr_groups: list[LrGroupConfig] = _f(
        [],
        "learning-rate multipliers by parameter-name glob: a list of {pattern, lr_scale}; the "
        "first matching pattern wins, the other parameters train at train.lr",
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str = _f(
        "",
        "where checkpoints go: a local path (a relative one is under RUN_DIR) or an fsspec URL; "
        "empty: RUN_DIR/checkpoints",
    )
    every_steps: int = _f(0, "save every N optimizer steps; 0 disables", min=0)
    every_minutes: float | Literal["auto"] = _f(
        0.0,
        "save every N minutes of training; 0 disables; auto: the Young/Daly interval "
        "sqrt(2 x blocking save time x mean time between failures), from the measured save "
        "time and the run's failures (the cluster profile's mtbf_node_hours until it has its "
        "own), re-evaluated after each save (docs/checkpoints.md)",
        min=0.0,
    )
    final: bool = _f(
        True,
        "save when training ends; false for runs whose weights nobody keeps (benchmarks: a "
        "final save of a large model fills a small disk); a preemption still saves",
    )
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
    save_timeout_s: float = _f(
        0.0,
        "under a job script: seconds a save may take before its rank's watcher ends it as hung; 0: learnt (train.heartbeat_factor x the slowest save measured, the run's last one before this process saved; train.first_step_timeout_s before any)",
        min=0.0,
    )
    monitor: str = _f(
        "",
        "evaluation metric that ranks checkpoints (a key of the eval record: val_accuracy, "
        "val_loss, ...); empty: none",
    )
    mode: str = _f(
        "max", "whether a higher or a lower checkpoint.monitor is better", choices=("max", "min")
    )
    keep_best: int = _f(
        0,
        "also keep the K best checkpoints by checkpoint.monitor (a save follows every "
        "evaluation that enters the K best) and name the best in a `best` pointer; 0 disables",
        min=0,
    )


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    generate: bool = _f(
        False,
        "every evaluation also answers the validation prompts (prompt/response or chat data: "
        "the last target run of each document) greedily and scores them: val_exact_match, "
        "val_token_f1 (causal_lm)",
    )
    max_new_tokens: int = _f(
        64, "eval.generate: tokens an answer may have at most (it stops at the end of turn)", min=1
    )
    generate_samples: int = _f(
        0, "eval.generate: prompts answered per evaluation, the first N of data.val; 0: all", min=0
    )
    generate_batch_size: int = _f(
        0, "eval.generate: prompts decoded together on each rank; 0: data.batch_size", min=0
    )
    normalize: list[str] = _f(
        ["whitespace", "case"],
        "eval.generate: how answers are normalised before they are compared",
        choices=("whitespace", "case", "punctuation", "articles"),
    )
    lora_base: str = _f(
        "run",
        "a LoRA run's adapters, for `hpctrain eval` and `predict`, are merged into its base as "
        "the run held it and evaluated with it (run: QLoRA's NF4 copy, a bf16 "
        "model.lora.base_dtype) or into the base's own full-precision weights (full)",
        choices=("run", "full"),
    )


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    tensorboard: bool = _f(False, "write TensorBoard event files (needs the tensorboard extra)")
    progress: str = _f(
        "auto",
        "progress bar in a terminal, plain lines elsewhere",
        choices=("auto", "bar", "lines"),
    )
    wandb: str = _f(
        "off",
        "Weights & Biases: off, offline (files under RUN_DIR/wandb, uploaded later by "
        "`hpctrain sync RUN_DIR`) or online (needs the wandb extra)",
        choices=("off", "offline", "online"),
    )
    mlflow: str = _f(
        "off",
        "MLflow tracking URI: off, local (a SQLite store in RUN_DIR/mlflow), or any URI MLflow "
        "takes (sqlite:///..., http://server:5000) (needs the mlflow extra)",
    )
    project: str = _f("hpctrain", "W&B project and MLflow experiment the run is tracked under")
    run_name: str = _f("", "name of the tracked run; empty: the run folder's name")


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    steps: str = _f(
        "",
        "record a torch.profiler trace of optimizer steps START-END (e.g. 10-12) into "
        "RUN_DIR/profile/; empty: no profiling",
    )
    ranks: list[int] = _f([0], "ranks that record a trace; empty: every rank")
    oom_snapshot: bool = _f(
        True,
        "on a CUDA out-of-memory error in a training step, write the allocator's memory "
        "snapshot to RUN_DIR/profile/oom-rank-<r>-step-<N>.pickle (pytorch.org/memory_viz) "
        "before failing",
    )
    memory_history: int = _f(
        0,
        "CUDA: record the last N allocations and frees with their Python stack traces "
        "(torch.cuda.memory._record_memory_history), so the OOM snapshot shows what "
        "allocated each block; costs time per allocation; 0 disables",
        min=0,
    )


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
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    classification: ClassificationConfig = field(default_factory=ClassificationConfig)
    segmentation: SegmentationConfig = field(default_factory=SegmentationConfig)
    causal_lm: CausalLMConfig = field(default_factory=CausalLMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def checkpoint_root(self) -> str:
        """Where this run's checkpoints are: see `checkpoint_root`."""
        return checkpoint_root(self.checkpoint.dir, self.run_dir)


def checkpoint_root(checkpoint_dir: str, run_dir: str) -> str:
    """`checkpoint.dir` with a relative path taken under `run_dir`; empty: RUN_DIR/checkpoints.

    Relative to the run folder, not to the current directory: `eval` or `export` from
    another directory, or a requeued job started elsewhere, find the same checkpoints.
    URLs, absolute paths and paths the node expands (`$SCRATCH/...`, `~/...`) are kept.
    """
    if not checkpoint_dir:
        return str(PurePosixPath(run_dir) / "checkpoints")
    if "://" in checkpoint_dir or checkpoint_dir.startswith(("/", "$", "~")):
        return checkpoint_dir
    return str(PurePosixPath(run_dir) / checkpoint_dir)
