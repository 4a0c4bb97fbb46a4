"""Multi-head latent attention, measured: against grouped-query attention of about the same FLOPs (step
time and peak memory on one rank), its context-parallel exchanges (keys and values against latents: the
counted cp bytes and the step, at cp 2 and 4), and the decoding cache per token.

Parity first: at each cp the two exchanges must give the same losses (1e-5) before anything is timed. Each
configuration then runs `--steps` training steps in fresh gloo worker processes (one thread per rank;
the first `--warmup` are not timed), alternating between configurations round by round; the tables give
medians. Writes its section of benchmarks/RESULTS.md.

    python benchmarks/latent_attention.py [--steps 6] [--warmup 2] [--rounds 2] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from reporting import cpu_model, parser, publish, rounds_of_runs, table

from meshtron.models.attention import LayerKV
from meshtron.models.latent_attention import LatentKV
from meshtron.plan.flops import training_flops_per_token
from meshtron.rules.checks import load_config

TITLE = "## Latent attention (MLA): against GQA, its context-parallel exchanges, its cache"
SEQ = 1024
BASE = [
    "--model.dim=512",
    "--model.n_layers=4",
    "--model.n_heads=8",
    "--model.ffn_dim=1376",
    "--model.vocab_size=4096",
    "--data.tokenizer=byte",
    f"--training.seq_len={SEQ}",
    "--training.global_batch=4",
    "--training.micro_batch=2",
    "--training.lr=1e-3",
    "--run.plot=false",
    "--run.sample_tokens=0",
    "--training.warmup_steps=1",
]
# MLA: latents of 128 (keys and values) and 192 (queries), a 32-dim rotary key, 64 + 32 query/key and 64
# value dims per head; GQA: 8 heads of 64, 2 key/value heads.
MLA = [
    "--model.kv_lora_rank=128",
    "--model.q_lora_rank=192",
    "--model.qk_nope_head_dim=64",
    "--model.qk_rope_head_dim=32",
    "--model.v_head_dim=64",
]
GQA = ["--model.n_kv_heads=2"]


def measure(configs: dict[str, tuple[int, list[str]]], args, work: Path) -> dict[str, list[dict]]:
    """Each configuration's rank-0 results over the rounds (step times, losses, cp bytes, peak)."""
    runs = rounds_of_runs(
        {k: (w, [*BASE, *o]) for k, (w, o) in configs.items()}, args.rounds, args.steps, work
    )
    return {
        name: [
            {
                "losses": [r["loss"] for r in rows],
                "times": [r["step_time_s"] for r in rows],
                "cp": [r["comm_bytes_by_group"].get("cp", 0.0) for r in rows],
                "peak": max(r["peak_mem_bytes"] for r in rows),
            }
            for rows in per_round
        ]
        for name, per_round in runs.items()
    }


def median_time(results: list[dict], warmup: int) -> float:
    return statistics.median(t for r in results for t in r["times"][warmup:])


def attention_rows(results: dict[str, list[dict]], warmup: int) -> list[list[str]]:
    rows = []
    for name, extra in (("GQA", GQA), ("MLA", MLA)):
        cfg = load_config(None, [*BASE, *extra]).model
        peak = max(r["peak"] for r in results[name]) / 2**20
        rows.append(
            [
                name,
                f"{training_flops_per_token(cfg, SEQ) / 1e6:.1f}",
                f"{median_time(results[name], warmup):.3f}",
                f"{peak:.0f}",
            ]
        )
    return rows


def exchange_rows(results: dict[str, list[dict]], warmup: int) -> list[list[str]]:
    rows = []
    for cp in (2, 4):
        kv, latent = results[f"cp{cp}_kv"], results[f"cp{cp}_latent"]
        worst = max(
            abs(a - b) / abs(b)
            for x, y in zip(kv, latent, strict=True)
            for a, b in zip(x["losses"], y["losses"], strict=True)
        )
        if worst > 1e-5:
            raise SystemExit(
                f"cp {cp}: the exchanges' losses differ by {worst:.1e} (parity fails; nothing timed)"
            )
        t_kv, t_lat = median_time(kv, warmup), median_time(latent, warmup)
        b_kv, b_lat = kv[0]["cp"][-1], latent[0]["cp"][-1]
        rows.append(
            [
                str(cp),
                f"{b_kv / 2**20:.1f}",
                f"{b_lat / 2**20:.1f}",
                f"{b_lat / b_kv:.3f}",
                f"{t_kv:.3f}",
                f"{t_lat:.3f}",
                f"{t_lat / t_kv:.2f}",
                f"{worst:.1e}",
            ]
        )
    return rows


def cache_rows() -> list[list[str]]:
    import torch

    rows = []
    for name, overrides in (
        ("GQA (this benchmark)", [*BASE, *GQA]),
        ("MLA (this benchmark)", [*BASE, *MLA]),
        ("Llama 3 8B", ["--model.name=llama3-8b"]),
        ("DeepSeek-V3", ["--model.name=deepseek-v3"]),
    ):
        cfg = load_config(None, overrides).model
        kind = LatentKV if cfg.is_mla else LayerKV
        rows.append([name, f"{kind.bytes_per_token(cfg, torch.bfloat16) * cfg.n_layers:,}"])
    return rows


def main() -> int:
    p = parser(__doc__, steps=6, warmup=2)
    p.add_argument("--rounds", type=int, default=2, help="rounds, alternating between configurations")
    args = p.parse_args()
    configs = {"GQA": (1, GQA), "MLA": (1, MLA)}
    for cp in (2, 4):
        for exchange in ("kv", "latent"):
            configs[f"cp{cp}_{exchange}"] = (
                cp,
                [*MLA, f"--parallel.cp={cp}", f"--parallel.cp_exchange={exchange}"],
            )
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(configs, args, Path(tmp))
    body = "\n".join(
        [
            f"{cpu_model()}, fp32, one thread per rank, {args.steps} steps of 4 x {SEQ} tokens ({args.warmup} untimed), "
            f"{args.rounds} rounds alternating; model: dim 512, 4 layers, 8 heads, vocab 4096. Reproduce: "
            "`python benchmarks/latent_attention.py`.",
            "",
            *table(
                "attention | training FLOPs per token (M) | step (s, median) | peak resident (MiB)",
                attention_rows(results, args.warmup),
                "One rank, the whole step.",
            ),
            "",
            *table(
                "cp | cp bytes per step, kv (MiB) | latent (MiB) | latent/kv | step kv (s) | step latent (s) | latent/kv | losses differ by",
                exchange_rows(results, args.warmup),
                "Ring exchange of MLA; the bytes are rank 0's counted cp bytes of a step (forward and backward).",
            ),
            "",
            *table("model | decoding cache per token (bytes, bf16, all layers)", cache_rows()),
        ]
    )
    publish(body, args.out, TITLE, Path(__file__).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
