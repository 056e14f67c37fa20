"""The built-in `causal_lm` task: next-token prediction with a GPT on token shards.

It trains on packed sequences (`data.seq_len: N`): the loader cuts each token shard's stream
into sequences of N+1 ids and hands batches `{"tokens": int64 [B, N+1], "positions": int64
[B, N+1], "valid": bool [B], "key": [...]}`; the model reads `tokens[:, :-1]` and is scored on
`tokens[:, 1:]`. With `data.document_mask` (the default) it also reads `positions[:, :-1]`
(each token's position in its document, `hpctrain.data.sequences`): a token attends only to
its own document, so a document's predictions do not depend on what was packed before it.
Training, evaluation and `predict` follow the same rule; `data.document_mask: false` drops
the positions in the transform (plain causal attention across documents). `generate` feeds
one prompt, one document, without positions: the same function (positions = arange). The
vocabulary and end-of-document id come from the training index's tokenizer (written by
`hpctrain convert --tokenizer`); the validation index must name the same tokenizer, and so
must `data.tokenizer` when set.

Loss: cross-entropy over every target position of the valid sequences (fillers after lost
samples and evaluation padding, `valid=False`, count for nothing). All sequences have N
targets, so the per-token mean equals the mean over valid sequences of their own means.

Evaluation: `loss` (mean nats per target token over all of `data.val`), `perplexity`
(exp(loss)) and, for the `bytes` tokenizer, `bits_per_byte` = loss / ln 2: every target token
counts, end-of-document ids included (one per document, standing for its separator), so it is
the entropy in bits of the byte stream the shards hold, documents and their ends.
"""

from __future__ import annotations

import logging
import math
from contextvars import ContextVar
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.checkpoint import CheckpointError
from hpctrain.config import Config, ConfigError
from hpctrain.data.decode import SampleError
from hpctrain.data.documents import iter_documents
from hpctrain.data.index import ShardIndex
from hpctrain.data.locate import open_index
from hpctrain.data.mixture_index import describe as describe_train
from hpctrain.data.tokenizer import (
    BYTES,
    Tokenizer,
    check_recorded_tokenizer,
    check_tokenizer,
    file_sha256,
    load_tokenizer,
    recorded_info,
    same_tokenizer,
)
from hpctrain.models import hf
from hpctrain.models.gpt import GPT, PRESETS, GPTConfig, flops_per_token, gpt_config
from hpctrain.tasks import answers
from hpctrain.tasks.lm_shape import (
    check_preset,
    lm_model_card,
    warn_if_changed,
)
from hpctrain.tasks.task import Sample, masked_mean

log = logging.getLogger(__name__)

# The manifest of the checkpoint whose model a `CausalLM` is being built for (see
# `CausalLM.from_checkpoint`); None: a new model.
BUILDING_FROM: ContextVar[dict[str, Any] | None] = ContextVar("BUILDING_FROM", default=None)


def index_tokenizer(index: ShardIndex, spec: str, key: str, configured: str) -> dict[str, Any]:
    """The tokenizer of the index `spec` (config key `key`), checked against `data.tokenizer`
    (`configured`; "" takes the index's).

    Raises:
        ConfigError: not a token index, or another tokenizer than the configured one (the
            message names both and the index).
    """
    where = f"{key}={spec} ({index.base_url or 'a shard pattern'})"
    return check_tokenizer(index, configured, where)


def load_index_tokenizer(info: dict[str, Any], configured: str = "") -> Tokenizer:
    """The tokenizer an index's `info` describes: `configured` ("bytes" or a tokenizer
    file), else the spec it was converted with (its name), checked by sha256 when a file.

    Raises:
        ConfigError: the file's sha256 is not the one the index records.
        TokenizerError: the file cannot be loaded (missing, or the tokenizers library).
    """
    spec = configured or str(info["name"])
    tokenizer = load_tokenizer(spec)
    expected = str(info.get("sha256") or "")
    if expected and tokenizer.sha256 != expected:
        raise ConfigError(
            f"tokenizer {spec}: sha256 {tokenizer.sha256[:12]} is not that of the file the "
            f"shards were converted with ({expected[:12]})"
        )
    # The index's EOD (a convert --eod-token other than the default) is the one its text has.
    tokenizer.eod_id = int(info.get("eod_id", tokenizer.eod_id))
    return tokenizer


class SequenceTransform:
    """Check a packed sequence and hand it on as int64 `{"key", "tokens": [seq_len + 1]}`,
    with its `positions` [seq_len + 1] when `document_mask` (else they are dropped here, in
    the loader's workers, and never travel), and with `loss_mask` (bool [seq_len + 1]: the
    targets of instruction data) when `loss_mask`: the sample's, or every token a target for
    a sample without one (a mixture's plain text), so that every batch has the field.

    Ids need no check here: the loader refuses ids outside the index tokenizer's vocabulary
    (`hpctrain.data.sequences`), and the model's is at least as large.
    """

    def __init__(self, seq_len: int, document_mask: bool = True, loss_mask: bool = False) -> None:
        self.length = seq_len + 1
        self.document_mask = document_mask
        self.loss_mask = loss_mask

    def __call__(self, sample: Sample) -> Sample:
        key = sample["key"]
        tokens = sample.get("tokens")
        if not isinstance(tokens, torch.Tensor):
            fields = ", ".join(sorted(k for k in sample if k != "key"))
            raise SampleError(f"sample {key!r} has no packed `tokens` sequence (fields: {fields})")
        if tokens.shape != (self.length,):
            raise SampleError(
                f"sample {key!r}: tokens of shape {list(tokens.shape)}, expected [{self.length}] "
                "(data.seq_len + 1)"
            )
        out = {"key": key, "tokens": tokens.long()}
        if self.document_mask:
            positions = sample.get("positions")
            if not isinstance(positions, torch.Tensor) or positions.shape != tokens.shape:
                raise SampleError(
                    f"sample {key!r} has no `positions` beside its tokens (data.document_mask "
                    "needs the packed sequences of data.seq_len)"
                )
            out["positions"] = positions.long()
        if self.loss_mask:
            mask = sample.get("loss_mask")
            if mask is None:
                mask = torch.ones(self.length, dtype=torch.bool)
            elif not isinstance(mask, torch.Tensor) or mask.shape != tokens.shape:
                raise SampleError(f"sample {key!r}: a loss_mask not of its tokens' shape")
            out["loss_mask"] = mask.bool()
        return out


class CausalLM:
    """A GPT (`model.name`: a preset of `hpctrain.models.gpt`) trained on next tokens."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        self.cfg = cfg
        # The manifest of the checkpoint the model comes from (`from_checkpoint`), or None.
        self.checkpoint = BUILDING_FROM.get()
        self.seq_len = cfg.data.seq_len
        if self.seq_len <= 0:
            raise ConfigError(
                "data.seq_len=0: task causal_lm trains on packed sequences; set data.seq_len "
                "(tokens per training sequence, e.g. 512)"
            )
        configured = cfg.data.tokenizer
        train = describe_train(cfg.data.train)  # one path, or a mixture's (same tokenizer)
        self.tokenizer = index_tokenizer(index, train, "data.train", configured)
        if cfg.data.val:
            val_index = open_index(cfg.data.val, allow_pipe=cfg.data.allow_pipe)
            val_tokenizer = index_tokenizer(val_index, cfg.data.val, "data.val", configured)
            if not same_tokenizer(val_tokenizer, self.tokenizer):
                raise ConfigError(
                    f"data.val={cfg.data.val}: its tokenizer {describe(val_tokenizer)} differs "
                    f"from data.train's ({train}) {describe(self.tokenizer)}"
                )
        # Instruction data: a loss mask in the training shards (or the validation shards)
        # makes every batch carry one (see SequenceTransform).
        indexes = [index, val_index] if cfg.data.val else [index]
        self.loss_mask = cfg.data.loss_mask and any(i.holds("num_targets") for i in indexes)
        vocab = int(self.tokenizer["vocab_size"])
        self.hf_source: dict[str, Any] = {}  # the recorded config.json entries of an import
        self.model_cfg: GPTConfig = self.model_shape(vocab, train)
        # Read by the trainer's metrics (hpctrain.models.flops): tokens/s and MFU.
        self.tokens_per_sample = self.seq_len
        self._text_tokenizer: Tokenizer | None = None  # loaded when `predict` first decodes
        # eval.generate: the validation prompts answered at every evaluation (read once)
        self.generates_answers = cfg.eval.generate
        if self.generates_answers and not any(
            s.num_targets is not None for s in (val_index.shards if cfg.data.val else ())
        ):
            raise ConfigError(
                f"eval.generate=true: data.val={cfg.data.val!r} holds no prompts to answer "
                "(give prompt/response or chat data: convert --prompt-field/--response-field or "
                "--messages-field)"
            )
        monitored = cfg.checkpoint.monitor.removeprefix("val_")
        if monitored in answers.METRICS and not self.generates_answers:
            raise ConfigError(
                f"checkpoint.monitor={cfg.checkpoint.monitor}: needs eval.generate=true (the "
                "evaluations then answer the validation prompts)"
            )
        self._examples: list[answers.Example] | None = None

    @classmethod
    def from_checkpoint(cls, cfg: Config, index: ShardIndex, manifest: dict[str, Any]) -> CausalLM:
        """The task of the model checkpoint `manifest` records (a resume, eval, predict):
        its shape when the run started from `model.init_from` (which is then never read),
        its tokenizer checked against data.train's. The manifest reaches the constructor
        through `BUILDING_FROM`, so that a subclass's own `__init__(cfg, index)` (a user's
        task built on this one) works unchanged."""
        token = BUILDING_FROM.set(manifest)
        try:
            return cls(cfg, index)
        finally:
            BUILDING_FROM.reset(token)

    def model_shape(self, vocab: int, train: str) -> GPTConfig:
        """The GPT's shape: the checkpoint's record for a run that started from
        `model.init_from`, else the folder's or source run's, else the preset and the
        `causal_lm.*` keys."""
        cfg, init_from = self.cfg, self.cfg.model.init_from
        metadata = (self.checkpoint or {}).get("metadata") or {}
        if self.checkpoint is not None and isinstance(metadata.get("tokenizer"), dict):
            check_recorded_tokenizer(
                metadata["tokenizer"],
                self.tokenizer,
                f"the checkpoint of step {self.checkpoint.get('step')}",
                f"data.train={train}",
            )
        if init_from and isinstance(metadata.get("gpt"), dict):
            return self.recorded_shape(metadata, vocab, train)
        if init_from and self.checkpoint is not None:
            log.info(
                "the checkpoint of step %s records no model shape (an older hpctrain saved "
                "it): the shape is read from %s=%s again",
                self.checkpoint.get("step"),
                hf.KEY,
                init_from,
            )
        if init_from and hf.is_hf_folder(init_from):
            return self.hf_model_config(vocab, train)
        recorded = self.warm_start_shape() if init_from else None
        if recorded is not None:
            hf.check_against_model_keys(
                recorded, cfg.causal_lm, init_from, "the source run's config"
            )
            check_preset(self.cfg.model.name, recorded, f"{hf.KEY}={init_from} (its checkpoint)")
            self.check_vocab(recorded.vocab_size, vocab, train, f"{hf.KEY}={init_from}")
            return recorded
        m = cfg.causal_lm
        if m.vocab_size and m.vocab_size < vocab:
            raise ConfigError(
                f"causal_lm.vocab_size={m.vocab_size}: smaller than the vocabulary of the "
                f"tokenizer {self.tokenizer['name']!r} of {train} ({vocab})"
            )
        return gpt_config(
            cfg.model.name,
            m.vocab_size or vocab,
            dim=m.dim,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads,
            ffn_dim=m.ffn_dim,
            **({} if m.tie_embeddings is None else {"tie_embeddings": m.tie_embeddings}),
        )

    def recorded_shape(self, metadata: dict[str, Any], vocab: int, train: str) -> GPTConfig:
        """The shape (and imported config.json entries) the checkpoint records, checked like
        the source's; a folder that has changed since is only warned about."""
        assert self.checkpoint is not None
        where = f"the checkpoint of step {self.checkpoint.get('step')}"
        try:
            shape = GPTConfig(**metadata["gpt"])
        except (TypeError, ConfigError) as exc:
            raise CheckpointError(f"{where}: its recorded GPT shape is unusable: {exc}") from None
        self.hf_source = dict(metadata.get("hf_config") or {})
        hf.check_against_model_keys(shape, self.cfg.causal_lm, self.cfg.model.init_from, where)
        check_preset(self.cfg.model.name, shape, where)
        self.check_vocab(shape.vocab_size, vocab, train, where)
        hf.check_window(self.hf_source, self.seq_len, f"{hf.KEY}={self.cfg.model.init_from}")
        warn_if_changed(self.cfg.model.init_from, shape, where)
        return shape

    def check_vocab(self, model_vocab: int, vocab: int, train: str, source: str) -> None:
        if model_vocab < vocab:
            raise ConfigError(
                f"{source}: its vocabulary ({model_vocab}) is smaller than that of the "
                f"tokenizer {self.tokenizer['name']!r} of {train} ({vocab})"
            )

    def hf_model_config(self, vocab: int, train: str) -> GPTConfig:
        """The GPT's shape from the Hugging Face folder `model.init_from`, checked against the
        run's `causal_lm.*` keys and `model.name`, the tokenizer's vocabulary and
        `data.seq_len` (`hf.open_folder`: preflight runs the same checks)."""
        folder = self.cfg.model.init_from
        source = hf.open_folder(folder, self.seq_len)
        model_cfg = source.shape
        hf.check_against_model_keys(model_cfg, self.cfg.causal_lm, folder)
        check_preset(self.cfg.model.name, model_cfg, f"{hf.KEY}={folder} ({hf.CONFIG})")
        if model_cfg.vocab_size < vocab:
            raise ConfigError(
                f"{hf.KEY}={folder}: vocab_size {model_cfg.vocab_size} is smaller than the "
                f"vocabulary of the tokenizer {self.tokenizer['name']!r} of {train} ({vocab}); "
                f"convert the text with the folder's tokenizer.json"
            )
        own = Path(folder) / "tokenizer.json"
        if own.is_file() and file_sha256(str(own)) != self.tokenizer.get("sha256"):
            # Same-sized vocabularies of other tokens train silently into garbage.
            log.warning(
                "%s=%s: the shards of %s were converted with %s, not with the folder's "
                "tokenizer.json: its embeddings stand for other tokens (convert with "
                "--tokenizer %s)",
                hf.KEY,
                folder,
                train,
                self.tokenizer["name"],
                own,
            )
        self.hf_source = source.recorded
        return model_cfg

    def warm_start_shape(self) -> GPTConfig | None:
        """The GPT shape the checkpoint at `model.init_from` records (a run folder or
        checkpoint of a newer causal_lm run), so that a warm start needs no `causal_lm.*` keys;
        None for anything else (the model is then built from the config and must match).

        Raises:
            ConfigError: the source run was trained on another tokenizer than data.train's.
        """
        from hpctrain.checkpoint.weights import locate_checkpoint

        try:
            _, _, manifest = locate_checkpoint(self.cfg.model.init_from)
        except (CheckpointError, OSError, ValueError):
            return None  # not a checkpoint: init_from.check names what it is
        metadata = manifest.get("metadata") or {}
        if isinstance(metadata.get("tokenizer"), dict):
            check_recorded_tokenizer(
                metadata["tokenizer"],
                self.tokenizer,
                f"{hf.KEY}={self.cfg.model.init_from}",
                f"data.train={describe_train(self.cfg.data.train)}",
                config=True,
            )
        recorded = metadata.get("gpt")
        if not isinstance(recorded, dict):
            return None
        self.hf_source = dict(metadata.get("hf_config") or {})
        return GPTConfig(**recorded)

    @staticmethod
    def check_model_name(name: str, image_size: int | None = None) -> None:
        """A preset of `hpctrain.models.gpt` (`PRESETS`)."""
        if name and name not in PRESETS:
            raise ConfigError(f"model.name={name!r}: task causal_lm takes {', '.join(PRESETS)}")

    @staticmethod
    def eval_metric_names(cfg: Config) -> tuple[str, ...]:
        """What `summarize` may report with `cfg`: `targets` with the loss masks on (every
        evaluation batch then carries one), `bits_per_byte` unless `data.tokenizer` names a
        tokenizer file (the index's tokenizer may be the bytes one), the answers' scores with
        `eval.generate`."""
        names: tuple[str, ...] = ("loss", "perplexity")
        if cfg.data.loss_mask:
            names += ("targets",)
        if cfg.data.tokenizer in ("", BYTES):
            names += ("bits_per_byte",)
        if cfg.eval.generate:
            names += (*answers.METRICS, "answers")
        return names

    @staticmethod
    def model_card(
        tree: dict[str, Any], weights: dict[str, torch.Tensor], manifest: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The GPT's shape, the sequence length and how to rebuild it (`lm_model_card`);
        None for weights the run's config does not describe."""
        try:
            return lm_model_card(tree, weights, "checkpoint", manifest)
        except CheckpointError:
            return None

    def model_metadata(self) -> dict[str, Any]:
        """What checkpoints record to rebuild the model without the config's sources: the
        GPT's shape, the tokenizer (its file's absolute path and sha256) and, when imported,
        the Hugging Face folder's `hf.RECORDED_KEYS` (architecture, token ids, context,
        sliding window): a resume, eval, predict, generate or `export --format hf` then never
        reads the `model.init_from` folder, and refuses data of another tokenizer."""
        metadata: dict[str, Any] = {
            "gpt": asdict(self.model_cfg),
            "tokenizer": recorded_info(self.tokenizer),
        }
        if self.hf_source:
            metadata["hf_config"] = self.hf_source
        return metadata

    def use_text_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Encode and decode text with `tokenizer` (an inference verb's, resolved against the
        checkpoint's record: `hpctrain.inference.generate.run_tokenizer`)."""
        self._text_tokenizer = tokenizer

    def text_tokenizer(self) -> Tokenizer:
        """The tokenizer itself (for decoding), see `load_index_tokenizer`."""
        if self._text_tokenizer is None:
            self._text_tokenizer = load_index_tokenizer(self.tokenizer, self.cfg.data.tokenizer)
        return self._text_tokenizer

    def flops_per_token(self) -> int:
        """Training FLOPs per token of this model at `data.seq_len` (see `gpt.flops_per_token`)."""
        return flops_per_token(self.model_cfg, self.seq_len)

    def build_model(self) -> nn.Module:
        return GPT(self.model_cfg)

    def train_transform(self) -> SequenceTransform:
        return SequenceTransform(self.seq_len, self.cfg.data.document_mask, self.loss_mask)

    def eval_transform(self) -> SequenceTransform:
        # The data evaluated (`hpctrain eval --data`, `predict`) may hold masks that the
        # training data had not: every batch carries one (the data's, or every target), so
        # that evaluation and prediction average over the data's own targets.
        return SequenceTransform(self.seq_len, self.cfg.data.document_mask, self.cfg.data.loss_mask)

    def token_losses(
        self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Cross-entropy in nats of every target position, [B, seq_len], fp32; with
        `positions` ([B, seq_len + 1]) attention stays within each document."""
        inputs = (tokens[:, :-1],) if positions is None else (tokens[:, :-1], positions[:, :-1])
        logits = model(*inputs).float()  # fp32 under autocast too
        targets = tokens[:, 1:]
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return losses.view_as(targets)

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        losses = self.token_losses(model, batch["tokens"], batch.get("positions"))
        targets = _targets(batch)
        if targets is None:
            # Every sequence has seq_len targets: the mean of valid sequences' means is the
            # mean over their tokens.
            return masked_mean(losses.mean(dim=1), batch["valid"]), {}
        # Instruction data: the mean over this batch's masked targets (`count_targets`).
        loss = (losses * targets).sum() / targets.sum().clamp(min=1)
        return loss, {}

    def count_targets(self, batch: dict[str, Any]) -> int:
        """The target tokens `loss` averages over: the masked ones of valid sequences, or
        every position of them (the trainer weighs micro-batches and ranks by it; on the
        host, so `count_nonzero` of the bools, several times faster than a sum here)."""
        valid, mask = batch["valid"], batch.get("loss_mask")
        if mask is None:
            return int(valid.sum()) * (batch["tokens"].shape[1] - 1)
        return int(torch.count_nonzero(mask[:, 1:] & valid[:, None]))

    def eval_metrics(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        losses = self.token_losses(model, batch["tokens"], batch.get("positions"))
        valid = batch["valid"].float()
        targets = _targets(batch)
        if targets is None:
            return {
                "loss": (losses.sum(dim=1) * valid).sum(),
                "tokens": valid.sum() * losses.shape[1],
                "count": valid.sum(),
            }
        return {
            "loss": (losses * targets).sum(),
            "tokens": targets.sum().float(),
            "targets": targets.sum().float(),
            "count": valid.sum(),
        }

    def metric_names(self) -> tuple[str, ...]:
        """The keys of this task's evaluation records (`checkpoint.monitor` may name one)."""
        names = ["val_loss", "val_perplexity", "val_samples"]
        if self.loss_mask:
            names.append("val_targets")
        if self.tokenizer["name"] == BYTES and not self.tokenizer.get("sha256"):
            names.append("val_bits_per_byte")
        if self.generates_answers:
            names += [f"val_{name}" for name in (*answers.METRICS, "answers")]
        return tuple(names)

    def validation_examples(self) -> list[answers.Example]:
        """The prompts of `data.val` with their references (the first `eval.generate_samples`;
        see `hpctrain.tasks.answers`), read once."""
        if self._examples is None:
            cfg = self.cfg
            index = open_index(cfg.data.val, allow_pipe=cfg.data.allow_pipe)
            tokenizer = self.text_tokenizer()
            found = []
            for document in iter_documents(index, allow_pipe=cfg.data.allow_pipe):
                example = answers.example_of(
                    document, tokenizer.eod_id, set(tokenizer.specials.values())
                )
                if example is not None:
                    found.append(example)
                    if len(found) == cfg.eval.generate_samples:
                        break
            self._examples = found
        return self._examples

    def answer_sums(self, model: nn.Module, share: answers.Share) -> dict[str, torch.Tensor]:
        """This rank's share of the validation prompts answered (`eval.generate`), as the
        counts `summarize` turns into val_exact_match and val_token_f1."""
        cfg = self.cfg.eval
        replies = answers.answer_examples(
            model,
            self.validation_examples(),
            self.text_tokenizer(),
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.generate_batch_size or self.cfg.data.batch_size,
            window=self.seq_len,
            normalize_with=cfg.normalize,
            share=share,
        )
        return answers.answer_sums(replies, next(model.parameters()).device)

    def summarize(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """loss (nats per token), perplexity and, for the bytes tokenizer, bits per byte; with
        `eval.generate`, exact_match and token_f1 of the answers (`hpctrain.tasks.answers`);
        NaN over data without a single target (masks that mark none), not a perfect 0.0."""
        tokens = float(sums["tokens"])
        loss = float(sums["loss"]) / tokens if tokens else math.nan
        metrics = {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
        if "answers" in sums:
            metrics.update(answers.answer_metrics(sums))
        if "targets" in sums:  # instruction data: how many masked targets the loss counted
            metrics["targets"] = int(sums["targets"])
        if self.tokenizer["name"] == BYTES and not self.tokenizer.get("sha256"):
            metrics["bits_per_byte"] = loss / math.log(2)
        return metrics

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """One dict per sequence, in batch order: its mean loss (nats per target token) and
        the fraction of its targets where the greedy (argmax) next token is right, both over
        the targets the loss counts (instruction data: the masked ones, as training and
        evaluation; None for a sequence without any), its number of `targets`, and the
        greedy token after the sequence's last one, as id and decoded text. The key is the
        writer's to add, and invalid rows (padding) are the writer's to drop
        (`hpctrain.inference.predict`)."""
        tokens, positions = batch["tokens"], batch.get("positions")
        inputs = (tokens,) if positions is None else (tokens, positions)
        logits = model(*inputs).float()  # every position, the last one's next token too
        targets = tokens[:, 1:]
        losses = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none"
        ).view_as(targets)
        greedy = logits.argmax(dim=-1)
        mask = batch.get("loss_mask")
        counted = (
            torch.ones_like(losses) if mask is None else mask[:, 1:].to(losses.dtype)
        )  # per row: `valid` is the writer's
        count = counted.sum(dim=1)
        loss = (losses * counted).sum(dim=1) / count.clamp(min=1)
        accuracy = ((greedy[:, :-1] == targets).float() * counted).sum(dim=1) / count.clamp(min=1)
        decode = self.text_tokenizer().decode
        return [
            {
                "loss": row_loss if n else None,
                "accuracy": acc if n else None,
                "targets": int(n),
                "next_token": int(nxt),
                "next_text": decode([int(nxt)]),
            }
            for row_loss, acc, n, nxt in zip(
                loss.tolist(),
                accuracy.tolist(),
                count.tolist(),
                greedy[:, -1].tolist(),
                strict=True,
            )
        ]


def _targets(batch: dict[str, Any]) -> torch.Tensor | None:
    """The float [B, seq_len] weights of the masked targets of valid sequences, or None
    without a `loss_mask` (every target counts). `loss_mask[t]` marks token t as a target:
    the prediction made at t - 1."""
    mask = batch.get("loss_mask")
    if mask is None:
        return None
    return (mask[:, 1:] & batch["valid"][:, None].bool()).float()


def describe(tokenizer: dict[str, Any]) -> str:
    sha = str(tokenizer.get("sha256") or "")
    return (
        f"{tokenizer.get('name')!r} (vocab_size {tokenizer.get('vocab_size')}, eod_id "
        f"{tokenizer.get('eod_id')}{', sha256 ' + sha[:12] if sha else ''})"
    )
