"""autoshard.load: the loading faces refuse a path that is not there by saying so."""

from __future__ import annotations

import pytest

import autoshard
from autoshard.ir.errors import CheckpointError, ConfigError
from autoshard.training.train import last_complete_state


def test_load_checkpoint_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"^no such directory: .*nope$"):
        autoshard.load_checkpoint(tmp_path / "nope", mode="1d")


def test_resume_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"^no such directory: .*nope$"):
        last_complete_state(tmp_path / "nope")


def test_from_pretrained_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"^no such directory: .*nope$"):
        autoshard.from_pretrained(tmp_path / "nope", mode="1d")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        autoshard.from_pretrained(tmp_path / "file", mode="1d")
