"""`directory_digest`: what makes two checkpoint directories the same input for a run."""

from __future__ import annotations

import shutil

import pytest

from jetspec_jax.checkpoint.digest import directory_digest


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 64}')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (path / "sub" / "weights.bin").write_bytes(b"\x01\x02")
    return path


def test_a_copy_elsewhere_has_the_same_digest(checkpoint, tmp_path):
    copy = shutil.copytree(checkpoint, tmp_path / "elsewhere" / "copy")
    assert directory_digest(copy) == directory_digest(checkpoint)


@pytest.mark.parametrize(
    "change",
    [
        lambda p: (p / "model.safetensors").write_bytes(bytes(range(256)) * 7 + bytes(256)),
        lambda p: (p / "sub" / "weights.bin").write_bytes(b"\x01\x03"),
        lambda p: (p / "config.json").rename(p / "other.json"),  # the same bytes, renamed
        # Renamed, yet read in the same order: only the names tell the two apart.
        lambda p: (p / "sub" / "weights.bin").rename(p / "sub" / "other.bin"),
        lambda p: (p / "extra.safetensors").write_bytes(b""),
    ],
    ids=["weights", "nested file", "renamed", "renamed in place", "new empty file"],
)
def test_a_changed_model_file_changes_the_digest(checkpoint, change):
    before = directory_digest(checkpoint)
    change(checkpoint)
    assert directory_digest(checkpoint) != before


@pytest.mark.parametrize(
    "change",
    [
        lambda p: (p / ".cache").mkdir() or (p / ".cache" / "download.lock").write_text("x"),
        lambda p: (p / ".gitattributes").write_text("*.safetensors filter=lfs"),
        lambda p: (p / "README.md").write_text("# model card"),
        lambda p: (p / "LICENSE").write_text("Apache-2.0"),
        lambda p: (p / "NOTES.MD").write_text("# upper-case suffix"),
        lambda p: (p / "license.txt").write_text("MIT"),
    ],
    ids=["hidden dir", "hidden file", "model card", "license", "upper-case .MD", "license.txt"],
)
def test_files_that_are_not_the_model_leave_the_digest_alone(checkpoint, change):
    before = directory_digest(checkpoint)
    change(checkpoint)
    assert directory_digest(checkpoint) == before
