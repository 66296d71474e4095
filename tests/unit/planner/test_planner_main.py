"""The planner's command line: its transfer stall comes from LAYERCAST_TRANSFER_STALL_S (or
--transfer-stall) and reaches the operations' timers; a stall that is not positive is refused."""

import pytest

import services.planner.__main__ as planner_main
from services.planner.service import TIMERS


def _service(monkeypatch, argv: list[str]):
    built = []
    monkeypatch.setattr(planner_main, "run", lambda factory, host, port: built.append(factory()))
    monkeypatch.setattr("sys.argv", ["planner", *argv])
    planner_main.main()
    return built[0]


def test_the_transfer_stall_comes_from_the_environment_and_the_flag(monkeypatch):
    assert _service(monkeypatch, []).timers == TIMERS
    monkeypatch.setenv("LAYERCAST_TRANSFER_STALL_S", "60")
    service = _service(monkeypatch, [])
    assert service.timers.transfer_stall_s == 60.0
    assert service.timers.tick_s == TIMERS.tick_s  # the other timers as declared
    assert _service(monkeypatch, ["--transfer-stall", "7.5"]).timers.transfer_stall_s == 7.5


def test_a_stall_that_is_not_positive_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _service(monkeypatch, ["--transfer-stall", "0"])
    assert "--transfer-stall must be > 0" in capsys.readouterr().err
