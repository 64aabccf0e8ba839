"""Writing a directory, or a file, so that it either appears complete or not at all."""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator

# Files that mark a directory `overwrite=True` may replace: an HF / plain-draft checkpoint, a
# JetSpec++ bundle (`bundle.MANIFEST`; not imported: bundle.py imports this module).
_CHECKPOINT_MARKERS = ("config.json", "jetspec_pp.json")


# A reason not to replace an existing checkpoint directory (a target when a draft is written, say),
# or None to allow it.
Refusal = Callable[[pathlib.Path], str | None]


@contextlib.contextmanager
def atomic_directory(
    out_dir: str | os.PathLike, *, overwrite: bool = False, refuse: Refusal | None = None
) -> Iterator[pathlib.Path]:
    """Yields a temporary sibling of `out_dir` to fill; renames it to `out_dir` on success.

    A crash or kill while the body runs leaves at most a hidden `.{name}.tmp-*` sibling, never a
    half-written `out_dir`, so readers can trust that `out_dir` existing means it is complete. On an
    exception the temporary directory is removed and the exception propagates.

    Replacing an existing `out_dir` takes two renames (the old one aside, the new one in), so for
    that moment `out_dir` is absent (a reader then finds nothing, never a mix); a crash exactly
    there leaves the previous copy in a hidden `.{name}.old-*` sibling. If the second rename fails,
    the previous copy is put back before the error propagates.

    Args:
        out_dir: the directory to create.
        overwrite: replace an existing `out_dir` (removed only after the new one is complete;
            if another writer creates `out_dir` while the body runs, ours replaces theirs).
            Only a checkpoint directory is replaced (one holding `config.json` or
            `jetspec_pp.json`) or an empty one; anything else there (a file, a symlink, another
            directory tree) is refused, before any work or just before the rename.
            Without it an existing `out_dir` is an error raised before any work; and if another
            writer creates `out_dir` while the body runs, theirs is kept and ours discarded.
        refuse: with `overwrite`, what else the existing checkpoint may not be (its reason
            becomes the error): a draft's writer refuses to replace a target, and the reverse.

    `out_dir` is checked again just before the final rename, since POSIX `rename` would silently
    replace an *empty* directory there (it fails on anything else). What remains unguarded (the
    standard library has no rename that refuses to replace) is an empty directory created in the
    instant between that check and the rename: ours replaces it. And with `overwrite`, a
    directory created in the instant between the check for an old copy and the rename is kept
    like another writer's without it.

    Raises:
        FileExistsError: without `overwrite`, `out_dir` exists before the body runs (a dangling
            symlink included); with it, something other than a checkpoint or empty directory is
            there; or a non-directory appears at `out_dir` while it runs (there is no copy to
            keep).
        NotADirectoryError: a parent of `out_dir` is a file.
        OSError: writing failed (a full disk, say); an error that names no file (as a failed
            write's does) or the temporary directory or one in it (gone by then, or never made:
            a place that takes no new entry) names `out_dir`.
    """
    out = pathlib.Path(out_dir)
    _check_destination(out, overwrite, refuse)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    except OSError as e:  # a place that takes no new entry: named, not the name never made
        if e.errno is None:
            raise
        raise _named(e, out) from e
    try:
        yield tmp
        _finalize_tree(tmp)
        if overwrite and os.path.lexists(out):
            _check_replaceable(out, refuse)  # again: it may have been replaced meanwhile
            old = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            try:
                os.replace(out, old / out.name)
            except BaseException:
                old.rmdir()  # nothing was moved into it
                raise
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old / out.name, out)  # the previous copy back, not left hidden
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        elif not _rename_to_new(tmp, out):
            shutil.rmtree(tmp, ignore_errors=True)  # another writer finished first: theirs kept
        _fsync_dir(out.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno is not None and _names_nothing_but(e, tmp):
            raise _named(e, out) from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _named(error: OSError, path: pathlib.Path) -> OSError:
    """`error` (one with an errno) naming `path` in place of the temporary file it names, or of
    no file; of the same subclass (`PermissionError`, say)."""
    return OSError(error.errno, error.strerror, str(path))


def _names_nothing_but(error: OSError, tmp: pathlib.Path) -> bool:
    """Whether `error` names no file, or only the temporary `tmp` (a file or directory) or one
    in it."""
    if error.filename is None:
        return True
    if not isinstance(error.filename, str | bytes | os.PathLike):
        return False
    return pathlib.Path(os.fsdecode(error.filename)).is_relative_to(tmp)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Writes `text` (UTF-8) to `path` through a flushed hidden sibling and one rename: a crash
    leaves the old file or none, never half of one.

    Raises:
        OSError: the write failed (a full disk, say), naming `path`: a failed write names no
            file, and the hidden sibling's name (gone by then, or never made: a missing or
            read-only directory) would read as the one at fault.
    """
    path = pathlib.Path(path)
    # A name of its own (two writers of one path must not share one), created as `open` creates
    # files (mode 0666 under the umask; mkstemp's would be owner-only).
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:  # a missing or read-only directory: not the sibling that never was
        if e.errno is None:
            raise
        raise _named(e, path) from e
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno is not None and _names_nothing_but(e, tmp):
            raise _named(e, path) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_can_write(
    out_dir: str | os.PathLike, *, overwrite: bool = False, refuse: Refusal | None = None
) -> None:
    """Refuses, before long work, what `atomic_directory(out_dir, overwrite=..., refuse=...)`
    would refuse at its start, and a place that takes no new files (a read-only install, say):
    a command whose result goes there checks it first rather than lose that work.

    Raises:
        FileExistsError, NotADirectoryError: as `atomic_directory`.
        PermissionError: the nearest existing parent of `out_dir` takes no new entry.
    """
    out = pathlib.Path(out_dir)
    _check_destination(out, overwrite, refuse)
    try:
        check_takes_new_files(out.parent)
    except PermissionError as e:
        raise PermissionError(f"cannot write {out}: {e}") from e


def check_takes_new_files(directory: str | os.PathLike, *, named: str | None = None) -> None:
    """Refuses, before long work, a `directory` to write in (made if missing) where no new file
    can be made: probed with a temporary file in it, or in its nearest existing parent when it is
    missing (as root reads every mode as writable, its mode would not tell).

    Args:
        directory: where the output will be written.
        named: the output as the caller's user gave it (`--out FILE`, `run.dir DIR`); the error
            then reads "<named>: cannot write it: <reason>".

    Raises:
        NotADirectoryError: that nearest existing path is a file.
        PermissionError: it takes no new file; named with the system's reason, not the probe's
            temporary name (which would read as the file that failed).
    """
    directory = pathlib.Path(directory)
    place = next(p for p in (directory, *directory.parents) if p.exists())
    prefix = "" if named is None else f"{named}: cannot write it: "
    if not place.is_dir():
        raise NotADirectoryError(f"{prefix}{place} is a file")
    try:
        tempfile.TemporaryFile(dir=place).close()
    except OSError as e:
        raise PermissionError(f"{prefix}{place} takes no new files ({e.strerror or e})") from e


def _check_destination(out: pathlib.Path, overwrite: bool, refuse: Refusal | None) -> None:
    """`atomic_directory`'s checks before any work (see its Raises)."""
    # `lexists`, not `exists`: a dangling symlink is an entry too, refused now, not after the work.
    if os.path.lexists(out):
        if not overwrite:
            raise FileExistsError(f"{out} already exists; pass overwrite=True to replace it")
        _check_replaceable(out, refuse)
    for parent in out.parents:  # mkdir would say only "File exists", naming the file
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"cannot write {out}: {parent} is a file")
            break


def _check_replaceable(out: pathlib.Path, refuse: Refusal | None = None) -> None:
    """Refuses to let `overwrite` replace (and so delete) anything but one of our or HF's
    checkpoint directories, or an empty directory: a mistyped path must not cost a tree; nor a
    checkpoint `refuse` gives a reason not to replace."""
    if out.is_symlink() or not out.is_dir():
        kind = "a symlink" if out.is_symlink() else "not a directory"
        raise FileExistsError(
            f"{out} is {kind}; overwrite=True replaces only a checkpoint directory"
        )
    if not any((out / name).is_file() for name in _CHECKPOINT_MARKERS) and any(out.iterdir()):
        markers = " or ".join(_CHECKPOINT_MARKERS)
        raise FileExistsError(
            f"{out} is not a checkpoint directory (it holds no {markers}); overwrite=True "
            "replaces only a checkpoint directory or an empty one: delete it or choose another path"
        )
    reason = None if refuse is None else refuse(out)
    if reason is not None:
        raise FileExistsError(f"{out} {reason}; overwrite=True does not replace it")


def _rename_to_new(tmp: pathlib.Path, out: pathlib.Path) -> bool:
    """Renames `tmp` to `out` unless `out` exists; False (`out` untouched) if another writer's
    directory is there. `FileExistsError` if something else is."""
    if not os.path.lexists(out):  # `rename` would replace an empty directory
        try:
            os.rename(tmp, out)  # atomic; fails if a non-empty `out` appeared since the check
            return True
        except OSError:
            if not os.path.lexists(out):
                raise
    if out.is_dir():
        return False
    raise FileExistsError(f"{out} appeared while it was being written and is not a directory")


def _finalize_tree(root: pathlib.Path) -> None:
    """Gives `root` the permissions of an ordinary new directory and flushes it, so the rename
    never publishes unwritten data.

    `mkdtemp` (and safetensors) create owner-only entries; a checkpoint is ordinary data, so its
    entries get what `mkdir` / `open` would have given them under the process's umask.
    """
    # The umask, read without setting it (os.umask would, process-wide): a new directory's mode.
    probe = root / ".mode-probe"
    probe.mkdir()
    dir_mode = stat.S_IMODE(probe.stat().st_mode)
    probe.rmdir()
    file_mode = dir_mode & 0o666
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            os.chmod(path, file_mode)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(dirpath, dir_mode)
        _fsync_dir(pathlib.Path(dirpath))


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
