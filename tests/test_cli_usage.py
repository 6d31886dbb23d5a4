"""Arguments that make no sense end the command with exit code 1 and a message naming
them, before anything connects or writes."""

from __future__ import annotations

import pytest

from vchan_assets import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["create-collection", "--collection", "c", "--scalars", "a:complex"], "invalid schema"),
        (["create-collection", "--collection", "c", "--scalars", "a"], "--scalars item 'a'"),
        (["create-collection", "--collection", "c", "--dim", "0"], "positive dim"),
        (["produce", "--collection", "c", "--rows", "5", "--deletes", "6"], "--deletes must be"),
    ],
)
def test_bad_arguments_exit_1_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 1

    err = capsys.readouterr().err
    assert f"vchan {argv[0]}: error:" in err and message in err
