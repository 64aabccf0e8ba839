"""Serve a target with jetspec_jax: generation from the command line.

    python serve.py generate "PROMPT"      # the embedded default model, chat template, greedy
    python serve.py generate "PROMPT" --target DIR --temperature 0.8 --top-p 0.95 --seed 1
    python serve.py generate "PROMPT" --target DIR --draft DRAFT_DIR --method jetspec++

Prints the completion to stdout, then tokens/s and acceptance statistics to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    import jetspec_jax  # deferred so that --help answers at once
    from jetspec_jax.prompting import encode_prompt

    try:
        # Validate the request before the (slow) model load.
        sampling = jetspec_jax.SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
        )
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        target = jetspec_jax.load_target(args.target, dtype=args.dtype)
        draft = jetspec_jax.load_draft(args.draft, target) if args.draft else None
        if target.tokenizer is None:
            raise ValueError(f"{target.path} has no tokenizer; serve.py needs one to read text")
        chat = args.chat if args.chat is not None else bool(target.tokenizer.chat_template)
        prompt_ids = encode_prompt(target.tokenizer, args.prompt, chat=chat, system=args.system)
        result = jetspec_jax.generate(
            target,
            prompt_ids,
            draft=draft,
            method=args.method,
            refine_passes=args.refine_passes,
            max_new_tokens=args.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
        )
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(target.tokenizer.decode(result.tokens, skip_special_tokens=True))
    t = result.timing
    print(
        f"[{args.method}] {len(result.tokens)} tokens ({result.finish_reason}) | "
        f"{result.decode_tokens_per_second:.1f} tokens/s decode | tau {result.tau:.2f} | "
        f"prefill {result.prompt_length} tokens in {t.prefill_seconds:.3f} s | "
        f"compile {t.compile_seconds:.1f} s",
        file=sys.stderr,
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a completion of one prompt")
    gen.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="the prompt text")
    gen.add_argument(
        "--target",
        default=None,
        help="HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument(
        "--method",
        default="ar",
        choices=["ar", "dflash", "jetspec", "jetspec++"],
        help="decoding method; speculative methods need --draft of that variant (default: ar)",
    )
    gen.add_argument("--draft", default=None, help="draft head directory (DFlash/JetSpec layout)")
    gen.add_argument(
        "--refine-passes", type=int, default=0, help="jetspec++: Jacobi refinement passes J"
    )
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the tokenizer has one)",
    )
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("-v", "--verbose", action="store_true", help="log compilation and loading")
    return parser


if __name__ == "__main__":
    sys.exit(main())
