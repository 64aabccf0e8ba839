"""Serve a target with jetspec_jax: an OpenAI-compatible HTTP server, or one generation.

    python serve.py --host 127.0.0.1 --port 8000 [--target DIR] [--draft DIR] [--method M]
    python serve.py generate "PROMPT"      # the embedded default model + its draft, greedy
    python serve.py generate "PROMPT" --method ar          # the default model alone
    python serve.py generate "PROMPT" --target DIR --temperature 0.8 --top-p 0.95 --seed 1
    python serve.py generate "PROMPT" --target DIR --draft DRAFT_DIR --refine-passes 1
    echo "PROMPT" | python serve.py generate -               # the prompt from stdin

Without --target, --draft and --method, the embedded default model runs JetSpec++ with the draft
shipped for it; --method ar runs it alone. A --draft with no --method runs the draft's own variant;
a --target with neither runs autoregressive decoding.

The server answers /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health
and /metrics; SIGINT/SIGTERM shut it down gracefully. `generate` streams the completion to stdout
as it is produced, then prints tokens/s, tau and a speedup line to stderr (measured with
--compare-ar, else tau as its upper bound). Sampling parameters are generate's flags (greedy by
default); the server takes them per request, with OpenAI's defaults (temperature 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the imports of jax are deferred: --help answers at once
    from jetspec_jax.draft import Draft
    from jetspec_jax.models.config import TransformerConfig

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."

# The flags of the server alone: given with `generate`, they would be ignored without a word.
SERVER_FLAGS = (
    "host",
    "port",
    "model_name",
    "api_key",
    "max_batch_size",
    "queue_size",
    "default_max_tokens",
    "max_model_len",
    "pad_batch",
    "static_batching",
    "reserve_prompt_tokens",
    "reserve_new_tokens",
    "warmup",
    "shutdown_timeout",
    "keepalive_seconds",
)

# The flags of `generate` alone (`_flags_of_generate_before_it`).
GENERATE_FLAGS = (
    "chat",
    "system",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "compare_ar",
)

# What a bad flag, file or checkpoint raises (CheckpointError is a ValueError): `error: ...`, 2.
USAGE_ERRORS = (ValueError, ImportError, OSError)

logger = logging.getLogger("serve")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    misplaced = _flags_of_generate_before_it(argv)
    if misplaced:
        parser.error(
            f"{', '.join(misplaced)}: give {'them' if misplaced[1:] else 'it'} after `generate` "
            f'(serve.py generate "PROMPT" {misplaced[0]} ...); the server takes none of them'
        )
    args, unknown = parser.parse_known_args(argv)
    server_flags = {_flag(name) for name in SERVER_FLAGS}
    if args.command == "generate":
        # Given after `generate`, they are not even parsed: name them as flags of the server too.
        after = [a.split("=")[0] for a in unknown if a.split("=")[0] in server_flags]
        ignored = [name for name in SERVER_FLAGS if getattr(args, name) != parser.get_default(name)]
        flags = ", ".join([_flag(name) for name in ignored] + after)
        if flags:
            parser.error(f"{flags}: flags of the server, which `generate` does not use")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    level = logging.INFO if args.verbose or args.command is None else logging.WARNING
    from jetspec_jax.compile_cache import enable_compile_cache  # deferred: --help answers at once
    from jetspec_jax.console import (
        configure_logging,
        discard_stdout,
        escape_what_stdout_cannot_encode,
    )
    from jetspec_jax.interrupts import raise_interrupts_outside_gc_callbacks

    configure_logging(level)
    escape_what_stdout_cannot_encode()  # not a UnicodeEncodeError mid-output
    enable_compile_cache()
    raise_interrupts_outside_gc_callbacks()  # else a Ctrl-C in JAX's gc callback is lost
    try:
        return _generate(args) if args.command == "generate" else _serve(args)
    except KeyboardInterrupt:  # Ctrl-C while loading, compiling or generating (the server
        # itself shuts down gracefully on SIGINT)
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader went away (`generate ... | head`): stop quietly,
        # as a process SIGPIPE ended would; stdout is pointed at /dev/null so that the flush at
        # exit does not raise again (Python ignores SIGPIPE, so the write raised instead).
        discard_stdout()
        return 141  # 128 + SIGPIPE


def _flags_of_generate_before_it(argv: list[str]) -> list[str]:
    """The flags of `generate` alone given before it (or with no command), which argparse would
    not name: it takes the flag's value for the command ("invalid choice: '4'")."""
    end = argv.index("generate") if "generate" in argv else len(argv)
    names = {_flag(name) for name in GENERATE_FLAGS} | {"--no-chat"}
    return [a.split("=")[0] for a in argv[:end] if a.split("=")[0] in names]


def _flag(name: str) -> str:
    """The flag of an argparse destination: `max_new_tokens` -> `--max-new-tokens`."""
    return "--" + name.replace("_", "-")


def _load_models(args, check: Callable[[TransformerConfig, Draft | None], None] | None = None):
    """The target and draft the flags name: the shipped draft when the default model runs a
    speculative method (or no --method) without --draft.

    What needs only the target's config.json is checked before its weights load (minutes for a
    large target): the draft, loaded against that config (as `load_draft` would load it for the
    target) and checked against the flags, then `check(target config, draft)`.
    """
    import jetspec_jax
    from jetspec_jax.default_model import default_draft_dir
    from jetspec_jax.draft import load_draft_for_config
    from jetspec_jax.flag_paths import named_by_flag
    from jetspec_jax.target import load_target_config, require_tokenizer

    if args.method is not None and args.method not in jetspec_jax.METHODS:  # before the load
        raise ValueError(
            f"--method must be one of {', '.join(jetspec_jax.METHODS)}, got {args.method!r}"
        )
    if args.target is not None and _is_draft_checkpoint(args.target):
        raise ValueError(
            f"--target {args.target} is a draft checkpoint: pass it as --draft, with --target the "
            "model it drafts for (or no --target, for the default model)"
        )
    target_config = load_target_config(args.target)
    draft_dir = args.draft
    if draft_dir is None and args.target is None and args.method != "ar":
        draft_dir = default_draft_dir()
    draft = None
    if draft_dir:
        start = time.perf_counter()
        # The shipped draft's errors are the installation's, not a flag's.
        named = (
            named_by_flag("--draft", draft_dir, default_target=args.target is None)
            if args.draft
            else contextlib.nullcontext()
        )
        with named:
            draft = load_draft_for_config(draft_dir, target_config, dtype=args.dtype)
        parts = "draft" + (" + adapter" if draft.adapter is not None else "")
        parts += " + calibration" if draft.calibration is not None else ""
        logger.info(
            "loaded %s %s (%s) in %.1f s", parts, draft_dir, draft.config.variant, _since(start)
        )
    _check_draft_serves_flags(args, draft)
    if check is not None:
        check(target_config, draft)
    # Both commands read and write text: a target without a tokenizer fails before its weights.
    require_tokenizer(
        args.target,
        f"--target {args.target}",
        "serve.py needs one to read and write text (token ids: the Python API's generate)",
    )
    start = time.perf_counter()
    target = jetspec_jax.load_target(args.target, dtype=args.dtype)
    logger.info("loaded target %s (%s) in %.1f s", target.path, args.dtype, _since(start))
    return target, draft


def _is_draft_checkpoint(path: str) -> bool:
    """Whether `path` holds a draft (a JetSpec++ checkpoint, or a DFlash/JetSpec draft's
    config.json); anything else is left to `load_target`'s checks."""
    from jetspec_jax.checkpoint.bundle import is_bundle
    from jetspec_jax.checkpoint.draft_hf import is_draft_config

    config = pathlib.Path(path) / "config.json"
    if is_bundle(path):
        return True
    try:
        return config.is_file() and is_draft_config(json.loads(config.read_text(encoding="utf-8")))
    except (OSError, ValueError):  # unreadable: load_target names what is wrong with it
        return False


def _check_draft_serves_flags(args, draft) -> None:
    """Refuses, in the command line's terms, flags the loaded draft cannot serve (the library
    refuses them too, but in its Python API's terms: `Draft.with_adapter`, `load_draft`)."""
    method = _method(args, draft)
    if method == "ar":
        return
    if draft is None:
        raise ValueError(
            f"--method {method} needs a draft of that variant: pass --draft DIR (or leave out "
            "--target: the default model comes with its draft)"
        )
    variant, draft_dir = draft.config.variant, draft.path
    if method != variant:
        raise ValueError(
            f"--method {method}: the draft at {draft_dir} is a {variant!r} draft; pass --method "
            f"{variant}, or no --method"
        )
    trained = draft.config.block_size
    if args.block_size is not None and args.block_size != trained:
        if not draft.config.causal:
            raise ValueError(
                f"--block-size {args.block_size}: a {variant} draft attends bidirectionally "
                f"within its block, so it drafts only the {trained} positions it was trained on"
            )
        if args.block_size > trained:
            raise ValueError(
                f"--block-size must be at most {trained}, the block the draft at {draft_dir} was "
                f"trained on; got {args.block_size}"
            )
    # Known from the draft's config: refused here, not after the target's (minutes-long) load.
    # (Other methods refuse any refinement pass: the options built with the draft, `check`.)
    most = (args.block_size or trained) - 1
    if method == "jetspec++" and args.refine_passes > most:
        raise ValueError(
            f"--refine-passes must be at most {most} (the block size - 1: each pass fixes at "
            f"least one more of the block's drafts, so later passes change nothing); got "
            f"{args.refine_passes}"
        )
    needing = [f"--{name}" for name in ("refreshes", "foresight") if getattr(args, name)]
    if needing and draft.adapter is None:
        raise ValueError(
            f"{' and '.join(needing)} {'need' if len(needing) > 1 else 'needs'} a draft with an "
            f"adapter, and the draft at {draft_dir} has none: pass a JetSpec++ checkpoint "
            "(`train.py adapter` writes one)"
        )
    if args.foresight and args.foresight_rule == "calibrated" and draft.calibration is None:
        raise ValueError(
            f"--foresight-rule calibrated (the default) scores outcomes with the draft's "
            f"calibration, and the draft at {draft_dir} has none: pass --foresight-rule "
            "uncalibrated, or a calibrated checkpoint (`train.py calibrate` writes one)"
        )


def _method(args, draft) -> str:
    """--method; without it, the draft's own variant, or autoregressive decoding without one."""
    return args.method or (draft.config.variant if draft is not None else "ar")


def _since(start: float) -> float:
    return time.perf_counter() - start


def _decoding_options(args, draft, *, method: str | None = None):
    """The `DecodingOptions` of the command line (validated: a ValueError names the bad value
    by its keyword, the flag's name with underscores, e.g. `refine_passes` for --refine-passes).
    No --method: the draft's own variant, or autoregressive decoding without a draft; `method`
    overrides both (`_check_before_loading`)."""
    from jetspec_jax import DecodingOptions

    if args.prefill_chunk < 0:  # the keyword's own message would hide the flag's 0
        raise ValueError(
            f"--prefill-chunk must be >= 0 (0: each prompt in one forward), got "
            f"{args.prefill_chunk}"
        )
    return DecodingOptions(
        method=method or _method(args, draft),
        refine_passes=args.refine_passes,
        refreshes=args.refreshes,
        replacement_confidence=args.replacement_confidence,
        foresight=args.foresight,
        foresight_rule=args.foresight_rule,
        pipeline=args.pipeline,
        block_size=args.block_size,
        prefill_chunk=args.prefill_chunk or None,
    )


def _serve(args) -> int:
    """The server, until SIGINT/SIGTERM shuts it down."""
    from jetspec_jax.serving import serve  # deferred: --help answers at once

    try:
        _check_before_loading(args, server=True)
        target, draft = _load_models(
            args, check=lambda config, draft: _server_config(args, draft).check_fits(config)
        )
        serve(target, draft, _server_config(args, draft), host=args.host, port=args.port)
    except USAGE_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_before_loading(args, *, server: bool) -> None:
    """Builds what the flags describe before the (possibly minutes-long) model load, so that a
    bad flag fails at once. Without --method, --target without --draft decodes autoregressively;
    otherwise the draft's variant is not known yet, and "jetspec++", which accepts every decoding
    flag another method does, stands in for it (the options are built again, exactly, after the
    load)."""
    from jetspec_jax.flag_paths import require_paths

    if server and args.warmup and min(args.reserve_prompt_tokens, args.reserve_new_tokens) < 1:
        raise ValueError(  # by flag: ServerConfig names its fields
            "--warmup compiles the programs of requests within the reserve: give "
            "--reserve-prompt-tokens and --reserve-new-tokens"
        )
    if args.method == "ar" and args.draft:
        raise ValueError(
            f"--method ar decodes without a draft: drop --draft {args.draft}, or pass the "
            "draft's method (or no --method)"
        )

    def build(method: str):
        if server:
            return _server_config(args, None, method=method).decoding
        return _decoding_options(args, None, method=method)

    without_draft = args.method is None and args.target is not None and not args.draft
    try:
        options = build(args.method or ("ar" if without_draft else "jetspec++"))
    except ValueError as e:
        if not without_draft:
            raise
        try:  # a drafting flag, or one no method accepts?
            build("jetspec++")
        except ValueError:
            raise e from None
        raise ValueError(
            f"{e} (--target without --draft decodes autoregressively: add --draft, or drop the "
            "drafting flags)"
        ) from None
    if options.pipeline is not None:
        from jetspec_jax.decoding.pipeline import pipeline_devices

        pipeline_devices()  # two devices are visible
    if server:
        _check_address(args.host, args.port)
    require_paths("--target", [args.target], directory=True)
    require_paths("--draft", [args.draft], directory=True)


def _check_address(host: str, port: int) -> None:
    """Resolves `host` and binds `port` on each of its addresses, as the server will (then lets
    go), so that a mistyped host or a port in use fails before the model load, not after it."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                probe.bind(address)
            except OSError as e:
                raise ValueError(
                    f"--host {host} --port {port}: cannot bind {address[0]}: {e.strerror}"
                ) from None


def _server_config(args, draft, *, method: str | None = None):
    """The `ServerConfig` of the server flags (without `--model-name`, the server names the
    model: `default_model.served_model_name`)."""
    from jetspec_jax.serving import ServerConfig

    return ServerConfig(
        model_name=args.model_name,
        decoding=_decoding_options(args, draft, method=method),
        api_key=args.api_key or os.environ.get("JETSPEC_API_KEY") or None,
        max_batch_size=args.max_batch_size,
        queue_size=args.queue_size,
        chunk_steps=args.chunk_steps,
        default_max_tokens=args.default_max_tokens,
        max_model_len=args.max_model_len,
        pad_batch=args.pad_batch,
        continuous_batching=not args.static_batching,
        reserve_prompt_tokens=args.reserve_prompt_tokens,
        reserve_new_tokens=args.reserve_new_tokens,
        warmup=args.warmup,
        shutdown_timeout=args.shutdown_timeout,
        keepalive_seconds=args.keepalive_seconds,
    )


def _generate(args) -> int:
    """`generate`: streams the prompt's completion to stdout, then its statistics to stderr."""
    import jetspec_jax
    from jetspec_jax.flag_paths import keywords_named_by_flag
    from jetspec_jax.prompting import (
        encode_prompt,
        has_chat_template,
        require_chat_template,
        require_unicode,
    )
    from jetspec_jax.serving.detokenize import IncrementalDetokenizer

    try:
        # Validate the request before the (slow) model load.
        with keywords_named_by_flag():
            sampling = jetspec_jax.SamplingParams(
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
            )
        for flag, value in (
            ("--max-new-tokens", args.max_new_tokens),
            ("--chunk-steps", args.chunk_steps),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if args.system is not None and args.chat is False:
            raise ValueError(
                "--system is a chat message: it needs the chat template (no --no-chat)"
            )
        if sys.stdout is None:  # `>&-`: Python gives no stdout at all
            raise ValueError("stdout is closed: generate writes the completion there")
        prompt = _read_prompt(args.prompt)
        if args.system is not None:
            require_unicode(args.system, "--system")
        _check_before_loading(args, server=False)
        # The options with the draft's own method (a dflash draft refuses --refine-passes) are
        # checked before the target's weights load, as the server's are.
        target, draft = _load_models(args, check=lambda _, draft: _decoding_options(args, draft))
        options = _decoding_options(args, draft)
        given = {"--chat": args.chat, "--system": args.system is not None}
        if flags := " and ".join(flag for flag, on in given.items() if on):
            require_chat_template(target.tokenizer, target.path, f"drop {flags} (raw prompt)")
        chat = args.chat if args.chat is not None else has_chat_template(target.tokenizer)
        prompt_ids = encode_prompt(target.tokenizer, prompt, chat=chat, system=args.system)
        context = target.config.max_position_embeddings
        if len(prompt_ids) + args.max_new_tokens > context:  # by flag: the library names keywords
            raise ValueError(
                f"the prompt of {len(prompt_ids)} tokens"
                + (" (chat template included)" if chat else "")
                + f" + --max-new-tokens {args.max_new_tokens} exceeds the model's context of "
                f"{context} tokens: shorten the prompt or lower --max-new-tokens"
            )
        request = dict(
            max_new_tokens=args.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
        )
        stream = jetspec_jax.stream(
            target,
            prompt_ids,
            chunk_steps=args.chunk_steps,
            draft=draft,
            **dataclasses.asdict(options),
            **request,
        )
    except USAGE_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # A raw prompt's completion continues its text (a SentencePiece word keeps its leading
    # space); a chat answer is a message of its own.
    detokenizer = IncrementalDetokenizer(target.tokenizer, context=() if chat else prompt_ids)
    for tokens in stream:
        sys.stdout.write(detokenizer.push(tokens))
        sys.stdout.flush()
    sys.stdout.write(detokenizer.flush() + "\n")
    sys.stdout.flush()
    result = stream.result
    print(_statistics_line(options, result), file=sys.stderr)
    print(_speedup_line(args, options, target, prompt_ids, request, result), file=sys.stderr)
    return 0


def _read_prompt(arg: str) -> str:
    """The prompt argument's text, or stdin's for `-`, checked as text a tokenizer takes.

    Raises:
        ValueError: stdin closed or not UTF-8, an empty prompt, or one with surrogates.
    """
    from jetspec_jax.prompting import require_unicode

    if arg == "-" and sys.stdin is None:  # `<&-`: Python gives no stdin at all
        raise ValueError(
            "'-' reads the prompt from stdin, which is closed: give the prompt as an argument"
        )
    try:
        prompt = sys.stdin.read() if arg == "-" else arg
    except UnicodeDecodeError as e:  # a UTF-8 locale's stdin is strict (C's gives surrogates)
        raise ValueError(
            f"the prompt read from stdin is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from e
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    # Bytes that are not UTF-8 (argv, stdin) arrive as surrogates, which no tokenizer takes.
    require_unicode(prompt, "the prompt" + (" read from stdin" if arg == "-" else ""))
    return prompt


def _statistics_line(options, result) -> str:
    """The line after the completion: tokens, decode rate, tau, prefill and compile times."""
    t = result.timing
    # The prefill makes the first token: a decode rate needs a second one.
    rate = result.decode_tokens_per_second if len(result.tokens) > 1 else None
    return (
        f"[{_label(options)}] {len(result.tokens)} tokens ({result.finish_reason}) | "
        f"{'n/a' if rate is None else f'{rate:.1f}'} tokens/s decode | tau {result.tau:.2f} | "
        f"prefill {result.prompt_length} tokens in {t.prefill_seconds:.3f} s | "
        f"compile {t.compile_seconds:.1f} s"
    )


def _label(options) -> str:
    """The method as the statistics line names it, e.g. "jetspec++ K8 J1-R1 F4 mpmd"."""
    label = options.method + (f" K{options.block_size}" if options.block_size else "")
    if options.method != "jetspec++":
        return label
    label += f" J{options.refine_passes}-R{options.refreshes}"
    label += f" F{options.foresight}" if options.foresight else ""
    return label + (f" {options.pipeline}" if options.pipeline else "")


def _speedup_line(args, options, target, prompt_ids, request, result) -> str:
    """The speedup over autoregressive decoding: measured with --compare-ar, else estimated."""
    import jetspec_jax

    if options.method == "ar":
        return "speedup 1.00x (autoregressive decoding is the baseline)"
    if not args.compare_ar:
        return (
            f"speedup not measured (--compare-ar measures it): at most tau = {result.tau:.2f}x, "
            "the tokens per target forward, less the draft's and the block verification's cost "
            "(on a CPU that cost can exceed the gain: see docs/BENCHMARKS.md)"
        )
    # Streamed in the same chunks as the speculative run: both pay the same host round trips.
    ar_stream = jetspec_jax.stream(
        target,
        prompt_ids,
        chunk_steps=args.chunk_steps,
        prefill_chunk=options.prefill_chunk,
        **request,
    )
    for _ in ar_stream:
        pass
    ar = ar_stream.result
    same = "identical" if ar.tokens == result.tokens else "DIFFERENT"
    ar_rate, rate = ar.decode_tokens_per_second, result.decode_tokens_per_second
    speedup = rate / ar_rate if ar_rate > 0 else float("nan")
    return (
        f"speedup {speedup:.2f}x measured: {rate:.1f} vs {ar_rate:.1f} AR tokens/s decode "
        f"(same prompt and streaming chunks, this run; AR output {same})"
    )


def _port(text: str) -> int:
    if not (text.isdigit() and 0 <= int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def _nonempty(text: str) -> str:
    # An unset shell variable (`--draft "$DRAFT"`) must not pass for "no draft", nor an empty
    # host for "every interface".
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _add_model_args(parser: argparse.ArgumentParser, *, subcommand: bool = False) -> None:
    """The model and decoding flags. They are accepted before and after `generate`: the
    subcommand's copies default to SUPPRESS, as their defaults would overwrite the flags given
    before it (argparse copies a subparser's whole namespace over the main one's)."""

    def default(value):
        return argparse.SUPPRESS if subcommand else value

    parser.add_argument(
        "--target",
        type=_nonempty,
        default=default(None),
        help="HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype",
        default=default("float32"),
        choices=["float32", "bfloat16"],
        help="weights, activations and KV caches of the target and draft (default float32; "
        "logits are float32 either way)",
    )
    parser.add_argument(
        "--method",
        default=default(None),
        help="decoding method: ar, dflash, jetspec or jetspec++ (the speculative ones need a "
        "draft of that variant); default: the draft's variant, else ar",
    )
    parser.add_argument(
        "--draft",
        type=_nonempty,
        default=default(None),
        help="draft head directory: DFlash/JetSpec layout or a JetSpec++ checkpoint (default: "
        "the draft shipped for the default model, when --target is not given)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=default(None),
        metavar="K",
        help="speculative methods: draft blocks of K positions, at most the draft's trained "
        "block (causal drafts only); fewer positions to verify per round, cheaper where the "
        "target's forward is compute-bound (a CPU, a large batch); default: as trained",
    )
    parser.add_argument(
        "--refine-passes",
        type=int,
        default=default(0),
        help="jetspec++: Jacobi refinement passes J (default 0)",
    )
    parser.add_argument(
        "--refreshes",
        type=int,
        default=default(0),
        help="jetspec++: context refreshes with anchor replacement R <= J (draft with adapter; "
        "default 0)",
    )
    parser.add_argument(
        "--replacement-confidence",
        type=float,
        default=default(None),
        metavar="C",
        help="jetspec++ with --refreshes: replace a draft token only where the decoder's "
        "probability of its own token exceeds C in [0, 1] (0: every disagreement, the paper's "
        "rule; default: the draft's calibration)",
    )
    parser.add_argument(
        "--foresight",
        type=int,
        default=default(0),
        help="jetspec++: draft the next block ahead for B likely outcomes (draft with adapter; "
        "default 0: off)",
    )
    parser.add_argument(
        "--foresight-rule",
        default=default("calibrated"),
        help="how the B outcomes are chosen: calibrated (the draft's calibration; default; "
        "refused for a draft without one), uncalibrated or geometric",
    )
    parser.add_argument(
        "--pipeline",
        choices=("spmd", "mpmd"),
        default=default(None),
        help="jetspec++ with --foresight >= 1: verify on device 0 while device 1 drafts ahead "
        "(needs >= 2 devices); spmd: one program, each device holding both stages; mpmd: one "
        "program per device, each holding only its stage",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=default(512),
        metavar="N",
        help="prefill prompts longer than N tokens N at a time: activation memory bounded by N, "
        "one compiled prefill for every long prompt (default 512; 0: each prompt in one "
        "forward)",
    )
    parser.add_argument(
        "--chunk-steps",
        type=int,
        default=default(8),
        help="target forwards per streamed chunk (one host round trip each; default 8)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default(False),
        help="log compilation and loading",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_model_args(parser)
    parser.add_argument(
        "--host", type=_nonempty, default="127.0.0.1", help="bind address (default: localhost)"
    )
    parser.add_argument(
        "--port", type=_port, default=8000, help="TCP port (default %(default)s; 0: any free port)"
    )
    parser.add_argument(
        "--model-name",
        type=_nonempty,  # "" would name the model "" (a model_name of None is the default)
        default=None,
        help="the model id clients send (default: SmolLM2-135M-Instruct for the default model, "
        "else the target directory's name)",
    )
    parser.add_argument(
        "--api-key",
        type=_nonempty,  # an unset variable (`--api-key "$KEY"`) must not open the server
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $JETSPEC_API_KEY, else none)",
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=8, help="requests per batch (default %(default)s)"
    )
    parser.add_argument(
        "--queue-size",
        type=int,
        default=64,
        help="waiting requests at most; more get 503 (default %(default)s)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="chat budget when a request has none (default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + completion tokens per request at most (default: the model's context)",
    )
    parser.add_argument(
        "--pad-batch",
        action="store_true",
        help="always decode the power of two >= --max-batch-size rows: one compiled batch shape, "
        "and room for waiting requests to join a running batch",
    )
    parser.add_argument(
        "--static-batching",
        action="store_true",
        help="each batch keeps the requests it started with (default: waiting requests join a "
        "running batch at chunk boundaries, in the rows finished requests left)",
    )
    parser.add_argument(
        "--reserve-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="size every batch's cache for prompts of N tokens at least, so that requests up to "
        "N (with --reserve-new-tokens) can join it, whatever its first requests (memory grows)",
    )
    parser.add_argument(
        "--reserve-new-tokens",
        type=int,
        default=0,
        metavar="N",
        help="size every batch's output buffer for N new tokens at least (see "
        "--reserve-prompt-tokens)",
    )
    parser.add_argument(
        "--warmup",
        action="store_true",
        help="compile the programs of requests within the reserve (both --reserve-* flags) "
        "before the first batch; /health answers 503 until done",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGINT/SIGTERM (default %(default)s)",
    )
    parser.add_argument(
        "--keepalive-seconds",
        type=float,
        default=15.0,
        help="a stream with no text yet gets its headers and an SSE ': keep-alive' comment every "
        "this many seconds until its first text, so that proxies do not time it out (default "
        "%(default)s)",
    )
    commands = parser.add_subparsers(dest="command")
    gen = commands.add_parser("generate", help="stream a completion of one prompt")
    gen.add_argument(
        "prompt",
        nargs="?",
        default=DEFAULT_PROMPT,
        help=f"the prompt text; '-' reads it from stdin (default: {DEFAULT_PROMPT!r})",
    )
    _add_model_args(gen, subcommand=True)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the tokenizer has one)",
    )
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument(
        "--max-new-tokens", type=int, default=128, help="new tokens at most (default %(default)s)"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (the default); >= 1e-5 samples",
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus mass in [0, 1]: 1 disables (the default), 0 keeps only the top token",
    )
    gen.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables (default)"
    )
    gen.add_argument(
        "--seed",
        type=int,
        default=0,
        help="request seed in [0, 2**32); the same seed gives the same tokens (default "
        "%(default)s)",
    )
    gen.add_argument(
        "--compare-ar",
        action="store_true",
        help="also run autoregressive decoding and print the measured speedup",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
