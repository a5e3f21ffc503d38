"""Settings of multi-turn agent episodes (`agent:` in the job config). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarl.config.paths import path_field
from megarl.errors import UserError


@dataclass
class AgentConfig:
    env: str = path_field("spec", "")
    """The environment of multi-turn rollouts: `tools` (the built-in tool environment: megarl/agents/environment.py),
    `module.path:Class` or `path/to/file.py:Class` (a subclass of Environment); "" = single-turn rollouts."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (tools: tools, tool_format, max_chars, max_calls_per_turn,
    code_limits, code_backend local | sandbox_fusion, sandbox_url, ...: megarl/agents/environment.py)."""
    max_turns: int = 4
    """Model turns per episode; an episode still calling tools after the last one ends truncated."""
    max_total_tokens: int = 512
    """Tokens of an episode after its prompt (model and observation tokens); past it the episode ends truncated."""
    step_timeout_s: float = 30.0
    """Deadline of each environment call (reset, step); past it the episode ends as failed."""
    failure_reward: float = 0.0
    """The reward of an episode whose environment failed (raised, hung, returned the wrong thing)."""
    observation_template: str | None = None
    """How an observation is rendered before it is tokenized: None = the tokenizer's chat template (a message of
    `observation_role`), or a template with {content} (tokenizers without a chat template)."""
    observation_role: str = "tool"
    """The chat-template role of observations."""
    schedule: str = "rounds"
    """`rounds`: all waiting episodes' turns in one generate call, then all environments step (reproducible);
    `continuous`: an episode's next turn joins the next call as soon as its environment answered (generation and
    tools overlap; batch composition follows tool timing, so runs are not bit-reproducible)."""

    @property
    def enabled(self) -> bool:
        return bool(self.env)

    def check(self, key: str) -> None:
        if self.max_turns < 1:
            raise UserError(f"{key}.max_turns={self.max_turns} must be >= 1")
        if self.max_total_tokens < 1:
            raise UserError(f"{key}.max_total_tokens={self.max_total_tokens} must be >= 1")
        if not self.step_timeout_s > 0:
            raise UserError(f"{key}.step_timeout_s={self.step_timeout_s} must be > 0")
        if self.schedule not in ("rounds", "continuous"):
            raise UserError(f"{key}.schedule={self.schedule!r}: valid are rounds, continuous")
        if self.observation_template is not None and self.observation_template.count("{content}") != 1:
            raise UserError(f"{key}.observation_template={self.observation_template!r} must contain {{content}} once")
