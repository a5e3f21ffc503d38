"""Multi-turn agent RL: environments, tools, and token-exact trajectories (docs/architecture.md, "Agent episodes").

Built so far: tool-call parsing (tool_calls.py), the calculator tool (calculator.py) and token-exact trajectories with
observations rendered by the chat template (trajectory.py). Not yet: the episode runner over the rollout engines, the
environment interface, the Python code tool, the trainer wiring and the agent quickstart (issue 18).
"""
