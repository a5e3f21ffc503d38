"""Environments of the agent tests: scripted, and every way an environment can go wrong."""

from __future__ import annotations

import asyncio
import time

from megarl.agents.environment import Environment, StepResult


class Scripted(Environment):
    """Answers `turns` model turns with "obs <n>" (reward 0.25 each), then says done."""

    def __init__(self, turns: int = 2):
        self.turns, self.seen = turns, 0

    def reset(self, sample):
        return f"task {sample.index}"

    def step(self, action: str) -> StepResult:
        self.seen += 1
        if self.seen > self.turns:
            return StepResult(done=True)
        return StepResult(observation=f"obs {self.seen}", reward=0.25, tool_calls=1)


class Misbehaving(Scripted):
    """By the sample's index: 0 raises, 1 hangs, 2 returns garbage, 3 is async and well behaved, others fine."""

    def reset(self, sample):
        self.index = sample.index
        return None

    def step(self, action: str):
        if self.index == 0:
            raise RuntimeError("tool server down")
        if self.index == 1:
            time.sleep(5)
        if self.index == 2:
            return "not a StepResult"
        return super().step(action)


class AsyncScripted(Scripted):
    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(0.01)
        return super().step(action)


class AlwaysFails(Environment):
    """Half the episodes raise at their first step, the other half hang past the deadline."""

    def reset(self, sample):
        self.index = sample.index
        return None

    def step(self, action: str) -> StepResult:
        if self.index % 2:
            time.sleep(30)
        raise ValueError("broken on purpose")
