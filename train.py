"""Train a draft head for a target with jetspec_jax.

    # 1. The target's own responses to training prompts (resumable: rerun the same command), once
    #    per file the config's data.files lists (runs/data/<set>.jsonl for ../shared/data/train/).
    python train.py regenerate --prompts ../shared/data/train/gsm8k_train.jsonl \\
        --out runs/data/gsm8k_train.jsonl [--target DIR] [--batch-size 8] [--max-new-tokens 512]

    # 2. Train the draft (resumes from the run's latest checkpoint; exports <run.dir>/draft).
    #    (2a, the baselines: README.md.)
    python train.py --config configs/smollm2_135m.yaml       # = train.py draft --config ...
    python train.py draft --config CFG --coordinator HOST:PORT --num-processes 2 --process-id 0

    # 2b. Train the adapter for that draft (resumable; exports draft + adapter, a JetSpec++
    #    checkpoint, to <run.dir>/jetspec_pp).
    python train.py adapter --config configs/smollm2_135m.yaml [--draft DIR] [--stop-after N]

    # 3. Tau of a draft through the inference path.
    python train.py evaluate --draft runs/x/draft --prompts ../shared/data/eval/gsm8k_test.jsonl \\
        [--num-prompts 50] [--max-new-tokens 256] [--refine-passes J [--refreshes R]] \\
        [--no-chat] [--system TEXT] [--thinking]   # encode as the training data was

    # 4. Fit the calibration of a JetSpec++ checkpoint (draft + adapter) on held-out regenerated
    #    sequences: refinement's replacement confidence, then the outcome-score temperatures;
    #    writes its calibration.json (the bundle is rewritten atomically).
    python train.py calibrate [--target DIR] --draft runs/x/jetspec_pp --data held_out.jsonl \\
        [--num-rounds 512] [--refine-passes 1 --refreshes 1] [--confidence-grid 0,0.5,0.9,1] \\
        [--replacement-confidence C] [--out DIR] [--report FILE.json]

    # 5. Re-save a draft or JetSpec++ checkpoint in another dtype (e.g. bfloat16 to ship it);
    #    --adapter-from pairs a plain draft with another checkpoint's adapter (same taps).
    python train.py export --draft runs/x/draft --adapter-from runs/y/jetspec_pp --out DIR \\
        [--dtype bfloat16]

Errors (bad arguments, configs, files, checkpoints) print `error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys

logger = logging.getLogger("train")


def main(argv: list[str] | None = None) -> int:
    argv = _with_default_command(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        # Every flag is a command's: argparse would take the flag's value for the command
        # ("invalid choice: '2'").
        flag, command = argv[0].split("=")[0], next((a for a in argv if a in COMMANDS), "COMMAND")
        parser.error(
            f"{flag}: flags follow the command (train.py {command} {flag} ...; commands: "
            f"{', '.join(COMMANDS)})"
        )
    args = parser.parse_args(argv)
    from jetspec_jax.compile_cache import enable_compile_cache  # deferred: --help answers at once
    from jetspec_jax.console import (
        configure_logging,
        discard_stdout,
        escape_what_stdout_cannot_encode,
        log_lines_clear_of_bars,
    )
    from jetspec_jax.interrupts import raise_interrupts_outside_gc_callbacks

    configure_logging(logging.INFO if args.verbose else logging.WARNING)
    escape_what_stdout_cannot_encode()  # not a UnicodeEncodeError mid-output
    enable_compile_cache()
    raise_interrupts_outside_gc_callbacks()  # else a Ctrl-C in JAX's gc callback is lost

    try:
        with log_lines_clear_of_bars():  # `-v`'s lines, logged while a progress bar is drawn
            status = COMMANDS[args.command](args)
        if sys.stdout is not None:  # None: started with stdout closed (`>&-`)
            sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is handled below
        return status
    except BrokenPipeError:  # stdout's reader went away (`train.py ... | head`): stop quietly,
        # as a process SIGPIPE ended would (Python ignores SIGPIPE, so the write raised instead)
        discard_stdout()
        return 141  # 128 + SIGPIPE
    # ValueError: arguments, configs, checkpoints (CheckpointError); OSError: paths, permissions
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # training and regenerate resume from where they were saved
        print("\ninterrupted", file=sys.stderr)
        return 130


def _train(args: argparse.Namespace) -> int:
    """Trains (or resumes) the run a config describes."""
    config = _train_config(args)
    from jetspec_jax.training.trainer import train

    result = train(config, stop_after=args.stop_after)
    if result is None:
        return _stopped(args.stop_after)
    if result.already_finished:
        late = (
            "" if result.eval_tau is None else f"; its final evaluation: tau {result.eval_tau:.2f}"
        )
        print(f"already trained {result.steps} steps; the draft is in {result.export_dir}{late}")
        return 0
    tau = "n/a" if result.eval_tau is None else f"{result.eval_tau:.2f}"
    # No loss when this call trained no step (it re-exported a run whose export was cut short).
    loss = f"loss {result.metrics['loss']:.4f}; " if "loss" in result.metrics else ""
    print(
        f"trained {result.steps} steps; {loss}eval tau {tau}; draft exported to {result.export_dir}"
    )
    return 0


def _stopped(steps: int) -> int:
    """What `--stop-after` ends a training run with."""
    print(f"stopped after {steps} steps; rerun the same command to resume")
    return 0


def _train_config(args: argparse.Namespace):
    """The `draft` and `adapter` commands' config and `--stop-after`, checked before JAX starts;
    then the run's processes joined (before anything loads: JAX's first use must find the hosts
    joined)."""
    from jetspec_jax.training.config import load_train_config

    config = load_train_config(args.config, args.overrides)
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after must be >= 1, got {args.stop_after}")
    _join_hosts(args)
    return config


def _join_hosts(args: argparse.Namespace) -> None:
    """Multi-host: joins the run's processes (`jax.distributed`) when `--coordinator` is given.
    Without it the process counts are refused, not ignored: N single-host runs would otherwise
    write one checkpoint directory."""
    if not args.coordinator:
        if args.num_processes is not None or args.process_id is not None:
            raise ValueError("--num-processes and --process-id need --coordinator HOST:PORT")
        return
    import jax

    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )


def _train_adapter(args: argparse.Namespace) -> int:
    """Trains (or resumes) the adapter of the run a config describes, for its trained draft."""
    config = _train_config(args)
    from jetspec_jax.training.adapter_trainer import train_adapter, trained_draft

    draft = args.draft  # None: <run.dir>/draft, checked by train_adapter alike
    if draft is not None:
        from jetspec_jax.flag_paths import named_by_flag, require_paths

        require_paths("--draft", [draft], directory=True)
        with named_by_flag("--draft", draft):
            draft = trained_draft(config, draft)
    result = train_adapter(config, draft=draft, stop_after=args.stop_after)
    if result is None:
        return _stopped(args.stop_after)
    e = result.evaluation
    if result.already_finished and not e:  # its export, calibration included, is left as it is
        print(
            f"already trained the adapter {result.steps} steps; draft + adapter are in "
            f"{result.export_dir}"
        )
        return 0
    gaps = ", ".join(f"{g:.3f}" for g in e["eval_gap_closed"])
    nmse = ", ".join(f"{x:.4f}" for x in e["eval_nmse"])
    tau = ""
    if "tau_predicted" in e:
        tau = (
            f"; J1-R1 tau {e['tau_predicted']:.2f} predicted vs {e['tau_true']:.2f} true "
            f"({100 * e['tau_ratio']:.1f}%)"
        )
    trained = "already trained" if result.already_finished else "trained"  # late evaluation
    print(
        f"{trained} the adapter {result.steps} steps; normalised MSE per tap [{nmse}]; "
        f"stale-to-true gap closed per tap [{gaps}]{tau}; draft + adapter in {result.export_dir}"
    )
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """Fits the calibration of a JetSpec++ checkpoint (replacement confidence, outcome-score
    temperatures) and stores it in the checkpoint."""
    from jetspec_jax.flag_paths import named_by_flag, require_paths

    _require_at_least_one(args, "num_rounds", "anchors_per_sequence", "max_length")
    _check_refreshes(args)
    require_paths("--draft", [args.draft], directory=True)
    require_paths("--data", args.data)
    _check_greedy(args.data)
    import jetspec_jax
    from jetspec_jax.checkpoint.atomic import check_can_write
    from jetspec_jax.checkpoint.bundle import is_bundle, read_manifest
    from jetspec_jax.checkpoint.roles import replaces_only
    from jetspec_jax.draft import load_draft_for_config
    from jetspec_jax.target import load_target_config
    from jetspec_jax.training.calibrate import SETTING_NAMES, calibrate, check_settings
    from jetspec_jax.training.calibration_rounds import check_dense_target, distinct_sequences
    from jetspec_jax.training.data import read_regenerated

    # The settings `calibrate` refuses, refused now in the flags' terms, not after the loads.
    check_settings(
        replacement_confidence=args.replacement_confidence,
        confidence_grid=args.confidence_grid,
        refreshes=args.refreshes,
        holdout_fraction=args.holdout_fraction,
        names={name: _flag(name) for name in SETTING_NAMES},
    )
    if not is_bundle(args.draft):
        raise ValueError(
            f"--draft {args.draft} is not a JetSpec++ checkpoint (no jetspec_pp.json): "
            "calibration needs the draft's adapter"
        )
    stored_dtype = read_manifest(args.draft)["dtype"]
    out = pathlib.Path(args.out or args.draft)
    if out.is_symlink() or out.exists():  # a dangling symlink too: the save would refuse it
        if out.resolve() != pathlib.Path(args.draft).resolve():
            raise ValueError(f"--out {out} exists and is not --draft; not replacing it")
        out = out.resolve()  # in place: where a symlinked checkpoint lies
    # Refused now, not after the fit: the calibration and the report are written there last.
    _check_can_write("--out", out)
    check_can_write(out, overwrite=out.exists(), refuse=replaces_only("draft"))
    report_path = None if args.report is None else pathlib.Path(args.report)
    if report_path is not None:
        _check_report_path(report_path, out)
    # A hybrid target is refused from its config, not after its weights load.
    target_config = load_target_config(args.target)
    try:
        check_dense_target(target_config)
    except ValueError as e:
        raise ValueError(f"--target {args.target}: {e}") from None  # never the default: it is dense
    # The draft is read against the target's config, not after its weights load (minutes for a
    # large target); served in the target's dtype, as `load_draft(args.draft, target)` gives it.
    with named_by_flag("--draft", args.draft, default_target=args.target is None):
        draft = load_draft_for_config(args.draft, target_config, dtype=args.dtype)
    target = jetspec_jax.load_target(args.target, dtype=args.dtype)
    records, repeats = distinct_sequences(
        read_regenerated(args.data, vocab_size=target.config.vocab_size)
    )
    if repeats:
        logger.warning(
            "--data: %d records repeat an earlier record's sequence and are left out (a copy on "
            "each side of the held-out split would flatter the held-out figures)",
            repeats,
        )
    result = calibrate(
        target,
        draft,
        records,
        refine_passes=args.refine_passes,
        refreshes=args.refreshes,
        replacement_confidence=args.replacement_confidence,
        confidence_grid=args.confidence_grid,
        holdout_fraction=args.holdout_fraction,
        num_rounds=args.num_rounds,
        anchors_per_sequence=args.anchors_per_sequence,
        max_length=args.max_length,
        seed=args.seed,
    )
    from jetspec_jax.console import reader_may_leave

    with reader_may_leave():  # `| head`: the fit is saved all the same
        _print_calibration(result, f"J{args.refine_passes}-R{args.refreshes}")
    # The figures above are printed even if a write fails. The checkpoint first: a report that
    # fails (its place was checked above, but a disk may fill) must not cost the fit. Saved in
    # the checkpoint's own dtype (a bfloat16 target must not round fp32 weights).
    if draft.dtype != stored_dtype:
        draft = jetspec_jax.load_draft(args.draft, target, dtype=stored_dtype)
    draft.with_adapter(draft.adapter, result.calibration).save(out, overwrite=out.exists())
    print(f"calibration saved in {out / 'calibration.json'}")
    if report_path is not None:
        report = {"refine_passes": args.refine_passes, "refreshes": args.refreshes}
        _write_report(report_path, report | result.report(), out)
    return 0


def _check_report_path(report_path: pathlib.Path, out: pathlib.Path) -> None:
    """Refuses a `--report` path that calibrate could not write after its fit: no file path in
    an existing directory, one that takes no new files, or one inside the checkpoint `out` the
    calibration replaces."""
    if report_path.is_dir() or not report_path.parent.is_dir():
        raise ValueError(f"--report {report_path}: not a file path in an existing directory")
    _check_can_write("--report", report_path)
    if out.resolve() in report_path.resolve().parents:
        raise ValueError(
            f"--report {report_path} lies in the checkpoint the calibration replaces ({out}), "
            "which would delete it: write it elsewhere"
        )


def _write_report(report_path: pathlib.Path, report: dict, out: pathlib.Path) -> None:
    """Writes calibrate's JSON report; a failure is named by the flag, and says that the
    calibration itself was saved (in `out`)."""
    import json

    from jetspec_jax.checkpoint.atomic import write_text_atomically

    try:
        write_text_atomically(report_path, json.dumps(report, indent=2) + "\n")
    except OSError as e:
        raise OSError(
            f"--report {report_path}: not written ({e.strerror or e}); the calibration is saved "
            f"in {out}"
        ) from e


def _print_calibration(result, setting: str) -> None:
    """`calibrate`'s summary: the confidence (its grid's scores when fitted), the rounds, the
    temperatures, and their held-out log-likelihood and hit rates."""
    calibration, fit = result.calibration, result.confidence_fit
    confidence = calibration.replacement_confidence
    if fit is not None:
        print(
            f"replacement confidence: tau per round ({setting}) on {fit.rounds} fit and "
            f"{fit.held_out_rounds} held-out rounds"
        )
        print("  confidence     fit  held out")
        for value, tau in fit.tau.items():
            chosen = "  <- fitted" if value == confidence else ""
            print(f"  {value:>10.2f}  {tau:.4f}  {fit.held_out_tau[value]:.4f}{chosen}")
    else:
        source = {
            "given": "given, not fitted",
            "kept": "the checkpoint's, kept: R0 does not use it",
        }[result.confidence_source]
        print(f"replacement confidence: {confidence:.2f} ({source})")
    print(
        f"calibration rounds: {len(result.rounds)} ({setting}; fit {result.fit_rounds}, held out "
        f"{result.held_out_rounds}; {result.rounds.dropped} dropped: not the target's greedy "
        "continuation)"
    )
    print(
        f"fitted acceptance_temperature {calibration.acceptance_temperature:.4f}, "
        f"bonus_temperature {calibration.bonus_temperature:.4f}"
    )
    ll = result.held_out["log_likelihood"]
    print(
        f"held-out log-likelihood per round: uncalibrated {ll['uncalibrated']:.4f} -> "
        f"calibrated {ll['calibrated']:.4f} nats"
    )
    hit_rate = result.held_out["hit_rate"]
    budgets = list(next(iter(hit_rate.values())))
    print("held-out hit rate  " + "".join(f"{'B=' + str(b):>8}" for b in budgets))
    for rule, rates in hit_rate.items():
        print(f"  {rule:<16}" + "".join(f"{rates[b]:>8.3f}" for b in budgets))


def _check_greedy(data_files: list[str]) -> None:
    """Refuses `--data` that `train.py regenerate` sampled (temperature > 0): calibration scores
    the drafts against the target's greedy continuation (`calibration_rounds`), which sampled
    responses are not; their rounds that depart from it are dropped, and the rest bias the fit
    toward where sampling happened to pick the greedy token. Files without recorded settings
    (written before they were recorded, or not by `regenerate`) are accepted: nothing says how
    they were generated, and greedy data written then is still valid."""
    from jetspec_jax.data.regenerate import recorded_temperature

    for path in data_files:
        temperature = recorded_temperature(path)
        if temperature is not None and temperature > 0:
            raise ValueError(
                f"--data {path} was regenerated at temperature {temperature:g} (its "
                ".settings.json says); calibration needs greedy data: regenerate it with "
                "--temperature 0"
            )


def _export(args: argparse.Namespace) -> int:
    """Re-saves a draft or JetSpec++ checkpoint in `--dtype`, optionally with another adapter."""
    from jetspec_jax.checkpoint.adapter_files import check_takes_an_adapter
    from jetspec_jax.checkpoint.bundle import is_bundle
    from jetspec_jax.draft import load_draft_for_config
    from jetspec_jax.flag_paths import named_by_flag, require_paths
    from jetspec_jax.target import load_target_config

    out = pathlib.Path(args.out)
    if out.is_symlink() or out.exists():  # a dangling symlink too: the save would refuse it
        raise ValueError(f"--out {out} exists; not replacing it")
    require_paths("--draft", [args.draft], directory=True)
    require_paths("--adapter-from", [args.adapter_from], directory=True)
    if args.adapter_from is not None and not is_bundle(args.adapter_from):
        raise ValueError(f"--adapter-from {args.adapter_from} is not a JetSpec++ checkpoint")
    _check_can_write("--out", out)
    # The target's architecture checks the drafts; its weights are not needed to re-save them.
    target_config = load_target_config(args.target)
    with named_by_flag("--draft", args.draft, default_target=args.target is None):
        draft = load_draft_for_config(args.draft, target_config, dtype=args.dtype)
    if args.adapter_from is not None:
        if draft.adapter is not None:
            raise ValueError(f"--draft {args.draft} already has an adapter")
        with named_by_flag("--draft", args.draft):
            check_takes_an_adapter(draft.config)
        with named_by_flag("--adapter-from", args.adapter_from, default_target=args.target is None):
            donor = load_draft_for_config(args.adapter_from, target_config, dtype=args.dtype)
            # Without its calibration: that was fitted to the donor's draft (train.py calibrate).
            draft = draft.with_adapter(donor.adapter)
    draft.save(out)
    parts = "draft" + (" + adapter" if draft.adapter is not None else "")
    parts += " + calibration" if draft.calibration is not None else ""
    print(f"{parts} saved in {args.dtype} to {out}")
    return 0


def _check_can_write(flag: str, path) -> None:
    """Refuses, before the slow load, an output file or directory `flag` names that could not be
    made once the work is done (the work would be lost): under a file, or in a place that takes
    no new files.

    Raises:
        NotADirectoryError, PermissionError: naming the flag, the path and the reason (not the
            write's temporary file).
    """
    from jetspec_jax.checkpoint.atomic import check_takes_new_files

    check_takes_new_files(pathlib.Path(path).parent, named=f"{flag} {path}")


def _check_refreshes(args: argparse.Namespace) -> None:
    """`Jj-Rr` refreshes before refinement passes: at most one before each of them."""
    if args.refreshes > args.refine_passes:
        raise ValueError(
            f"--refreshes {args.refreshes} exceeds --refine-passes {args.refine_passes} (one "
            "refresh before each of the first R passes)"
        )


def _evaluate(args: argparse.Namespace) -> int:
    """Prints the tau a draft reaches on prompts through the inference path."""
    import jetspec_jax
    from jetspec_jax.data.regenerate import check_room_for_a_prompt
    from jetspec_jax.draft import load_draft_for_config
    from jetspec_jax.flag_paths import named_by_flag, require_paths
    from jetspec_jax.prompting import PromptEncoding
    from jetspec_jax.target import load_target_config, require_tokenizer
    from jetspec_jax.training.evaluate import (
        encoded_prompts,
        eval_prompt_records,
        first_text_prompt,
        prompts_tau,
    )

    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts and --max-new-tokens must be >= 1")
    _check_refreshes(args)
    encoding = _prompt_encoding(args)
    if encoding == PromptEncoding():  # no flag: the template if the tokenizer has one, else raw
        encoding = None
    require_paths("--draft", [args.draft], directory=True)
    require_paths("--prompts", [args.prompts])
    # The prompts and the draft are checked against the target's config alone, before its
    # weights load (minutes for a large target); the draft is the one `load_draft` would give.
    target_config = load_target_config(args.target)
    context = target_config.max_position_embeddings
    check_room_for_a_prompt(args.max_new_tokens, context, "--max-new-tokens")
    records = eval_prompt_records(
        args.prompts, num_prompts=args.num_prompts, vocab_size=target_config.vocab_size
    )
    ids = [(where, r["prompt_ids"]) for where, r in records if "prompt_ids" in r]
    _check_prompts_fit(ids, args.max_new_tokens, context)  # text prompts: once encoded
    with named_by_flag("--draft", args.draft, default_target=args.target is None):
        draft = load_draft_for_config(args.draft, target_config, dtype=args.dtype)
    _check_draft_takes_passes(args, draft)
    if text := first_text_prompt(records):
        require_tokenizer(
            args.target, f"--target {args.target}", f"{text} is a text prompt, which needs one"
        )
    target = jetspec_jax.load_target(args.target, dtype=args.dtype)
    _check_chat_template(encoding, target)
    prompts = encoded_prompts(target, records, encoding=encoding)
    located = zip([where for where, _ in records], prompts, strict=True)
    _check_prompts_fit(located, args.max_new_tokens, context)
    tau = prompts_tau(
        target,
        draft,
        prompts,
        max_new_tokens=args.max_new_tokens,
        refine_passes=args.refine_passes,
        refreshes=args.refreshes,
        show_progress=None,
    )
    setting = f"J{args.refine_passes}" + (f"-R{args.refreshes}" if args.refreshes else "")
    print(f"tau {tau:.3f} ({draft.config.variant}, {setting}, {len(prompts)} prompts)")
    return 0


def _check_prompts_fit(located_ids, max_new_tokens: int, context: int) -> None:
    """Refuses a prompt, named by `file:line` (`located_ids`: `(file:line, token ids)` pairs),
    with no room for `--max-new-tokens` in the target's `context`: generation would name it by its
    index in the batch, and the budget by the library's keyword."""
    for where, ids in located_ids:
        if len(ids) + max_new_tokens > context:
            raise ValueError(
                f"{where}: a prompt of {len(ids)} tokens + --max-new-tokens {max_new_tokens} "
                f"exceeds the target's context of {context} tokens"
            )


def _prompt_encoding(args: argparse.Namespace):
    """The `PromptEncoding` of `--no-chat`, `--system` and `--thinking` (regenerate, evaluate).

    Raises:
        ValueError: a chat-template setting with `--no-chat`, or a `--system` that is not Unicode.
    """
    from jetspec_jax.prompting import PromptEncoding, require_unicode

    for flag, given in (("--system", args.system is not None), ("--thinking", args.thinking)):
        if given and not args.chat:
            raise ValueError(f"{flag} is a chat-template setting; drop --no-chat")
    if args.system is not None:
        require_unicode(args.system, "--system")  # bytes that are not UTF-8, read as surrogates
    return PromptEncoding(chat=args.chat, system=args.system, thinking=args.thinking)


def _check_chat_template(encoding, target) -> None:
    """Refuses the chat template (the default) for a target without one, naming the flags that
    encode raw prompts and the target, before any prompt is encoded. `encoding` None: evaluate's
    default, the template only if the tokenizer has one."""
    from jetspec_jax.prompting import require_chat_template

    if encoding is None or not encoding.chat or target.tokenizer is None:
        return
    given = {"--system": encoding.system is not None, "--thinking": encoding.thinking}
    drop = " and ".join(flag for flag, on in given.items() if on)
    remedy = f"drop {drop} and pass --no-chat" if drop else "pass --no-chat"
    require_chat_template(target.tokenizer, target.path, remedy + " (raw prompts)")


def _check_draft_takes_passes(args: argparse.Namespace, draft) -> None:
    """Refuses `--refine-passes` for a one-pass draft and `--refreshes` without an adapter, naming
    the flags rather than the library's arguments."""
    if args.refine_passes and draft.config.variant != "jetspec++":
        raise ValueError(
            f"--refine-passes refines JetSpec++ drafts; --draft {args.draft} is a "
            f"{draft.config.variant} draft, which drafts in one pass (drop the flag)"
        )
    if args.refreshes and draft.adapter is None:
        raise ValueError(
            f"--refreshes needs an adapter; --draft {args.draft} has none: pass a JetSpec++ "
            "checkpoint (train.py adapter writes one)"
        )


def _regenerate(args: argparse.Namespace) -> int:
    """Validates the request, loads the target, and runs `regenerate`."""
    import jetspec_jax
    from jetspec_jax.data.regenerate import (
        check_output_path,
        check_room_for_a_prompt,
        read_records,
        regenerate,
    )
    from jetspec_jax.flag_paths import keywords_named_by_flag
    from jetspec_jax.target import load_target_config, require_tokenizer

    # Validate everything cheap (arguments, prompt files) before the slow model load.
    with keywords_named_by_flag():
        sampling = jetspec_jax.SamplingParams(temperature=args.temperature, seed=args.seed)
    _require_at_least_one(args, "batch_size", "max_new_tokens")
    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    encoding = _prompt_encoding(args)
    check_output_path(args.out, args.prompts)
    _check_can_write("--out", args.out)
    read_records(args.prompts)
    context = load_target_config(args.target).max_position_embeddings
    check_room_for_a_prompt(args.max_new_tokens, context, "--max-new-tokens")
    require_tokenizer(args.target, f"--target {args.target}", "regenerate encodes text prompts")
    target = jetspec_jax.load_target(args.target, dtype=args.dtype)
    _check_chat_template(encoding, target)
    summary = regenerate(
        target,
        args.prompts,
        args.out,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        chat=encoding.chat,
        system=encoding.system,
        thinking=encoding.thinking,
        limit=args.limit,
        sampling=sampling,
    )
    print(
        f"regenerated {summary.written} responses into {args.out} in {summary.seconds:.1f} s "
        f"({summary.cut_at_budget} cut at --max-new-tokens; {summary.total} prompts: "
        f"{summary.skipped_existing} already there, {summary.skipped_too_long} too long for the "
        "context)"
    )
    return 0


def _with_default_command(argv: list[str]) -> list[str]:
    """`train.py --config X` (its flags in any order, no command named) is the main job, `draft`."""
    config = any(a == "--config" or a.startswith("--config=") for a in argv)
    if config and argv[0].startswith("-") and not set(argv) & set(COMMANDS):
        return ["draft", *argv]
    return argv


def _flag(name: str) -> str:
    """The flag of an argparse destination: `max_new_tokens` -> `--max-new-tokens`."""
    return "--" + name.replace("_", "-")


def _require_at_least_one(args: argparse.Namespace, *names: str) -> None:
    """Refuses a count flag below 1, by flag; one not given (None) passes."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{_flag(name)} must be >= 1, got {value}")


def _float_list(text: str) -> list[float]:
    """`--flag 0,0.5,1` -> [0.0, 0.5, 1.0] (argparse reports the errors as usage errors)."""
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} holds no value: give e.g. 0,0.5,1")
    return values


def _count(text: str) -> int:
    """An integer >= 0 (refinement passes, refreshes, a seed), checked before any model loads."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_config_args(parser: argparse.ArgumentParser, config_help: str, example: str) -> None:
    """`--config` and its `--set` overrides (`draft`, `adapter`; `_train_config` reads them)."""
    parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help=f"override a config value (repeatable), e.g. --set {example}",
    )


def _add_multihost_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", default=None, help="multi-host: coordinator HOST:PORT")
    parser.add_argument("--num-processes", type=int, default=None, help="with --coordinator")
    parser.add_argument("--process-id", type=int, default=None, help="with --coordinator")


COMMANDS = {  # the subcommands `_parser` declares, and what runs each
    "regenerate": _regenerate,
    "draft": _train,
    "adapter": _train_adapter,
    "evaluate": _evaluate,
    "calibrate": _calibrate,
    "export": _export,
}


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at info level (loading, compiling, progress)",
    )


def _add_encoding_args(parser: argparse.ArgumentParser, what: str = "prompts") -> None:
    """`--no-chat`, `--system`, `--thinking`: how `what` are encoded (`_prompt_encoding`)."""
    parser.add_argument(
        "--no-chat", dest="chat", action="store_false", help=f"raw {what}, no chat template"
    )
    parser.add_argument("--system", default=None, help="system message (chat only)")
    parser.add_argument(
        "--thinking", action="store_true", help="the chat template's enable_thinking (Qwen3)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    regen = commands.add_parser(
        "regenerate", help="write the target's responses to prompt files (resumable JSONL)"
    )
    regen.add_argument(
        "--prompts", nargs="+", required=True, metavar="FILE", help="JSONL prompt files"
    )
    regen.add_argument(
        "--out", required=True, metavar="FILE", help="output JSONL (resumed if it exists)"
    )
    regen.add_argument(
        "--target",
        default=None,
        help="HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    regen.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the target's weights, activations and KV caches (default %(default)s)",
    )
    regen.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="rows decoded at once; a finished row takes the next prompt (continuous batching)",
    )
    regen.add_argument(
        "--max-new-tokens",
        type=int,
        default=512,
        help="response tokens per prompt at most; prompts with no room for them in the context "
        "are skipped (default %(default)s)",
    )
    regen.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    _add_encoding_args(regen)
    regen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    regen.add_argument("--seed", type=int, default=0, help="base of the per-prompt sampling seeds")
    _add_verbose(regen)

    draft = commands.add_parser("draft", help="train a draft from a YAML config (resumable)")
    _add_config_args(draft, "training config (see configs/)", "draft.variant=dflash")
    draft.add_argument("--stop-after", type=int, default=None, help="run at most N steps now")
    _add_multihost_args(draft)
    _add_verbose(draft)

    adapter = commands.add_parser(
        "adapter", help="train the adapter for a trained draft from a YAML config (resumable)"
    )
    _add_config_args(adapter, "training config (its adapter section)", "adapter.optim.steps=200")
    adapter.add_argument(
        "--draft", default=None, help="the trained draft's directory (default: <run.dir>/draft)"
    )
    adapter.add_argument("--stop-after", type=int, default=None, help="run at most N steps now")
    _add_multihost_args(adapter)
    _add_verbose(adapter)

    calibrate = commands.add_parser(
        "calibrate",
        help="fit a JetSpec++ checkpoint's calibration (replacement confidence, outcome-score "
        "temperatures) on held-out regenerated sequences",
    )
    calibrate.add_argument("--draft", required=True, help="JetSpec++ checkpoint (draft + adapter)")
    calibrate.add_argument(
        "--data",
        nargs="+",
        required=True,
        metavar="FILE",
        help="held-out JSONL of `train.py regenerate` (greedy), not the draft's training data",
    )
    calibrate.add_argument(
        "--target", default=None, help="HF directory (default: SmolLM2-135M-Instruct)"
    )
    calibrate.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="target and draft compute in it (default %(default)s); the checkpoint is saved in "
        "its own dtype",
    )
    calibrate.add_argument("--num-rounds", type=int, default=512, help="rounds to collect")
    calibrate.add_argument(
        "--anchors-per-sequence", type=int, default=16, help="anchors per sequence (one batch)"
    )
    calibrate.add_argument(
        "--refine-passes",
        type=_count,
        default=1,
        help="J of the served Jj-Rr (default %(default)s, unlike evaluate's 0)",
    )
    calibrate.add_argument(
        "--refreshes",
        type=_count,
        default=1,
        help="R of the served Jj-Rr (default %(default)s, unlike evaluate's 0; 0: no replacement "
        "confidence is fitted)",
    )
    calibrate.add_argument(
        "--confidence-grid",
        type=_float_list,
        default=None,
        metavar="C,C,...",
        help="replacement confidences tried, the best tau per round on the fit sequences wins "
        "(default: seven from 0 to 1, training/replacement_fit.py)",
    )
    calibrate.add_argument(
        "--replacement-confidence",
        type=float,
        default=None,
        metavar="C",
        help="store this replacement confidence instead of fitting one (0: the paper's rule)",
    )
    calibrate.add_argument(
        "--holdout-fraction",
        type=float,
        default=0.2,
        help="fraction of the sequences held out of both fits, whose rounds score them (tau by "
        "confidence, hit rates, log-likelihood)",
    )
    calibrate.add_argument(
        "--max-length", type=int, default=None, help="truncate sequences (default: the target's)"
    )
    calibrate.add_argument("--seed", type=_count, default=0, help="sequence order, anchors, split")
    calibrate.add_argument(
        "--out", default=None, help="new checkpoint to write (default: rewrite --draft in place)"
    )
    calibrate.add_argument(
        "--report", default=None, metavar="FILE", help="also write a JSON report"
    )
    _add_verbose(calibrate)

    export = commands.add_parser(
        "export", help="re-save a draft or JetSpec++ checkpoint in a dtype, or with an adapter"
    )
    export.add_argument("--draft", required=True, help="draft or JetSpec++ checkpoint directory")
    export.add_argument("--out", required=True, help="directory to write (must not exist)")
    export.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the saved weights' dtype (default %(default)s, whatever the --draft checkpoint's)",
    )
    export.add_argument(
        "--adapter-from",
        default=None,
        metavar="DIR",
        help="JetSpec++ checkpoint whose adapter to pair with a plain --draft (its calibration "
        "is not carried over: rerun train.py calibrate)",
    )
    export.add_argument(
        "--target", default=None, help="HF directory (default: SmolLM2-135M-Instruct)"
    )
    _add_verbose(export)

    evaluate = commands.add_parser("evaluate", help="tau of a draft on prompts (inference path)")
    evaluate.add_argument(
        "--draft", required=True, help="draft directory, or a JetSpec++ checkpoint"
    )
    evaluate.add_argument("--prompts", required=True, help="JSONL prompt file")
    evaluate.add_argument(
        "--target", default=None, help="HF directory (default: SmolLM2-135M-Instruct)"
    )
    evaluate.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="target and draft compute in it (default %(default)s)",
    )
    evaluate.add_argument(
        "--num-prompts",
        type=int,
        default=50,
        help="the first N prompts of --prompts (default %(default)s)",
    )
    evaluate.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="new tokens per prompt at most (default %(default)s)",
    )
    evaluate.add_argument(
        "--refine-passes", type=_count, default=0, help="J of Jj-Rr (default %(default)s)"
    )
    evaluate.add_argument(
        "--refreshes",
        type=_count,
        default=0,
        help="R of Jj-Rr (a JetSpec++ checkpoint; default %(default)s)",
    )
    _add_encoding_args(evaluate, what="text prompts")
    _add_verbose(evaluate)
    return parser


if __name__ == "__main__":
    sys.exit(main())
