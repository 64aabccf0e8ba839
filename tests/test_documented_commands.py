"""Every command line the markdown documents names only flags its script accepts.

The README and docs/ quote `serve.py`, `train.py`, `python -m jetspec_jax.bench` and
`benchmarks/*.py` commands for users to copy, and docs/BENCHMARKS.md the commands that reproduce
each figure. A renamed or removed flag would leave them failing with a usage error; this test reads
each quoted command's flags against the script's own argparse parser (and subcommand), and applies
each `train.py ... --set key=value` to its training config, whose loader refuses unknown keys.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import shlex

import pytest

from jetspec_jax.training.config import load_train_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [
    "README.md",
    *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md")),
    "jetspec_jax/assets/README.md",
]
SCRIPT = re.compile(
    r"(?:python3? )?(serve\.py|train\.py|-m jetspec_jax\.bench(?:\.load)?|benchmarks/\w+\.py)"
)
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
DEFAULT_CONFIG = ROOT / "configs" / "smollm2_135m.yaml"


def _code_segments(text: str) -> list[str]:
    """Fenced blocks' and indented lines' text, backslash continuations joined, then the inline
    code spans of the prose (which may wrap across lines)."""
    segments, prose, fenced = [], [], False
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            segments.append(line)
        else:
            prose.append(line)
    return segments + re.findall(r"`([^`]+)`", "\n".join(prose))


def _unbracket(word: str) -> str:
    """`[--port` / `8000]` of a usage synopsis's optional parts -> `--port` / `8000`; a value's
    own brackets (`data.files=[a, b]`) stay."""
    if "]" not in word:
        word = word.removeprefix("[")
    if "[" not in word:
        word = word.removesuffix("]")
    return word


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(document, script, words after the script) for every quoted command."""
    found = []
    for document in DOCUMENTS:
        for segment in _code_segments((ROOT / document).read_text()):
            for command in re.split(r"&&|;|\||\n", segment):
                command = command.split(" #")[0]  # a shell comment
                match = SCRIPT.search(command)
                if match:
                    words = [_unbracket(word) for word in shlex.split(command[match.end() :])]
                    found.append((document, match.group(1), words))
    return found


def _parser(script: str) -> argparse.ArgumentParser:
    """The script's `_parser()` (every entry point has one: see the test below)."""
    if script == "-m jetspec_jax.bench":
        script = "-m jetspec_jax.bench.__main__"
    module = importlib.import_module(
        script.removeprefix("-m ").removesuffix(".py").replace("/", ".")
    )
    return module._parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _accepted_flags(script: str, words: list[str]) -> set[str]:
    """The flags a command accepts: its script's, and its subcommand's when it names one."""
    parser = _parser(script)
    subcommands = _subcommands(parser)
    if script == "train.py" and words[:1] and words[0].startswith("--config"):
        words = ["draft", *words]  # `train.py --config X` is `train.py draft --config X`
    if words[:1] and words[0] in subcommands:
        return _flags(parser) | _flags(subcommands[words[0]])
    return _flags(parser)


COMMANDS = documented_commands()


def test_the_documents_quote_commands_of_every_entry_point():
    scripts = {script for _, script, _ in COMMANDS}
    assert {"serve.py", "train.py", "-m jetspec_jax.bench"} <= scripts
    assert any(script.startswith("benchmarks/") for script in scripts)


@pytest.mark.parametrize(
    "script",
    sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text()),
)
def test_every_benchmark_script_parses_its_command_line(script):
    """A script without a parser would run (and rewrite its BENCHMARKS section) on `--help`."""
    module = importlib.import_module(f"benchmarks.{script.removesuffix('.py')}")
    assert isinstance(module._parser(), argparse.ArgumentParser)


@pytest.mark.parametrize(
    "document,script,words",
    COMMANDS,
    ids=[f"{d}:{s}:{' '.join(w)[:40]}" for d, s, w in COMMANDS],
)
def test_documented_flags_exist(document, script, words):
    used = {word.split("=")[0] for word in words if FLAG.fullmatch(word.split("=")[0])}
    unknown = used - _accepted_flags(script, words)
    assert not unknown, f"{document}: `{script} {' '.join(words)}` uses unknown {sorted(unknown)}"


def test_documented_config_overrides_apply():
    """`train.py ... --set key=value`: the key exists and the value has its type."""
    checked = 0
    for document, script, words in COMMANDS:
        if script != "train.py":
            continue
        overrides = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
        config = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--config"), None)
        path = ROOT / config if config and (ROOT / config).is_file() else DEFAULT_CONFIG
        try:
            load_train_config(path, overrides)
        except ValueError as e:
            pytest.fail(f"{document}: `train.py {' '.join(words)}`: {e}")
        checked += len(overrides)
    assert checked > 0
