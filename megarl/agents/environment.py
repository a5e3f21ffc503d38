"""The environment interface of agent episodes, and the built-in tool environment.

A user environment subclasses `Environment` and is named in the config as `module.path:Class` (or
`path/to/file.py:Class`), built once per episode with `agent.env_kwargs`:

    class Env(Environment):
        def reset(self, sample) -> str | None:          # the first observation (None: the prompt says it all)
        def step(self, action: str) -> StepResult:      # the model's turn, as text -> observation, reward, done

Either method may be `async def`; plain ones run in a worker thread, so a slow one does not stall the others. Each
call has a deadline (`agent.step_timeout_s`); a call that raises, hangs past it, or returns the wrong thing ends
that episode (counted, with `agent.failure_reward`), never the run. `time_left()`, called inside reset or step,
says how many seconds of the call's deadline remain (a sync call past it is abandoned, not stopped: work it would
still start is work nobody reads).

`ToolEnvironment` is the built-in one (`agent.env: tools`): it runs the tool calls of each model turn (tool_calls.py
formats) with the calculator and the Python tool (isolated locally by code_tool.py, or on a SandboxFusion server:
remote_sandbox.py), and answers with their results; a turn without a tool call is the final answer (done).
Malformed calls and tool errors become observations the model can learn from; no tool starts once the step's
deadline has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import math
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megarl.agents.calculator import CalculatorError, calculate
from megarl.agents.code_tool import CodeToolConfig, run_python
from megarl.agents.remote_sandbox import SandboxFusionClient, SandboxFusionConfig, SandboxUnavailable
from megarl.agents.tool_calls import FORMATS, ToolCall, ToolCallError, parse_tool_calls
from megarl.errors import UserError

_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("megarl_env_deadline", default=math.inf)


def time_left() -> float:
    """Seconds before the deadline of the environment call running here (its thread or task); inf outside one."""
    return _deadline.get() - time.monotonic()


@dataclass(frozen=True)
class StepResult:
    observation: str | None = None
    """What the model reads next (None: nothing, e.g. when done)."""
    reward: float = 0.0
    """A per-turn reward (added to the outcome reward of the episode)."""
    done: bool = False
    tool_calls: int = 0
    """Tool calls this turn made (for the metrics)."""
    tool_errors: int = 0
    """Of those, how many failed or could not be read."""


class Environment:
    """Base class of agent environments (see the module docstring)."""

    def reset(self, sample: Any) -> str | None:
        return None

    def step(self, action: str) -> StepResult:
        raise NotImplementedError


class EnvironmentFailure(RuntimeError):
    """An environment call raised, timed out or returned the wrong thing: the episode ends."""


async def call_with_deadline(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """Run an environment method (sync in a thread of its own, async as it is) within `timeout_s` seconds. A sync
    call past its deadline is abandoned: its thread is a daemon, so a hung environment never blocks the run (or its
    exit); an async one is cancelled."""
    deadline = time.monotonic() + timeout_s

    async def within_deadline() -> Any:  # a task of its own: the deadline is set in its copy of the context
        _deadline.set(deadline)
        return await fn(*args)

    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(within_deadline(), timeout_s)
        return await asyncio.wait_for(_in_daemon_thread(fn, *args, deadline=deadline), timeout_s)
    except TimeoutError:
        raise EnvironmentFailure(f"{_name(fn)} did not answer within {timeout_s:g} s") from None
    except Exception as e:  # the environment's own bug: this episode ends, the run goes on
        raise EnvironmentFailure(f"{_name(fn)} raised {type(e).__name__}: {e}") from e


def _in_daemon_thread(fn: Callable[..., Any], *args: Any, deadline: float = math.inf) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # the caller may have given up (deadline)
            outcome()

    def run() -> None:
        _deadline.set(deadline)
        try:
            result = fn(*args)
            outcome = lambda: future.set_result(result)  # noqa: E731
        except BaseException as e:  # handed to the awaiting episode
            outcome = lambda error=e: future.set_exception(error)  # noqa: E731
        with contextlib.suppress(RuntimeError):  # the episodes ended long ago: the loop is closed
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, daemon=True, name="megarl-env").start()
    return future


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def check_step_result(result: Any, fn: Callable[..., Any]) -> StepResult:
    if not isinstance(result, StepResult):
        raise EnvironmentFailure(f"{_name(fn)} returned {type(result).__name__}, not a StepResult")
    if result.observation is not None and not isinstance(result.observation, str):
        raise EnvironmentFailure(f"{_name(fn)} returned an observation of {type(result.observation).__name__}, not str")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvironmentFailure(f"{_name(fn)} returned reward={reward!r}, not a finite number")
    return result


ToolFn = Callable[[Mapping[str, Any]], str]


def calculator_tool(arguments: Mapping[str, Any]) -> str:
    """{"expression": "12*34"} (hermes) or {"input": "12*34"} (tag) -> "408"."""
    expression = arguments.get("expression", arguments.get("input"))
    if not isinstance(expression, str):
        raise CalculatorError('give the expression as {"expression": "..."}')
    return calculate(expression)


def python_tool(limits: CodeToolConfig, remote: SandboxFusionClient | None = None) -> ToolFn:
    """{"code": "..."} (hermes) or {"input": "..."} (tag) -> the output of the code, run isolated: locally
    (code_tool.py), or on `remote` (a SandboxFusion server); never past the step's deadline."""

    def run(arguments: Mapping[str, Any]) -> str:
        code = arguments.get("code", arguments.get("input"))
        if not isinstance(code, str):
            raise ValueError('give the code as {"code": "..."}')
        if remote is not None:
            return remote.run_python(code, limits, time_left)
        wall = min(limits.wall_seconds, time_left())
        if wall <= 0:
            raise SandboxUnavailable("not run: the step's deadline passed")
        return run_python(code, replace(limits, wall_seconds=wall), None)

    return run


BUILTIN_TOOLS = ("calculator", "python")
CODE_BACKENDS = ("local", "sandbox_fusion")
_REMOTE_KEYS = ("sandbox_url", "sandbox_timeout_s", "sandbox_max_concurrency", "sandbox_retries")


class ToolEnvironment(Environment):
    """Runs the model's tool calls; the first turn without one ends the episode (its text is the answer).

    `tools`: names among BUILTIN_TOOLS; `code_limits`: CodeToolConfig fields of the python tool; `max_chars`: each
    tool answer cut to this length; `max_calls_per_turn`: calls of one turn past it are not run (one error line says
    so). `code_backend`: where the python tool runs code, `local` (code_tool.py) or `sandbox_fusion` (a SandboxFusion
    server at `sandbox_url`: SandboxFusionConfig's url, timeout_s, max_concurrency, retries)."""

    def __init__(
        self,
        tools: Sequence[str] = ("calculator",),
        tool_format: str = "hermes",
        max_chars: int = 1000,
        code_limits: Mapping[str, Any] | None = None,
        max_calls_per_turn: int = 8,
        code_backend: str = "local",
        sandbox_url: str | None = None,
        sandbox_timeout_s: float = 30.0,
        sandbox_max_concurrency: int = 8,
        sandbox_retries: int = 2,
    ):
        key = "agent.env_kwargs"
        unknown = sorted(set(tools) - set(BUILTIN_TOOLS))
        if unknown:
            raise UserError(f"{key}.tools: no built-in tools {unknown}; valid: {', '.join(BUILTIN_TOOLS)}")
        if tool_format not in FORMATS:
            raise UserError(f"{key}.tool_format={tool_format!r}: valid are {', '.join(FORMATS)}")
        if max_chars < 1 or max_calls_per_turn < 1:
            raise UserError(f"{key}: max_chars={max_chars} and max_calls_per_turn={max_calls_per_turn} must be >= 1")
        if code_backend not in CODE_BACKENDS:
            raise UserError(f"{key}.code_backend={code_backend!r}: valid are {', '.join(CODE_BACKENDS)}")
        self.remote: SandboxFusionClient | None = None
        limits = CodeToolConfig(**(code_limits or {}))
        if code_backend == "sandbox_fusion":
            if not sandbox_url:
                raise UserError(f"{key}.code_backend=sandbox_fusion needs {key}.sandbox_url (e.g. http://host:8080)")
            if not sandbox_timeout_s > limits.wall_seconds:
                raise UserError(
                    f"{key}.sandbox_timeout_s={sandbox_timeout_s} must be longer than the code's wall time "
                    f"({key}.code_limits.wall_seconds={limits.wall_seconds:g}): the server needs time to answer"
                )
            config = SandboxFusionConfig(sandbox_url, sandbox_timeout_s, sandbox_max_concurrency, sandbox_retries)
            self.remote = SandboxFusionClient(config, key)
        made = {"calculator": lambda: calculator_tool, "python": lambda: python_tool(limits, self.remote)}
        self.tools: dict[str, ToolFn] = {name: made[name]() for name in tools}
        self.tool_format = tool_format
        self.max_chars = max_chars
        self.max_calls_per_turn = max_calls_per_turn

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action, self.tool_format)
        if not calls:
            return StepResult(done=True)
        answers, errors = [], 0
        for call in calls[: self.max_calls_per_turn]:
            if time_left() <= 0:  # the episode has failed on its deadline: start nothing more
                break
            answer, failed = self._run(call)
            answers.append(answer[: self.max_chars])
            errors += failed
        if len(calls) > self.max_calls_per_turn:
            skipped = len(calls) - self.max_calls_per_turn
            answers.append(f"error: {skipped} more tool calls not run: at most {self.max_calls_per_turn} per turn")
            errors += skipped
        return StepResult(observation="\n".join(answers), tool_calls=len(calls), tool_errors=errors)

    def _run(self, call: ToolCall | ToolCallError) -> tuple[str, bool]:
        if isinstance(call, ToolCallError):
            return f"error: {call.message}", True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: no tool {call.name!r}; tools: {', '.join(sorted(self.tools))}", True
        try:
            return tool(call.arguments), False
        except ValueError as e:  # a tool's refusal (CalculatorError is one): the model reads why
            return f"error: {e}", True


def load_environment(spec: str, kwargs: Mapping[str, Any], key: str = "agent.env") -> Callable[[], Environment]:
    """A factory of the environment `spec` names (`module:Class` or `file.py:Class`; `tools` for the built-in
    ToolEnvironment), checked now: a bad name fails before any episode runs."""
    if spec == "tools":
        try:
            env = ToolEnvironment(**kwargs)  # checks the names and the limits now
        except TypeError as e:
            raise UserError(f"{key}=tools cannot be built with agent.env_kwargs {dict(kwargs)}: {e}") from None
        unused = [k for k in _REMOTE_KEYS if k in kwargs] if env.remote is None else []
        if unused:
            warnings.warn(
                f"agent.env_kwargs {unused} have no effect with code_backend=local", UserWarning, stacklevel=2
            )
        if "python" in env.tools:
            if env.remote is not None:
                env.remote.check()  # the server runs code now, or the run does not start
            else:
                from megarl.agents.code_tool import check_sandbox

                check_sandbox()  # code runs isolated, or not at all
        return lambda: ToolEnvironment(**kwargs)
    from megarl.rewards.plugins import load_object

    cls = load_object(spec, key, kind="classes")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UserError(f"{key}={spec!r} is not a subclass of megarl.agents.environment.Environment")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise UserError(f"{key}={spec!r} cannot be built with agent.env_kwargs {dict(kwargs)}: {e}") from None
    return lambda: cls(**kwargs)
