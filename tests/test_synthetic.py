"""The quickstart's synthetic task: worked solutions by hand, deterministic files, train/eval disjoint, the imperfect
demonstrations as documented, and the committed files in examples/quickstart/ equal to what the generator writes."""

from __future__ import annotations

import json
import random

import pytest

from megarl.data.synthetic import (
    QUICKSTART_DIR,
    AdditionTask,
    Problem,
    make_problems,
    parse_answer,
    split_of,
    write_quickstart_data,
)
from megarl.errors import UserError


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "a, b, response, forgotten",
    [
        (47, 38, "7+8=15 4+3+1=8\n#### 85", "7+8=15 4+3=7\n#### 75"),
        (12, 34, "2+4=6 1+3=4\n#### 46", "2+4=6 1+3=4\n#### 46"),
        (99, 99, "9+9=18 9+9+1=19\n#### 198", "9+9=18 9+9=18\n#### 188"),
        (5, 7, "5+7=12\n#### 12", "5+7=12\n#### 12"),
        (905, 95, "5+5=10 0+9+1=10 9+0+1=10\n#### 1000", "5+5=10 0+9=9 9+0=9\n#### 990"),
    ],
)
def test_worked_solutions_by_hand(a, b, response, forgotten):
    problem = Problem(a, b)
    assert problem.response() == response and parse_answer(response) == str(a + b)
    assert problem.response(forget_carry=True) == forgotten
    assert problem.has_carry == (forgotten != response)


def test_files_deterministic_and_streams_independent(tmp_path):
    first = write_quickstart_data(tmp_path / "a", num_sft=200, num_rl=200, num_eval=100, seed=7)
    second = write_quickstart_data(tmp_path / "b", num_sft=200, num_rl=50, num_eval=100, seed=7)
    other_seed = write_quickstart_data(tmp_path / "c", num_sft=200, num_rl=200, num_eval=100, seed=8)
    assert first["sft"].read_bytes() == second["sft"].read_bytes()
    assert first["eval"].read_bytes() == second["eval"].read_bytes()
    assert first["sft"].read_bytes() != other_seed["sft"].read_bytes()


def test_train_and_eval_disjoint_and_eval_unique(tmp_path):
    paths = write_quickstart_data(tmp_path, num_sft=3000, num_rl=3000, num_eval=256)
    train = {row["prompt"] for name in ("sft", "rl") for row in read_jsonl(paths[name])}
    held_out = [row["prompt"] for row in read_jsonl(paths["eval"])]
    assert len(set(held_out)) == 256 and not train & set(held_out)


def test_demonstrations_forget_carries_at_the_documented_rate(tmp_path):
    rows = read_jsonl(write_quickstart_data(tmp_path, num_sft=4000, num_rl=1, num_eval=1)["sft"])
    with_carry = [row for row in rows if Problem(*map(int, row["prompt"][:-1].split("+"))).has_carry]
    wrong = [row for row in with_carry if parse_answer(row["response"]) != row["label"]]
    assert 0.55 < len(wrong) / len(with_carry) < 0.65
    no_carry = [row for row in rows if row not in with_carry]
    assert all(parse_answer(row["response"]) == row["label"] for row in no_carry)
    # Labels are always the true sum: the reward is right even where the demonstration is not.
    assert all(int(row["label"]) == eval(row["prompt"][:-1]) for row in rows)


def test_eval_split_is_about_the_asked_fraction():
    problems = make_problems(AdditionTask(), "train", 1, random.Random(0))  # the check runs before drawing
    assert len(problems) == 1
    counts = {"train": 0, "eval": 0}
    for a in range(10, 100):
        for b in range(10, 100):
            counts[split_of(Problem(a, b), 0.1)] += 1
    assert 0.08 < counts["eval"] / sum(counts.values()) < 0.12


def test_committed_quickstart_files_match_the_generator(tmp_path):
    """examples/quickstart/ is what `python -m megarl.data.synthetic` writes; the README's numbers were measured on
    exactly these files."""
    paths = write_quickstart_data(tmp_path)
    for name, path in paths.items():
        assert (QUICKSTART_DIR / f"{name}.jsonl").read_bytes() == path.read_bytes(), name


def test_bad_task_and_too_many_eval_problems():
    with pytest.raises(UserError, match="task.num_digits=0"):
        AdditionTask(num_digits=0).check()
    with pytest.raises(UserError, match="forget_carry=1.5"):
        AdditionTask(forget_carry=1.5).check()
    with pytest.raises(UserError, match="distinct eval problems"):
        make_problems(AdditionTask(num_digits=1), "eval", 50, random.Random(0), unique=True)


def test_committed_agent_quickstart_files_match_the_generator(tmp_path):
    """examples/agent_quickstart/ is what `python -m megarl.data.synthetic_agent` writes."""
    from megarl.data.synthetic_agent import AGENT_QUICKSTART_DIR, write_agent_quickstart_data

    for name, path in write_agent_quickstart_data(tmp_path).items():
        assert (AGENT_QUICKSTART_DIR / f"{name}.jsonl").read_bytes() == path.read_bytes(), name


def test_agent_demonstrations_call_the_calculator_or_guess_wrong():
    from megarl.agents.tool_calls import parse_tool_calls
    from megarl.data.synthetic_agent import MultiplicationTask, Product, make_products

    product = Product(37, 48)
    assert product.with_tool() == "<tool>calculator(37*48)</tool> = 1776\n#### 1776"
    (call,) = parse_tool_calls(product.with_tool(), "tag")
    assert call.name == "calculator" and call.arguments == {"input": "37*48"}
    rng = random.Random(0)
    guesses = [product.guessed(rng) for _ in range(50)]
    assert all(g.startswith("#### 1") and g != "#### 1776" and len(g) == len("#### 1776") for g in guesses)
    train = make_products(MultiplicationTask(), "train", 300, random.Random(1))
    held_out = make_products(MultiplicationTask(), "eval", 30, random.Random(2), unique=True)
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
