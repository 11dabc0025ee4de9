"""The command-line contract for user errors: one line on stderr, exit status 2."""

from __future__ import annotations

import pytest

from backend.errors import CheckpointError, UserError, is_user_error, one_line, run_main


def test_a_user_error_prints_one_line_and_returns_2(capsys, monkeypatch):
    monkeypatch.delenv("BACKEND_DEBUG", raising=False)

    def fn():
        raise CheckpointError("ckpt/step_00000004: written with dp 2\nthis run has dp 4")

    assert run_main(fn) == 2
    err = capsys.readouterr().err
    assert err == "error: ckpt/step_00000004: written with dp 2; this run has dp 4\n"


def test_the_debug_variable_adds_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("MY_DEBUG", "1")

    def fn():
        raise UserError("data.path: no such file x.jsonl")

    assert run_main(fn, debug_env="MY_DEBUG") == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("error: data.path: no such file x.jsonl\n")


def test_other_errors_keep_their_traceback():
    def fn():
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_main(fn)


def test_return_values_become_the_exit_status():
    assert run_main(lambda: None) == 0
    assert run_main(lambda: 3) == 3


def test_config_and_resume_errors_are_user_errors():
    from backend.checkpoint.store import ResumeError
    from backend.config import ConfigError

    assert is_user_error(ConfigError("x")) and is_user_error(ResumeError("x"))
    assert not is_user_error(ValueError("x"))
    assert one_line(ValueError("")) == "ValueError"


def test_data_errors_are_user_errors():
    from backend.data.errors import DataFormatError

    assert is_user_error(DataFormatError("f.jsonl:3: bad"))
