"""Greedy decoding on a GPU with the Pallas kernels vs with their references, end to end.

Random transformers checkpoints built on the spot (no weights to carry to the device):

    dense    Qwen3, 4 layers, hidden 1024, 16 query / 4 KV heads of head_dim 128 (the draft
             attention's GQA 4:1 at Qwen3-8B's head size)
    hybrid   Qwen3.5 text, layers [linear, full, linear, linear], linear attention with
             4 key / 8 value heads of 128 channels (the delta-rule kernel's shapes)

both with a vocabulary of 16 and their residual branches shrunk (`tests.tiny_models.near_bigram`),
so an untrained draft's blocks are accepted now and then and the round outcomes depend on the
drafts.

For each target dtype (float32, bfloat16), prompts of 600..1000 tokens (not tile multiples):

    dense    JetSpec++ J1-R1 (draft + adapter, block 16) alone and with foresight B = 4, with the
             draft attention on `impl="reference"` and on `impl="pallas"` (the Triton kernel)
    hybrid   JetSpec (block 16) with the recurrence on "reference" and on "pallas" (the draft's
             attention on the reference in both)

Checks, in float32 (exit status 1 if one fails): every run's tokens equal plain autoregressive
decoding's (references everywhere), and the kernel runs' per-round outcomes `(k accepted, bonus)`
and foresight hits equal the reference runs'. In bfloat16 both are counted, not required: a
block's forward rounds differently from one token's, and the kernel sums in another order than
the reference, so near-ties may flip. Timing: the decode loop's seconds (compiled), median over
the prompts, kernel vs reference.

    python benchmarks/bench_kernels_end_to_end.py [--out FILE]    # GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import tempfile
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.kernel_bench import first_line  # noqa: E402
from benchmarks.report import machine_line, out_parser, write_section  # noqa: E402
from jetspec_jax.adapter import init_adapter  # noqa: E402
from tests.tiny_models import near_bigram  # noqa: E402

SECTION = "kernels_end_to_end"
PROMPT_LENGTHS = (600, 777, 1000)  # one shape bucket (1024): one compile per setting
NEW_TOKENS = 64
BLOCK = 16
KERNEL_IMPL = "pallas"  # the compiled kernel ("pallas_interpret" runs this script's logic on CPU)

VOCAB = 16  # small, so an untrained draft is accepted now and then


def dense_config() -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
        initializer_range=0.1,
    )


def hybrid_config() -> transformers.PretrainedConfig:
    layer_types = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=4096,
        initializer_range=0.1,
    )


def save_checkpoint(model_class, config, path: pathlib.Path) -> pathlib.Path:
    torch.manual_seed(0)
    model_class(config).float().eval().save_pretrained(path)
    return path


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENGTHS]


def with_recurrence_impl(target, impl: str):
    return dataclasses.replace(
        target, config=dataclasses.replace(target.config, recurrence_impl=impl)
    )


@dataclasses.dataclass
class Outcome:
    """One setting's runs over the prompts, per impl."""

    name: str
    dtype: str
    tokens_equal_ar: dict[str, int] = dataclasses.field(default_factory=dict)
    rounds_equal: int = 0
    decode_s: dict[str, float] = dataclasses.field(default_factory=dict)
    tau: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None

    def failed(self, prompts: int) -> bool:
        if self.error is not None:
            return True
        exact = [self.rounds_equal, *self.tokens_equal_ar.values()]
        return self.dtype == "float32" and any(n != prompts for n in exact)


def compare(name: str, dtype: str, setups: dict, options: dict, ar_tokens: list) -> Outcome:
    """Runs `generate(target, prompt, draft=draft, **options)` for `setups["reference"]` and
    `setups["kernel"]` (each a `(target, draft)`) over `ar_tokens`' `(prompt, AR tokens)`, once
    first to compile outside the timed runs."""
    out = Outcome(name, dtype)
    try:
        results = {}
        for key, (target, draft) in setups.items():

            def run(prompt, target=target, draft=draft):
                return jetspec_jax.generate(target, prompt, draft=draft, **options)

            run(ar_tokens[0][0])
            results[key] = [run(prompt) for prompt, _ in ar_tokens]
            out.tokens_equal_ar[key] = sum(
                r.tokens == want for r, (_, want) in zip(results[key], ar_tokens, strict=True)
            )
            out.decode_s[key] = statistics.median(r.timing.decode_seconds for r in results[key])
            out.tau[key] = statistics.mean(r.tau for r in results[key])
        ref, ker = results["reference"], results["kernel"]
        out.rounds_equal = sum(
            (a.outcomes, a.foresight_hits) == (b.outcomes, b.foresight_hits)
            for a, b in zip(ref, ker, strict=True)
        )
    except Exception as e:  # noqa: BLE001 - record and go on: one device run, all facts
        traceback.print_exc()
        out.error = first_line(e)
    print(out, flush=True)
    return out


def dense_outcomes(path: pathlib.Path, dtype: str) -> list[Outcome]:
    target = near_bigram(jetspec_jax.load_target(path, dtype=dtype))
    draft = jetspec_jax.init_draft(target, block_size=BLOCK, init_std=0.1, seed=1)
    draft = draft.with_adapter(init_adapter(draft, init_std=0.05, seed=2))
    generate = dict(max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    ar = [(p, jetspec_jax.generate(target, p, **generate).tokens) for p in prompts()]
    setups = {
        "reference": (target, draft.with_attention_impl("reference")),
        "kernel": (target, draft.with_attention_impl(KERNEL_IMPL)),
    }
    j1_r1 = dict(method="jetspec++", refine_passes=1, refreshes=1, **generate)
    foresight = dict(foresight=4, foresight_rule="uncalibrated", **j1_r1)
    return [
        compare("dense J1-R1", dtype, setups, j1_r1, ar),
        compare("dense J1-R1, foresight B = 4", dtype, setups, foresight, ar),
    ]


def hybrid_outcomes(path: pathlib.Path, dtype: str) -> list[Outcome]:
    target = near_bigram(jetspec_jax.load_target(path, dtype=dtype))
    draft = jetspec_jax.init_draft(target, variant="jetspec", block_size=BLOCK, seed=1)
    draft = draft.with_attention_impl("reference")  # the row compares the recurrence alone
    generate = dict(max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    reference = with_recurrence_impl(target, "reference")
    ar = [(p, jetspec_jax.generate(reference, p, **generate).tokens) for p in prompts()]
    setups = {
        "reference": (reference, draft),
        "kernel": (with_recurrence_impl(target, KERNEL_IMPL), draft),
    }
    options = dict(method="jetspec", **generate)
    return [compare("hybrid JetSpec (delta-rule kernel)", dtype, setups, options, ar)]


def report(outcomes: list[Outcome]) -> str:
    n = len(PROMPT_LENGTHS)
    lines = [
        "## Kernels end to end (GPU)",
        "",
        f"{machine_line()}. `benchmarks/bench_kernels_end_to_end.py`: random checkpoints (dense "
        "Qwen3 with 16 / 4 heads of head_dim 128; hybrid Qwen3.5 with 128-channel linear "
        f"attention; vocabulary {VOCAB}, near-bigram), greedy, prompts of "
        f"{', '.join(map(str, PROMPT_LENGTHS))} tokens, {NEW_TOKENS} new tokens, block {BLOCK}. "
        "*= AR*: runs whose tokens equal plain autoregressive decoding's; *rounds equal*: "
        "prompts whose per-round outcomes and foresight hits are the same with the kernel as "
        "with the reference (required in float32). Decode seconds: median over the prompts "
        "(compiled).",
        "",
        "| setting | dtype | = AR (reference / kernel) | rounds equal | tau | decode s "
        "(reference / kernel) | kernel vs reference |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        if o.error:
            lines.append(f"| {o.name} | {o.dtype} | failed: {o.error} | | | | |")
            continue
        ref, ker = o.decode_s["reference"], o.decode_s["kernel"]
        lines.append(
            f"| {o.name} | {o.dtype} | {o.tokens_equal_ar['reference']}/{n} / "
            f"{o.tokens_equal_ar['kernel']}/{n} | {o.rounds_equal}/{n} | "
            f"{o.tau['reference']:.2f} / {o.tau['kernel']:.2f} | {ref:.3f} / {ker:.3f} | "
            f"{ref / ker:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    return out_parser(__doc__.split("\n")[0])


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        parser.error("this check needs a GPU (the kernels' compiled Triton launches)")
    print(machine_line(), flush=True)
    root = pathlib.Path(tempfile.mkdtemp())
    dense = save_checkpoint(transformers.Qwen3ForCausalLM, dense_config(), root / "dense")
    hybrid = save_checkpoint(transformers.Qwen3_5ForCausalLM, hybrid_config(), root / "hybrid")
    outcomes = []
    for dtype in ("float32", "bfloat16"):
        for run, path in ((dense_outcomes, dense), (hybrid_outcomes, hybrid)):
            outcomes += run(path, dtype)
            write_section(SECTION, report(outcomes), args.out)  # a cut-off run keeps its rows
    print(report(outcomes))
    return int(any(o.failed(len(PROMPT_LENGTHS)) for o in outcomes))


if __name__ == "__main__":
    sys.exit(main())
