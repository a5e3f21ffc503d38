"""The quickstart's verifiable task: multi-digit addition with a worked, digit-by-digit solution.

A problem is `47+38=`; its worked response adds one column per step, right to left, carrying into the next column,
then gives a GSM8K-style answer line that the math verifier scores:

    7+8=15 4+3+1=8
    #### 85

Like most cold-start data, the SFT demonstrations are imperfect on purpose: with probability `forget_carry` a
problem that needs a carry is demonstrated with the carry dropped (`7+8=15 4+3=7` / `#### 75`). SFT copies the
format, the digit sums and the sloppiness; GRPO with the rule reward (answer == label) then has something real to fix,
and held-out accuracy measures whether it did. Every character is one token for the char-level tokenizer.

Held-out problems are disjoint from training ones by construction: a problem is in the eval split when the first
byte of sha256("a+b") is below `256 * eval_fraction`. Sampling is deterministic given (seed, stream) on any machine
and Python version (`random.Random` seeded with a string, independent of PYTHONHASHSEED).

Rows are JSON objects `{"prompt": ..., "label": ...}`, plus `"response"` (the worked solution, without EOS) for SFT.
`python -m megarl.data.synthetic [OUT_DIR]` writes the quickstart's files (`examples/quickstart/` by default).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megarl.errors import UserError

Split = Literal["train", "eval"]
ANSWER_PREFIX = "#### "
QUICKSTART_DIR = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


@dataclass(frozen=True)
class AdditionTask:
    """Additions of two `num_digits`-digit numbers, their worked solutions, and a fixed train/eval split."""

    num_digits: int = 2
    """Digits per operand (>= 1); operands are drawn uniformly from 10**(n-1)..10**n - 1."""
    forget_carry: float = 0.6
    """Probability that an SFT demonstration of a problem with a carry drops it (a wrong but well-formed answer)."""
    eval_fraction: float = 0.1
    """About this fraction of all problems is held out for eval (by hash, so never seen in training)."""

    def check(self, key: str = "task") -> None:
        if self.num_digits < 1:
            raise UserError(f"{key}.num_digits={self.num_digits} must be >= 1")
        if not 0.0 <= self.forget_carry <= 1.0:
            raise UserError(f"{key}.forget_carry={self.forget_carry} must be in [0, 1]")
        if not 0.0 < self.eval_fraction < 1.0:
            raise UserError(f"{key}.eval_fraction={self.eval_fraction} must be in (0, 1)")

    @property
    def num_problems(self) -> int:
        low, high = 10 ** (self.num_digits - 1), 10**self.num_digits
        return (high - low) ** 2


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def has_carry(self) -> bool:
        """A carry into a further column (one that a demonstration can forget; the leading column's is just a digit)."""
        return any(step.carry_out for step in column_steps(self.a, self.b)[:-1])

    def response(self, forget_carry: bool = False) -> str:
        """The worked solution; `forget_carry=True` drops every carry (the answer is then wrong if one was needed)."""
        steps = column_steps(self.a, self.b, forget_carry)
        work = " ".join(step.text for step in steps)
        digits = "".join(str(step.total % 10) for step in reversed(steps))
        if steps[-1].total >= 10:
            digits = "1" + digits
        return f"{work}\n{ANSWER_PREFIX}{int(digits)}"


@dataclass(frozen=True)
class ColumnStep:
    a: int
    b: int
    carry_in: int
    total: int

    @property
    def carry_out(self) -> int:
        return self.total // 10

    @property
    def text(self) -> str:
        carry = f"+{self.carry_in}" if self.carry_in else ""
        return f"{self.a}+{self.b}{carry}={self.total}"


def column_steps(a: int, b: int, forget_carry: bool = False) -> list[ColumnStep]:
    """One step per column, ones first; the last column is the longer operand's leading digit."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for column in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[column]) if column < len(digits_a) else 0
        y = int(digits_b[column]) if column < len(digits_b) else 0
        step = ColumnStep(x, y, carry, x + y + carry)
        steps.append(step)
        carry = 0 if forget_carry else step.carry_out
    return steps


def split_of(problem: Problem, eval_fraction: float) -> Split:
    """The problem's split, from a stable hash of its prompt (not Python's salted hash())."""
    return split_of_text(f"{problem.a}+{problem.b}", eval_fraction)


def split_of_text(key: str, eval_fraction: float) -> Split:
    """A split from the first byte of sha256(key): the same on every machine and Python version."""
    first_byte = hashlib.sha256(key.encode()).digest()[0]
    return "eval" if first_byte < round(256 * eval_fraction) else "train"


def parse_answer(response: str) -> str | None:
    """The number after the last `#### `, as the gsm8k verifier reads it; None without one."""
    found = re.findall(rf"{re.escape(ANSWER_PREFIX)}(-?\d+)", response)
    return found[-1] if found else None


def make_problems(
    task: AdditionTask, split: Split, num_problems: int, rng: random.Random, unique: bool = False
) -> list[Problem]:
    """`num_problems` problems of one split, drawn by rejection; `unique=True` draws distinct problems (for eval)."""
    task.check()
    available = task.num_problems * (task.eval_fraction if split == "eval" else 1 - task.eval_fraction)
    if unique and num_problems > available / 2:
        raise UserError(
            f"asked for {num_problems} distinct {split} problems but the task has only about {int(available)}; "
            "use more digits or a larger eval_fraction"
        )
    low, high = 10 ** (task.num_digits - 1), 10**task.num_digits - 1
    problems: list[Problem] = []
    seen: set[Problem] = set()
    while len(problems) < num_problems:
        problem = Problem(rng.randint(low, high), rng.randint(low, high))
        if split_of(problem, task.eval_fraction) != split or (unique and problem in seen):
            continue
        seen.add(problem)
        problems.append(problem)
    return problems


def sft_rows(task: AdditionTask, problems: list[Problem], rng: random.Random) -> list[dict[str, str]]:
    """Imperfect demonstrations: a problem with a carry forgets it with probability task.forget_carry."""
    rows = []
    for problem in problems:
        forget = problem.has_carry and rng.random() < task.forget_carry
        rows.append({"prompt": problem.prompt, "response": problem.response(forget), "label": str(problem.answer)})
    return rows


def prompt_rows(problems: list[Problem]) -> list[dict[str, str]]:
    return [{"prompt": problem.prompt, "label": str(problem.answer)} for problem in problems]


def write_jsonl(rows: list[dict[str, str]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_quickstart_data(
    out_dir: str | Path,
    task: AdditionTask | None = None,
    num_sft: int = 6000,
    num_rl: int = 6000,
    num_eval: int = 256,
    seed: int = 0,
) -> dict[str, Path]:
    """Write sft.jsonl (prompt, response, label), rl.jsonl (prompt, label) and eval.jsonl (distinct held-out prompts).

    Each file has its own sample stream, so changing one size leaves the other files as they were.
    """
    task = task or AdditionTask()
    task.check()
    out_dir = Path(out_dir)

    def stream(name: str) -> random.Random:
        return random.Random(f"{seed}:{name}")

    sft_stream = stream("sft")
    sft = sft_rows(task, make_problems(task, "train", num_sft, sft_stream), sft_stream)
    rl = prompt_rows(make_problems(task, "train", num_rl, stream("rl")))
    held_out = prompt_rows(make_problems(task, "eval", num_eval, stream("eval"), unique=True))
    return {
        "sft": write_jsonl(sft, out_dir / "sft.jsonl"),
        "rl": write_jsonl(rl, out_dir / "rl.jsonl"),
        "eval": write_jsonl(held_out, out_dir / "eval.jsonl"),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else QUICKSTART_DIR
    for name, path in write_quickstart_data(out_dir).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
