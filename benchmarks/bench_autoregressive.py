"""Autoregressive decode speed: our jitted loop vs transformers `generate`, side by side.

Same model (the embedded SmolLM2-135M-Instruct, fp32), same prompts, batch 1, greedy, the same
number of new tokens (stop tokens disabled on both sides), same CPU, interleaved prompt by prompt.
Both sides are timed the same way, wall-clock around the public call (`jetspec_jax.generate`,
`model.generate`): prefill, decode and their host overheads. Our ahead-of-time compilation, which
the call times apart, is subtracted (reported apart); transformers' first-call warm-up is excluded
by a warm-up call.

    python benchmarks/bench_autoregressive.py [--config configs/bench_autoregressive.json]

Needs the test extra (torch, transformers). Prints the figures and writes them to
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import machine_line, write_section  # noqa: E402
from jetspec_jax.data.prompts import MATH_SUFFIX, read_prompts  # noqa: E402
from jetspec_jax.flag_paths import require_paths  # noqa: E402
from jetspec_jax.prompting import encode_prompt  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench_autoregressive.json"))
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    try:  # not after the two models' load
        require_paths("--config", [args.config])
        cfg = json.loads(pathlib.Path(args.config).read_text())
        require_paths(f"--config {args.config}: prompt_file", [ROOT / cfg["prompt_file"]])
    except FileNotFoundError as e:
        parser.error(str(e))

    target = jetspec_jax.load_target(dtype=cfg["dtype"])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        target.path, dtype=getattr(torch, cfg["dtype"])
    ).eval()
    records = read_prompts(ROOT / cfg["prompt_file"], limit=cfg["num_prompts"])
    suffix = MATH_SUFFIX if cfg["math_suffix"] else ""
    prompts = [
        encode_prompt(target.tokenizer, r["prompt"] + suffix, chat=cfg["chat"]) for r in records
    ]
    n = cfg["max_new_tokens"]

    # Warm up both sides on the first prompt (our compile; torch's first-call allocations).
    warm = jetspec_jax.generate(target, prompts[0], max_new_tokens=n, stop_token_ids=[])
    _hf_generate(hf_model, prompts[0], n)

    rows = []
    for prompt in prompts:
        start = time.perf_counter()
        ours = jetspec_jax.generate(target, prompt, max_new_tokens=n, stop_token_ids=[])
        ours_s = time.perf_counter() - start - ours.timing.compile_seconds
        hf_tokens, hf_s = _hf_generate(hf_model, prompt, n)
        rows.append(
            dict(
                prompt_tokens=len(prompt),
                ours=n / ours_s,
                hf=n / hf_s,
                ours_decode=ours.decode_tokens_per_second,
                same_tokens=hf_tokens == ours.tokens,
            )
        )

    ours_med = statistics.median(r["ours"] for r in rows)
    hf_med = statistics.median(r["hf"] for r in rows)
    ratio_med = statistics.median(r["ours"] / r["hf"] for r in rows)
    same = sum(r["same_tokens"] for r in rows)
    config_path = pathlib.Path(args.config).resolve()
    config_name = config_path.relative_to(ROOT) if config_path.is_relative_to(ROOT) else config_path
    template = "with the chat template" if cfg["chat"] else "as raw text (no chat template)"
    body = "\n".join(
        [
            "## Autoregressive decoding: jetspec_jax vs transformers `generate`",
            "",
            f"- Machine: {machine_line()}",
            f"- Command: `python benchmarks/bench_autoregressive.py` (config `{config_name}`)",
            f"- Setup: SmolLM2-135M-Instruct ({cfg['dtype']}), batch 1, greedy, {n} new tokens "
            f"per prompt (stop tokens off), {len(rows)} prompts from `{cfg['prompt_file']}` "
            f"{template}; time = wall clock of each side's `generate` call, our compile time "
            f"({warm.timing.compile_seconds:.1f} s, once per shape bucket) excluded.",
            f"- Greedy outputs identical to transformers on {same}/{len(rows)} prompts.",
            "",
            "| | median tokens/s |",
            "|---|---:|",
            f"| jetspec_jax (jitted `lax.while_loop`) | {ours_med:.1f} |",
            f"| transformers `generate` (PyTorch) | {hf_med:.1f} |",
            f"| **ratio ours / transformers** (median per-prompt ratio) | **{ratio_med:.2f}** |",
            "",
            "| prompt tokens | ours tok/s | transformers tok/s | ratio | ours decode-only tok/s |",
            "|---:|---:|---:|---:|---:|",
            *[
                f"| {r['prompt_tokens']} | {r['ours']:.1f} | {r['hf']:.1f} | "
                f"{r['ours'] / r['hf']:.2f} | {r['ours_decode']:.1f} |"
                for r in rows
            ],
        ]
    )
    print(body)
    write_section("bench_autoregressive", body)


def _hf_generate(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist(), time.perf_counter() - start


if __name__ == "__main__":
    main()
