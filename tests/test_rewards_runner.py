"""Reward functions by name (built-in, module path, file path), config checks, and the runner's isolation of bad
samples: exceptions, timeouts, dead workers, NaN, wrong returns, and pool reuse across steps.

The reward functions below run in the runner's spawned workers, which import this module by name (tests/ is on
sys.path; spawn hands sys.path to its children).
"""

from __future__ import annotations

import math
import os
import time
import warnings

import pytest

from megarl.errors import UserError
from megarl.rewards import RewardConfig, RewardFunctionError, RewardRunner, RewardSample, load_reward_fn

# --- reward functions used by the tests -------------------------------------------------------------------------


def length_reward(samples, scale=1.0):
    return [scale * len(sample.response) for sample in samples]


def raise_on_bad(samples):
    if any(sample.response == "bad" for sample in samples):
        raise ValueError("cannot score 'bad'")
    return [{"score": 1.0, "acc": float(sample.label == "yes")} for sample in samples]


def sleep_on_hang(samples):
    if any(sample.response == "hang" for sample in samples):
        time.sleep(60)
    return [{"score": 1.0, "pid": float(os.getpid())} for _ in samples]


def exit_on_die(samples):
    if any(sample.response == "die" for sample in samples):
        os._exit(3)
    return [1.0 for _ in samples]


def nan_on_nan(samples):
    return [math.nan if sample.response == "nan" else 2.0 for sample in samples]


def one_too_many(samples):
    return [1.0] * (len(samples) + 1)


def string_scores(samples):
    return ["1.0" for _ in samples]


NOT_A_FUNCTION = 3


def _samples(*responses, label="yes"):
    return [RewardSample(prompt="p", response=response, label=label) for response in responses]


def _config(fn, **overrides):
    return RewardConfig(fn=f"test_rewards_runner:{fn}", **overrides)


# --- loading functions by name ----------------------------------------------------------------------------------


def test_load_builtin_module_and_file(tmp_path, monkeypatch):
    assert load_reward_fn("math").__name__ == "math_reward"
    assert load_reward_fn("test_rewards_runner:length_reward") is length_reward
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def score(samples, bonus=0.0):\n    return [1.0 + bonus for _ in samples]\n")
    fn = load_reward_fn(f"{plugin}:score")
    assert fn(_samples("a", "b"), bonus=1.0) == [2.0, 2.0]
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("my_reward.py:score") is fn  # a relative path: same file, same module


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("mathh", "not a built-in reward function; valid: boxed, format, gsm8k, math.*did you mean 'math'"),
        ("no_such_module_xyz:fn", "no module named 'no_such_module_xyz'"),
        ("test_rewards_runner:lenght_reward", "has no attribute 'lenght_reward'.*did you mean 'length_reward'"),
        ("test_rewards_runner:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a callable"),
        ("missing/dir/reward.py:fn", "file .*missing/dir/reward.py does not exist"),
        (":fn", "must be a built-in name"),
    ],
)
def test_load_errors_name_the_key(fn, message):
    with pytest.raises(UserError, match=f"reward.fn='{fn}'.*{message}" if fn[0] != ":" else message):
        RewardConfig(fn=fn).check("reward")


def test_broken_plugin_files(tmp_path):
    missing_dependency = tmp_path / "needs_dep.py"
    missing_dependency.write_text("import not_installed_pkg_xyz\ndef fn(samples):\n    return []\n")
    with pytest.raises(UserError, match="needs_dep.py raised ModuleNotFoundError: No module named 'not_installed_pkg"):
        RewardConfig(fn=f"{missing_dependency}:fn").check("reward")
    syntax_error = tmp_path / "broken.py"
    syntax_error.write_text("def fn(samples:\n")
    with pytest.raises(UserError, match="broken.py raised SyntaxError"):
        RewardConfig(fn=f"{syntax_error}:fn").check("reward")


def test_config_checks():
    RewardConfig().check("reward")
    RewardConfig(fn="format", kwargs={"pattern": "^#### ", "flags": "m"}).check("reward")
    _config("length_reward", kwargs={"scale": 2.0}).check("reward")
    bad = [
        (RewardConfig(batch_size=0), "reward.batch_size=0 must be >= 1"),
        (RewardConfig(timeout_s=0), "reward.timeout_s=0 must be > 0"),
        (RewardConfig(num_workers=-1), "reward.num_workers=-1 must be >= 0"),
        (RewardConfig(default_reward=math.nan), "reward.default_reward=nan must be a finite"),
        (RewardConfig(kwargs={"fallbak": "none"}), "reward.kwargs=.* does not fit reward function math\\(samples"),
        (RewardConfig(kwargs={"fallback": "first"}), "reward.kwargs.fallback='first' is not known; valid: none"),
        (RewardConfig(fn="format"), "reward.kwargs.pattern is required"),
        (RewardConfig(fn="format", kwargs={"pattern": "(("}), "reward.kwargs.pattern='\\(\\(' is not a valid regex"),
        (_config("length_reward", kwargs={"scael": 2}), "unexpected keyword argument 'scael'"),
    ]
    for config, message in bad:
        with pytest.raises(UserError, match=message):
            config.check("reward")
    with pytest.warns(UserWarning, match="reward.timeout_s has no effect"):
        RewardConfig(num_workers=0, timeout_s=5.0).check("reward")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RewardConfig(num_workers=0).check("reward")


def test_config_from_omegaconf():
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(RewardConfig), OmegaConf.from_dotlist(["kwargs.pattern=^####"]))
    config = OmegaConf.to_object(merged)
    assert config.kwargs == {"pattern": "^####"} and config.fn == "math"


# --- the runner ---------------------------------------------------------------------------------------------------


def test_in_process_isolates_the_failing_sample():
    with RewardRunner(_config("raise_on_bad", num_workers=0, batch_size=4, default_reward=-1.0)) as runner:
        result = runner.score(_samples("a", "bad", "c", "d", "e"))
    assert result.scores == [1.0, -1.0, 1.0, 1.0, 1.0]
    assert result.errors[1] == "ValueError: cannot score 'bad'" and result.errors.count(None) == 4
    assert result.metrics == {"acc": 1.0, "num_failed": 1.0, "num_timeout": 0.0, "fraction_default": 0.2}
    assert result.extras[0] == {"acc": 1.0} and result.extras[1] == {}


def test_builtin_math_in_workers():
    samples = [RewardSample("q", "#### 1,000", 1000), RewardSample("q", "\\boxed{\\frac{1}{2}}", "0.5")]
    samples.append(RewardSample("q", "#### 3", "4"))
    with RewardRunner(RewardConfig(fn="math", batch_size=2, num_workers=1)) as runner:
        result = runner.score(samples)
    assert result.scores == [1.0, 1.0, 0.0]
    assert result.metrics["acc"] == pytest.approx(2 / 3) and result.metrics["format_ok"] == 1.0


def test_exception_costs_only_that_sample():
    with RewardRunner(_config("raise_on_bad", batch_size=3, num_workers=2)) as runner:
        result = runner.score(_samples("a", "b", "bad", "d", "e", "f", "g"))
        assert result.scores == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        assert result.metrics["num_failed"] == 1.0 and result.metrics["fraction_default"] == pytest.approx(1 / 7)
        assert "ValueError: cannot score 'bad'" in result.errors[2]


def test_timeout_is_bounded_counted_and_the_pool_is_reused():
    config = _config("sleep_on_hang", batch_size=4, timeout_s=2.0, num_workers=2, default_reward=-1.0)
    with RewardRunner(config) as runner:
        pids_before = set(runner.wait_ready())
        first = runner.score(_samples("a", "b"))
        assert {extra["pid"] for extra in first.extras} <= pids_before and len(pids_before) == 2
        start = time.monotonic()
        result = runner.score(_samples("a", "b", "hang", "d", "e", "f", "g", "h"))
        elapsed = time.monotonic() - start
        assert result.scores == [1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        assert result.metrics["num_timeout"] == 1.0 and result.metrics["num_failed"] == 0.0
        assert result.errors[2].startswith("timeout")
        assert elapsed < 30.0  # two time limits plus a worker restart (about 6 s), far from the 60 s sleep
        third = runner.score(_samples("x", "y", "z"))
        assert third.scores == [1.0, 1.0, 1.0]
        pids_after = set(runner.wait_ready())
        assert len(pids_after) == 2 and len(pids_after & pids_before) < 2  # the workers that hung were replaced


def test_pool_reused_across_steps():
    with RewardRunner(_config("sleep_on_hang", batch_size=2, num_workers=2)) as runner:
        pids = runner.wait_ready()
        assert len(pids) == 2
        for _ in range(3):
            result = runner.score(_samples("a", "b", "c", "d"))
            assert {extra["pid"] for extra in result.extras} <= set(pids)
        assert runner.worker_pids == pids
        processes = [worker.process for worker in runner._workers]
    assert not any(process.is_alive() for process in processes)  # close() stopped them
    with pytest.raises(RuntimeError, match="after close"):
        runner.score(_samples("a"))


def test_dead_worker_costs_only_that_sample():
    with RewardRunner(_config("exit_on_die", batch_size=4, num_workers=1)) as runner:
        result = runner.score(_samples("a", "die", "c"))
        assert result.scores == [1.0, 0.0, 1.0]
        assert "exit code 3" in result.errors[1] and result.metrics["num_failed"] == 1.0
        assert runner.score(_samples("a")).scores == [1.0]


def test_nan_counts_as_failed():
    with RewardRunner(_config("nan_on_nan", num_workers=0, default_reward=0.5)) as runner:
        result = runner.score(_samples("a", "nan"))
    assert result.scores == [2.0, 0.5] and result.errors[1] == "score is nan"
    assert result.metrics["num_failed"] == 1.0


@pytest.mark.parametrize("num_workers", [0, 1])
def test_wrong_return_is_a_clear_error(num_workers):
    with (
        RewardRunner(_config("one_too_many", num_workers=num_workers)) as runner,
        pytest.raises(RewardFunctionError, match="one_too_many returned 3 entries for 2 samples; expected a list"),
    ):
        runner.score(_samples("a", "b"))
    with (
        RewardRunner(_config("string_scores", num_workers=0)) as runner,
        pytest.raises(RewardFunctionError, match="string_scores returned str '1.0' for sample 0; expected one float"),
    ):
        runner.score(_samples("a"))


def test_empty_batch():
    with RewardRunner(RewardConfig(num_workers=0)) as runner:
        result = runner.score([])
    assert result.scores == [] and result.metrics["fraction_default"] == 0.0


def test_worker_load_error_surfaces(tmp_path):
    plugin = tmp_path / "flaky.py"
    plugin.write_text("def fn(samples):\n    return [1.0 for _ in samples]\n")
    runner = RewardRunner(RewardConfig(fn=f"{plugin}:fn", num_workers=1))
    plugin.unlink()  # checked by the config, gone before the worker loads it
    with pytest.raises(UserError, match="a reward worker could not load it: UserError: .*does not exist"):
        runner.wait_ready()
    runner.close()
