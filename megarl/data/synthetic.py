"""Synthetic verifiable tasks for the CPU quickstart: chain arithmetic with a short worked solution.

A problem is a left-to-right chain of small additions and subtractions, e.g. the prompt `8+5-9+7=`, and its worked
response writes one partial result per step, then a GSM8K-style answer line that the math verifier scores:

    8+5=13 13-9=4 4+7=11
    #### 11

Every character is a token for the char-level tokenizer, so prompts and responses are kept short (about 9 and 30
characters for four operands). Running values never go below zero: a `-` that would, is drawn as `+` instead, so
answers are non-negative integers.

Held-out problems are disjoint from training ones by construction: each distinct prompt falls in one of
`num_buckets` buckets by a stable hash (sha256 of the prompt), bucket 0 is the eval split and the rest the train
split. Everything is deterministic given the seed, on any machine and Python version.

Rows are JSON objects `{"prompt": ..., "label": ...}`, plus `"response"` (the worked solution, without EOS) for SFT.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megarl.errors import UserError

Split = Literal["train", "eval"]
ANSWER_PREFIX = "#### "


@dataclass(frozen=True)
class ChainArithmetic:
    """A family of chain-arithmetic problems and its fixed train/eval split."""

    num_operands: int = 4
    """Numbers per problem (>= 2); the worked response has num_operands - 1 steps."""
    min_operand: int = 1
    """Smallest operand (>= 0)."""
    max_operand: int = 19
    """Largest operand."""
    ops: str = "+-"
    """Operators to draw from, each step uniformly; a subset of '+-'."""
    num_buckets: int = 10
    """Prompts are hashed into this many buckets; bucket 0 is held out for eval (about 1/num_buckets of problems)."""

    def check(self, key: str = "task") -> None:
        if self.num_operands < 2:
            raise UserError(f"{key}.num_operands={self.num_operands} must be >= 2")
        if not 0 <= self.min_operand <= self.max_operand:
            raise UserError(
                f"{key}.min_operand={self.min_operand}, {key}.max_operand={self.max_operand}: "
                "need 0 <= min_operand <= max_operand"
            )
        if not self.ops or set(self.ops) - set("+-"):
            raise UserError(f"{key}.ops={self.ops!r} must be a non-empty subset of '+-'")
        if self.num_buckets < 2:
            raise UserError(f"{key}.num_buckets={self.num_buckets} must be >= 2 (one bucket is held out)")

    @property
    def num_problems(self) -> int:
        """Distinct operand tuples times operator choices (an upper bound on distinct prompts)."""
        num_values = self.max_operand - self.min_operand + 1
        return num_values**self.num_operands * len(self.ops) ** (self.num_operands - 1)


@dataclass(frozen=True)
class Problem:
    """One problem: operands and operators, left to right."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def prompt(self) -> str:
        text = str(self.operands[0])
        for op, operand in zip(self.ops, self.operands[1:]):
            text += f"{op}{operand}"
        return text + "="

    @property
    def answer(self) -> int:
        return self.partial_results()[-1]

    def partial_results(self) -> list[int]:
        values = [self.operands[0]]
        for op, operand in zip(self.ops, self.operands[1:]):
            values.append(values[-1] + operand if op == "+" else values[-1] - operand)
        return values

    @property
    def response(self) -> str:
        """The worked solution: one `a<op>b=c` step per operator, then the answer line."""
        values = self.partial_results()
        steps = [
            f"{values[i]}{op}{operand}={values[i + 1]}"
            for i, (op, operand) in enumerate(zip(self.ops, self.operands[1:]))
        ]
        return " ".join(steps) + f"\n{ANSWER_PREFIX}{values[-1]}"


def split_of(prompt: str, num_buckets: int) -> Split:
    """Which split a prompt belongs to: a stable hash, independent of seed and sampling order."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "little") % num_buckets == 0 else "train"


def sample_problem(task: ChainArithmetic, rng: random.Random) -> Problem:
    """One problem from the whole family (either split); a '-' that would go below zero becomes '+'."""
    operands = [rng.randint(task.min_operand, task.max_operand) for _ in range(task.num_operands)]
    ops: list[str] = []
    value = operands[0]
    for operand in operands[1:]:
        op = rng.choice(task.ops)
        if op == "-" and value - operand < 0:
            op = "+"
        value = value + operand if op == "+" else value - operand
        ops.append(op)
    return Problem(tuple(operands), tuple(ops))


def make_problems(
    task: ChainArithmetic, split: Split, num_problems: int, seed: int, unique: bool = False
) -> list[Problem]:
    """`num_problems` problems of one split, drawn by rejection; `unique=True` draws distinct prompts (for eval)."""
    task.check()
    # Guard the rejection loop: the held-out split holds about 1/num_buckets of the family.
    available = task.num_problems // task.num_buckets if split == "eval" else task.num_problems
    if unique and num_problems > available // 2:
        raise UserError(
            f"asked for {num_problems} distinct {split} problems but the task has only about {available}; "
            "widen min_operand..max_operand or add operands"
        )
    rng = random.Random(f"{seed}:{split}")
    problems: list[Problem] = []
    seen: set[str] = set()
    while len(problems) < num_problems:
        problem = sample_problem(task, rng)
        prompt = problem.prompt
        if split_of(prompt, task.num_buckets) != split or (unique and prompt in seen):
            continue
        seen.add(prompt)
        problems.append(problem)
    return problems


def sft_rows(problems: list[Problem]) -> list[dict[str, str]]:
    return [{"prompt": p.prompt, "response": p.response, "label": str(p.answer)} for p in problems]


def prompt_rows(problems: list[Problem]) -> list[dict[str, str]]:
    return [{"prompt": p.prompt, "label": str(p.answer)} for p in problems]


def write_jsonl(rows: list[dict[str, str]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_quickstart_data(
    out_dir: str | Path,
    task: ChainArithmetic | None = None,
    num_sft: int = 20000,
    num_rl: int = 20000,
    num_eval: int = 256,
    seed: int = 0,
) -> dict[str, Path]:
    """Write sft.jsonl (prompt, response, label), rl.jsonl (prompt, label) and eval.jsonl (distinct held-out prompts).

    SFT and RL rows come from the train split with different sample streams, eval rows from the held-out split.
    """
    task = task or ChainArithmetic()
    out_dir = Path(out_dir)
    return {
        "sft": write_jsonl(sft_rows(make_problems(task, "train", num_sft, seed=seed)), out_dir / "sft.jsonl"),
        "rl": write_jsonl(prompt_rows(make_problems(task, "train", num_rl, seed=seed + 1)), out_dir / "rl.jsonl"),
        "eval": write_jsonl(
            prompt_rows(make_problems(task, "eval", num_eval, seed=seed, unique=True)), out_dir / "eval.jsonl"
        ),
    }


def parse_answer(text: str) -> str | None:
    """The number on the last `#### ` line of a response, or None (a minimal verifier for tests and prototypes)."""
    index = text.rfind(ANSWER_PREFIX)
    if index < 0:
        return None
    token = text[index + len(ANSWER_PREFIX) :].strip().split("\n")[0].strip()
    try:
        return str(int(token))
    except ValueError:
        return None
