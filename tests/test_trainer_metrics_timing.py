"""Phase timers (with a hand-driven clock, so every number is exact) and the console progress display: plain
lines off a terminal, the live display on a pseudo-terminal, and the fallback when the terminal misbehaves."""

from __future__ import annotations

import io
import os
import re
import threading

import pytest
import torch

from megarl.trainer.observability.progress import RunProgress, format_duration, format_number
from megarl.trainer.observability.timing import PhaseTimer, tokens_per_s


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_phase_timer_nests_accumulates_and_resets():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    with timer.phase("rollout"):
        clock.advance(2.0)
        with timer.phase("reward"):
            clock.advance(0.5)
    clock.advance(0.25)  # controller time outside any phase
    with timer.phase("update"):
        clock.advance(1.0)
    with timer.phase("rollout"):  # a repeated phase adds up
        clock.advance(1.0)
    assert timer.seconds("rollout/reward") == 0.5
    assert timer.step_metrics(num_tokens={"rollout": 7000, "step": 4750}) == {
        "timing/rollout/reward_s": 0.5,
        "timing/rollout_s": 3.5,
        "timing/update_s": 1.0,
        "timing/step_s": 4.75,
        "throughput/rollout_tokens_per_s": 2000.0,
        "throughput/tokens_per_s": 1000.0,
    }
    clock.advance(3.0)
    assert timer.step_metrics() == {"timing/step_s": 3.0}  # reset: the next step starts from scratch


def test_phase_timer_splits_a_phase_left_open_across_steps():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    with timer.phase("loop"):
        clock.advance(2.0)
        assert timer.step_metrics() == {"timing/loop_s": 2.0, "timing/step_s": 2.0}
        clock.advance(1.0)
    assert timer.step_metrics() == {"timing/loop_s": 1.0, "timing/step_s": 1.0}


def test_phase_timer_errors():
    timer = PhaseTimer(FakeClock())
    for bad in ("", "a/b", "step"):
        with pytest.raises(ValueError, match="phase name"), timer.phase(bad):
            pass
    with pytest.raises(KeyError, match="no phase 'sync' was timed"):
        timer.step_metrics(num_tokens={"sync": 10})
    with pytest.raises(RuntimeError), timer.phase("update"):
        raise RuntimeError("the phase still counts its time")
    assert "timing/update_s" in timer.step_metrics()
    assert tokens_per_s(100, 0.0) == 0.0 and tokens_per_s(100, 4.0) == 25.0


def test_plain_mode_prints_one_line_per_step(capsys):
    # pytest captures stdout into a file, not a terminal: the display must fall back to plain lines.
    with RunProgress(total_steps=3, keys=["reward/mean", "eval/accuracy", "timing/step_s"]) as progress:
        assert not progress.live
        progress.update(1, {"reward/mean": 0.5, "timing/step_s": torch.tensor(12.25), "other": 1.0})
        progress.message("evaluating ...")
        progress.update(2, {"reward/mean": 0.625, "eval/accuracy": 0.4})
        progress.update(3, {"reward/mean": 0.75})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[1] == "evaluating ..."
    step_lines = [lines[0], lines[2], lines[3]]
    assert [re.match(r"step (\d)/3", line).group(1) for line in step_lines] == ["1", "2", "3"]
    assert "reward 0.5 | step_s 12.25 |" in lines[0] and "acc" not in lines[0]
    assert "reward 0.625 | acc 0.4 | step_s 12.25" in lines[2]  # metrics keep their latest value
    assert "(100%)" in lines[3] and "eta 0:00:00" in lines[3]


def test_plain_mode_honours_console_every_and_disabled(capsys):
    stream = io.StringIO()
    progress = RunProgress(total_steps=10, start_step=4, enabled=False, console_every=3, stream=stream)
    for step in range(5, 11):
        progress.update(step, {"reward/mean": step / 10})
    progress.close()
    printed = [int(re.match(r"step\s+(\d+)/10", line).group(1)) for line in stream.getvalue().splitlines()]
    assert printed == [5, 6, 9, 10]  # the first step of the session, every 3rd, and the last
    assert capsys.readouterr().out == ""


def test_plain_mode_survives_a_closed_stream():
    stream = io.StringIO()
    progress = RunProgress(total_steps=2, stream=stream)
    stream.close()
    progress.update(1, {"reward/mean": 1.0})
    progress.message("still fine")
    progress.close()


def _open_pty():
    """A pseudo-terminal whose output is drained by a thread (a full pty buffer would block the writer)."""
    leader_fd, follower_fd = os.openpty()
    stream = open(follower_fd, "w", encoding="utf-8")  # noqa: SIM115 (closed by the caller)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader_fd, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return stream, leader_fd, thread, chunks


def test_live_display_on_a_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    stream, leader_fd, thread, chunks = _open_pty()
    try:
        with RunProgress(total_steps=4, keys=["reward/mean", "actor/kl"], stream=stream) as progress:
            assert progress.live
            progress.update(1, {"reward/mean": 0.5, "actor/kl": 0.001})
            progress.message("a log line above the bar")
            progress.update(2, {"reward/mean": 0.75})
        assert not progress.live
    finally:
        stream.close()
        thread.join(timeout=5)
        os.close(leader_fd)
    output = b"".join(chunks).decode(errors="replace")
    assert "a log line above the bar" in output
    assert "2/4" in output and "reward 0.75 | kl 0.001" in output


def test_live_display_falls_back_to_plain_lines_when_the_terminal_breaks(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    stream, leader_fd, thread, chunks = _open_pty()
    try:
        progress = RunProgress(total_steps=2, keys=["reward/mean"], stream=stream)
        assert progress.live

        def broken(*args, **kwargs):
            raise OSError("terminal went away")

        monkeypatch.setattr(progress._live, "refresh", broken)
        progress.update(1, {"reward/mean": 0.5})  # must not raise
        assert not progress.live
        progress.update(2, {"reward/mean": 0.25})
        progress.close()
    finally:
        stream.close()
        thread.join(timeout=5)
        os.close(leader_fd)
    output = b"".join(chunks).decode(errors="replace")
    assert "live progress display off (OSError: terminal went away)" in output
    assert "step 2/2 (100%) | reward 0.25" in output


def test_number_and_duration_formats():
    assert [format_number(v) for v in (0.5123456, 0.00123, 1.2e-5, 0.0, 123.456, 12345.6, float("nan"))] == [
        "0.5123",
        "0.00123",
        "1.20e-05",
        "0",
        "123.5",
        "12,346",
        "nan",
    ]
    assert format_duration(3725.4) == "1:02:05" and format_duration(float("inf")) == "?"


def test_eta_is_the_mean_step_time_times_the_steps_left_counting_down(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("megarl.trainer.observability.progress.time.monotonic", clock)
    progress = RunProgress(total_steps=10, start_step=2, enabled=False, stream=io.StringIO())
    assert progress.eta_s() == float("inf")
    clock.advance(20.0)
    progress.update(4)  # 2 steps in 20 s: 10 s per step, 6 steps left
    assert progress.eta_s() == 60.0
    clock.advance(15.0)
    assert progress.eta_s() == 45.0
    progress.close()
