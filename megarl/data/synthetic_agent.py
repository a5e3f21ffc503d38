"""The agent quickstart's task: two-digit multiplication, which a tiny model cannot do in its head but a calculator
can.

A problem is `37*48=`. A demonstration calls the calculator in the tag format (megarl/agents/tool_calls.py), reads
the result, and answers GSM8K-style:

    <tool>calculator(37*48)</tool> = 1776
    #### 1776

(` = 1776\\n` is the observation: the tool environment's answer, rendered with agent.observation_template
` = {content}\\n`). Like the main quickstart's, the demonstrations are imperfect on purpose: with probability
`skip_tool` a demonstration answers at once with a guess that is off in one digit (`#### 1736`). SFT learns the
format and the habit of sometimes skipping the tool; multi-turn GRPO with the calculator has to learn to use it.

Rows are JSON objects `{"prompt": ..., "label": ...}`, plus `"response"` for SFT (the observation is part of the
text there: the SFT loss covers it; the model learns to copy the number it reads). Held-out problems are disjoint
from training ones (by hash of the prompt). `python -m megarl.data.synthetic_agent [OUT_DIR]` writes the files
(`examples/agent_quickstart/` by default).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from megarl.data.synthetic import ANSWER_PREFIX, Split, split_of_text, write_jsonl
from megarl.errors import UserError

AGENT_QUICKSTART_DIR = Path(__file__).resolve().parents[2] / "examples" / "agent_quickstart"
OBSERVATION_TEMPLATE = " = {content}\n"
"""agent.observation_template of the agent quickstart: how the calculator's answer follows the call."""


@dataclass(frozen=True)
class MultiplicationTask:
    skip_tool: float = 0.5
    """Probability that a demonstration skips the calculator and guesses (wrong in one digit)."""
    eval_fraction: float = 0.1

    def check(self, key: str = "task") -> None:
        if not 0.0 <= self.skip_tool <= 1.0:
            raise UserError(f"{key}.skip_tool={self.skip_tool} must be in [0, 1]")
        if not 0.0 < self.eval_fraction < 1.0:
            raise UserError(f"{key}.eval_fraction={self.eval_fraction} must be in (0, 1)")


@dataclass(frozen=True)
class Product:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}*{self.b}="

    @property
    def answer(self) -> int:
        return self.a * self.b

    def with_tool(self) -> str:
        call = f"<tool>calculator({self.a}*{self.b})</tool>"
        return call + OBSERVATION_TEMPLATE.format(content=self.answer) + f"{ANSWER_PREFIX}{self.answer}"

    def guessed(self, rng: random.Random) -> str:
        """An answer off in one digit (never the right one)."""
        digits = list(str(self.answer))
        position = rng.randrange(1, len(digits)) if len(digits) > 1 else 0  # keep the leading digit
        digits[position] = str((int(digits[position]) + rng.randint(1, 9)) % 10)
        return f"{ANSWER_PREFIX}{int(''.join(digits))}"


def make_products(task: MultiplicationTask, split: Split, count: int, rng: random.Random, unique: bool = False):
    products, seen = [], set()
    while len(products) < count:
        product = Product(rng.randint(10, 99), rng.randint(10, 99))
        if split_of_text(product.prompt, task.eval_fraction) != split or (unique and product in seen):
            continue
        seen.add(product)
        products.append(product)
    return products


def write_agent_quickstart_data(
    out_dir: str | Path, task: MultiplicationTask | None = None, num_sft: int = 2000, num_rl: int = 4000,
    num_eval: int = 256, seed: int = 0,
) -> dict[str, Path]:  # fmt: skip
    """sft.jsonl (prompt, response, label), rl.jsonl and eval.jsonl (prompt, label); one sample stream each."""
    task = task or MultiplicationTask()
    task.check()
    out_dir = Path(out_dir)

    def stream(name: str) -> random.Random:
        return random.Random(f"{seed}:agent:{name}")

    sft_stream = stream("sft")
    sft = [
        {"prompt": p.prompt, "response": p.guessed(sft_stream) if sft_stream.random() < task.skip_tool
         else p.with_tool(), "label": str(p.answer)}
        for p in make_products(task, "train", num_sft, sft_stream)
    ]  # fmt: skip
    rows = {
        "sft": sft,
        "rl": [
            {"prompt": p.prompt, "label": str(p.answer)} for p in make_products(task, "train", num_rl, stream("rl"))
        ],
        "eval": [
            {"prompt": p.prompt, "label": str(p.answer)}
            for p in make_products(task, "eval", num_eval, stream("eval"), unique=True)
        ],
    }
    return {name: write_jsonl(r, out_dir / f"{name}.jsonl") for name, r in rows.items()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else AGENT_QUICKSTART_DIR
    for name, path in write_agent_quickstart_data(out_dir).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
