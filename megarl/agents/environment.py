"""The environment interface of agent episodes, and the built-in tool environment.

A user environment subclasses `Environment` and is named in the config as `module.path:Class` (or
`path/to/file.py:Class`), built once per episode with `agent.env_kwargs`:

    class Env(Environment):
        def reset(self, sample) -> str | None:          # the first observation (None: the prompt says it all)
        def step(self, action: str) -> StepResult:      # the model's turn, as text -> observation, reward, done

Either method may be `async def`; plain ones run in a worker thread, so a slow one does not stall the others. Each
call has a deadline (`agent.step_timeout_s`); a call that raises, hangs past it, or returns the wrong thing ends
that episode (counted, with `agent.failure_reward`), never the run.

`ToolEnvironment` is the built-in one (`agent.env: tools`): it runs the tool calls of each model turn (tool_calls.py
formats) with the calculator and the isolated Python tool (code_tool.py), and answers with their results; a turn
without a tool call is the final answer (done). Malformed calls and tool errors become observations the model can
learn from.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megarl.agents.calculator import CalculatorError, calculate
from megarl.agents.code_tool import CodeToolConfig, run_python
from megarl.agents.tool_calls import FORMATS, ToolCall, ToolCallError, parse_tool_calls
from megarl.errors import UserError


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
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args), timeout_s)
        return await asyncio.wait_for(_in_daemon_thread(fn, *args), timeout_s)
    except TimeoutError:
        raise EnvironmentFailure(f"{_name(fn)} did not answer within {timeout_s:g} s") from None
    except Exception as e:  # the environment's own bug: this episode ends, the run goes on
        raise EnvironmentFailure(f"{_name(fn)} raised {type(e).__name__}: {e}") from e


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # the caller may have given up (deadline)
            outcome()

    def run() -> None:
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
    return result


ToolFn = Callable[[Mapping[str, Any]], str]


def calculator_tool(arguments: Mapping[str, Any]) -> str:
    """{"expression": "12*34"} (hermes) or {"input": "12*34"} (tag) -> "408"."""
    expression = arguments.get("expression", arguments.get("input"))
    if not isinstance(expression, str):
        raise CalculatorError('give the expression as {"expression": "..."}')
    return calculate(expression)


def python_tool(limits: CodeToolConfig) -> ToolFn:
    """{"code": "..."} (hermes) or {"input": "..."} (tag) -> the output of the code, run isolated (code_tool.py)."""

    def run(arguments: Mapping[str, Any]) -> str:
        code = arguments.get("code", arguments.get("input"))
        if not isinstance(code, str):
            raise ValueError('give the code as {"code": "..."}')
        return run_python(code, limits)

    return run


BUILTIN_TOOLS = ("calculator", "python")


class ToolEnvironment(Environment):
    """Runs the model's tool calls; the first turn without one ends the episode (its text is the answer).

    `tools`: names among BUILTIN_TOOLS; `code_limits`: CodeToolConfig fields of the python tool; `max_chars`: each
    tool answer cut to this length."""

    def __init__(
        self,
        tools: Sequence[str] = ("calculator",),
        tool_format: str = "hermes",
        max_chars: int = 1000,
        code_limits: Mapping[str, Any] | None = None,
    ):
        unknown = sorted(set(tools) - set(BUILTIN_TOOLS))
        if unknown:
            raise UserError(f"agent.env_kwargs.tools: no built-in tools {unknown}; valid: {', '.join(BUILTIN_TOOLS)}")
        if tool_format not in FORMATS:
            raise UserError(f"agent.env_kwargs.tool_format={tool_format!r}: valid are {', '.join(FORMATS)}")
        made = {
            "calculator": lambda: calculator_tool,
            "python": lambda: python_tool(CodeToolConfig(**(code_limits or {}))),
        }
        self.tools: dict[str, ToolFn] = {name: made[name]() for name in tools}
        self.tool_format = tool_format
        self.max_chars = max_chars

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action, self.tool_format)
        if not calls:
            return StepResult(done=True)
        answers, errors = [], 0
        for call in calls:
            answer, failed = self._run(call)
            answers.append(answer[: self.max_chars])
            errors += failed
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
            ToolEnvironment(**kwargs)  # checks the names and the limits now
        except TypeError as e:
            raise UserError(f"{key}=tools cannot be built with agent.env_kwargs {dict(kwargs)}: {e}") from None
        if "python" in kwargs.get("tools", ()):
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
