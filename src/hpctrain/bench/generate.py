"""`hpctrain bench generate`: greedy decoding, hpctrain's KV cache against transformers'.

A random GPT (`--preset`'s widths, `--layers`, `--vocab`) is written as a Hugging Face Llama
folder with the export's own name mapping (`hpctrain.models.hf`), then loaded both ways: by
transformers (`AutoModelForCausalLM`, fp32, its `generate` with its cache) and by hpctrain
(the folder imported into the built-in GPT, `hpctrain.models.decoding.decode`). The same
prompts (random ids of several lengths, left-padded) are decoded greedily for the same number
of new tokens (no end of text), once per batch size, the two interleaved `--repeats` times;
the medians give tokens per second and the ratio hpctrain / transformers, by wall time and by
this process's CPU time (steadier on a shared machine). The outputs must be identical token
for token. Goal (issue 41): ratio >= 1.0 on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpctrain.bench.measure import self_cpu_seconds
from hpctrain.models import hf
from hpctrain.models.decoding import decode, left_padded
from hpctrain.models.gpt import GPT, gpt_config

HELP = "greedy decoding: hpctrain's KV cache vs transformers' generate on one exported model"
GOAL = 1.0  # hpctrain tokens/s over transformers' (CPU, fp32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="gpt-125m", help="GPT preset whose widths to use")
    parser.add_argument("--layers", type=int, default=4, help="layers (0: the preset's)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument(
        "--batches", default="1,8", help="prompts decoded together, one case each (1,8)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=48, help="longest prompt's ids")
    parser.add_argument("--new-tokens", type=int, default=32, help="ids added to each prompt")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (fp32 either way)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def prompts_of(batch: int, longest: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`batch` random prompts of lengths spread from longest / 2 to `longest`."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [max(1, longest - (longest // 2) * i // max(1, batch - 1)) for i in range(batch)]
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


def timed(fn: Callable[[], list[list[int]]]) -> tuple[list[list[int]], float, float]:
    """(outputs, wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), self_cpu_seconds()
    out = fn()
    return out, time.perf_counter() - wall, self_cpu_seconds() - cpu


def run(args: argparse.Namespace) -> int:
    import transformers

    device = torch.device(args.device)
    cfg = gpt_config(args.preset, args.vocab, n_layers=args.layers)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as work:
        folder = Path(work)
        weights = {k: v.detach() for k, v in GPT(cfg).state_dict().items()}
        from safetensors.torch import save_file

        save_file(hf.hf_state_dict(weights, cfg), str(folder / hf.WEIGHTS))
        (folder / hf.CONFIG).write_text(
            json.dumps(hf.hf_config(cfg, {"architectures": ["LlamaForCausalLM"]}, None))
        )
        theirs: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ours = GPT(cfg)
        hf.load_hf_weights(ours, str(folder), cfg)
    theirs = theirs.to(device=device).eval()
    ours = ours.to(device).eval()
    theirs.generation_config.eos_token_id = None  # every row runs the full --new-tokens
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = prompts_of(batch, args.prompt_tokens, args.vocab)
        rows.append(compare(ours, theirs, prompts, args.new_tokens, args.repeats, device))
    met = all(row["ratio_cpu"] >= GOAL for row in rows) and all(r["identical"] for r in rows)
    summary: dict[str, Any] = {
        "model": f"{args.preset} x{cfg.n_layers} layers, vocab {cfg.vocab_size}",
        "rows": rows,
    }
    summary["goal"] = f"hpctrain/transformers tokens/s >= {GOAL} (CPU time), identical outputs"
    summary["met"] = met
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"greedy decoding, {summary['model']}, {args.new_tokens} new tokens, {device}")
    print(
        f"{'batch':>5} {'hpctrain tok/s':>15} {'transformers':>13} {'wall':>6} {'CPU':>6}  identical"
    )
    for row in rows:
        print(
            f"{row['batch']:>5} {row['ours_tokens_per_s']:>15.1f} "
            f"{row['theirs_tokens_per_s']:>13.1f} {row['ratio_wall']:>5.2f}x "
            f"{row['ratio_cpu']:>5.2f}x  {'yes' if row['identical'] else 'NO'}"
        )
    print(f"goal: {summary['goal']}: {'met' if met else 'missed'}")
    return 0


@torch.no_grad()
def compare(
    ours: GPT,
    theirs: Any,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    device: torch.device,
) -> dict[str, Any]:
    """One batch size: both decoders interleaved `repeats` times, medians and the outputs."""
    tokens, _, valid = left_padded(prompts, device)
    config = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}

    def hpctrain_generate() -> list[list[int]]:
        return decode(ours, prompts, max_new_tokens=new_tokens)

    def transformers_generate() -> list[list[int]]:
        out = theirs.generate(
            input_ids=tokens, attention_mask=valid.long(), pad_token_id=0, **config
        )
        return [list(row) for row in out[:, tokens.shape[1] :].tolist()]

    hpctrain_generate(), transformers_generate()  # warm-up: allocator, kernels
    walls: dict[str, list[float]] = {"ours": [], "theirs": []}
    cpus: dict[str, list[float]] = {"ours": [], "theirs": []}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, fn in (("ours", hpctrain_generate), ("theirs", transformers_generate)):
            outputs[name], seconds, cpu_seconds = timed(fn)
            walls[name].append(seconds)
            cpus[name].append(cpu_seconds)
    count = len(prompts) * new_tokens
    wall = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    return {
        "batch": len(prompts),
        "ours_tokens_per_s": count / wall["ours"],
        "theirs_tokens_per_s": count / wall["theirs"],
        "ratio_wall": wall["theirs"] / wall["ours"],
        "ratio_cpu": cpu["theirs"] / max(cpu["ours"], 1e-9),
        "identical": outputs["ours"] == outputs["theirs"],
    }
