"""The output directory the checkpoint commands share (`fusegen.tools.checkpoint_cli`): written whole or not at all,
and never over good output."""

import pytest

from fusegen.errors import InputError
from fusegen.tools.checkpoint_cli import refuse_existing, staged_directory


def test_a_staged_directory_appears_only_when_the_block_succeeds(tmp_path):
    target = tmp_path / "out"
    with staged_directory(target) as staging:
        (staging / "weights").write_text("all of it")
        assert not target.exists()
    assert [p.name for p in target.iterdir()] == ["weights"] and (target / "weights").read_text() == "all of it"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_block_leaves_neither_output_nor_staging(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"), staged_directory(target) as staging:
        (staging / "half").write_text("half of it")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_target_is_replaced_and_a_filled_one_kept(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with staged_directory(empty) as staging:
        (staging / "new").write_text("new")
    assert [p.name for p in empty.iterdir()] == ["new"]
    filled = tmp_path / "filled"
    with pytest.raises(OSError), staged_directory(filled) as staging:
        (staging / "new").write_text("new")
        filled.mkdir()
        (filled / "good").write_text("someone else's output")  # written while the command ran
    assert [p.name for p in filled.iterdir()] == ["good"] and (filled / "good").read_text() == "someone else's output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "filled"]


def test_existing_output_is_refused_before_any_work(tmp_path):
    refuse_existing(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    refuse_existing(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    for name in ("file", "full"):
        with pytest.raises(InputError, match=f"{name} exists and is not an empty directory"):
            refuse_existing(tmp_path / name)
