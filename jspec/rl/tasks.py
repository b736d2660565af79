"""Verifiable tasks with exact rewards, and their prompts and answers as tokens.

A task (`Task`) makes a problem (a prompt and its worked reference answer) from a numpy generator
at a difficulty, and scores a batch of responses, exactly. The arithmetic tasks score a response by
its final answer alone (1.0 right, 0.0 otherwise); their worked answers are long and regular (a
draft has much to predict) and their difficulty (digits, list or string length) is a knob, so a
tiny model learns the easy setting in minutes on a CPU and a shift to a harder one
(`TaskConfig.shift_step`) makes the policy move part-way through a run.

    addition  "47+85="          -> "7+5+0=12,4+8+1=13;132"   columns from the right, with carries
    sorting   "sort 3142="      -> "1234"
    counting  "count 1 in 3121=" -> "1:1,2:0,3:1,4:0;2"       a running tally, then the count
    code      "def solve(values): ..." -> its body, scored by hidden tests run in a sandbox
              (`jspec.rl.code_task`: for a code model; difficulty is the number of steps)
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jspec.config import ConfigError, TaskConfig
from jspec.rl import code_task

ANSWER_MARK = ";"  # a worked answer ends with ANSWER_MARK and the final answer


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the worked reference response

    @property
    def final(self) -> str:
        return final_answer(self.answer)


def final_answer(response: str) -> str:
    """The part of a response after its last ANSWER_MARK (the whole response if it has none)."""
    return response.rsplit(ANSWER_MARK, 1)[-1].strip()


def reward(problem: Problem, response: str) -> float:
    """1.0 when the response's final answer equals the reference's, else 0.0."""
    return float(final_answer(response) == problem.final)


def _addition(rng: np.random.Generator, digits: int) -> Problem:
    a, b = (int(rng.integers(10 ** (digits - 1), 10**digits)) for _ in range(2))
    columns, carry = [], 0
    for da, db in zip(reversed(f"{a}"), reversed(f"{b}"), strict=True):
        total = int(da) + int(db) + carry
        columns.append(f"{da}+{db}+{carry}={total}")
        carry = total // 10
    return Problem(f"{a}+{b}=", ",".join(columns) + f"{ANSWER_MARK}{a + b}")


def _sorting(rng: np.random.Generator, difficulty: int) -> Problem:
    items = "".join(map(str, rng.integers(0, 10, difficulty + 2)))
    return Problem(f"sort {items}=", "".join(sorted(items)))


def _counting(rng: np.random.Generator, difficulty: int) -> Problem:
    text = "".join(map(str, rng.integers(0, 5, difficulty + 2)))
    target = str(rng.integers(0, 5))
    tally = ",".join(f"{c}:{int(c == target)}" for c in text)
    return Problem(f"count {target} in {text}=", f"{tally}{ANSWER_MARK}{text.count(target)}")


def _exactly(problems: Sequence[Problem], responses: Sequence[str]) -> np.ndarray:
    return np.asarray([reward(p, r) for p, r in zip(problems, responses, strict=True)])


class Task(NamedTuple):
    """A problem maker (a generator and a difficulty in; a problem with `prompt` and `answer`,
    the worked reference response, out), the scorer of a batch of its responses, and the hardest
    difficulty it makes."""

    make: Callable[[np.random.Generator, int], Any]
    score: Callable[[Sequence[Any], Sequence[str]], np.ndarray]
    hardest: int


TASKS: dict[str, Task] = {
    "addition": Task(_addition, _exactly, 8),
    "sorting": Task(_sorting, _exactly, 8),
    "counting": Task(_counting, _exactly, 8),
    "code": Task(code_task.problem, code_task.score, code_task.HARDEST),
}


def check_task(name: str, where: str = "rl.task.name") -> None:
    """Raises ConfigError unless `name` is a task of TASKS (the one list of their names)."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{where}={name!r} is not a task; use one of {', '.join(map(repr, TASKS))}.{hint}"
        )


def check_tasks(config: TaskConfig) -> None:
    """The task, and the task it shifts to, are tasks of TASKS, at difficulties (the spread's
    hardest included) they make."""
    check_task(config.name, "rl.task.name")
    if config.shifted_name is not None:
        check_task(config.shifted_name, "rl.task.shifted_name")
    shifted = ((config.shift_step, "shifted_difficulty"),) if config.shift_step else ()
    for step, field in ((0, "difficulty"), *shifted):
        name, difficulty = task_at(config, step)
        hardest = TASKS[name].hardest
        if difficulty + config.spread > hardest:
            raise ConfigError(
                f"rl.task.{field}={difficulty} plus rl.task.spread={config.spread} passes "
                f"{hardest}, the hardest difficulty of the {name!r} task; lower the spread to at "
                f"most {max(hardest - difficulty, 0)}"
                + ("." if difficulty <= hardest else f" and the difficulty to at most {hardest}.")
            )


def task_at(config: TaskConfig, step: int) -> tuple[str, int]:
    """(name, difficulty) of the task in effect at RL step `step` (after a shift, if any)."""
    if config.shift_step and step >= config.shift_step:
        return (config.shifted_name or config.name, config.shifted_difficulty or config.difficulty)
    return config.name, config.difficulty


def problems(config: TaskConfig, step: int, count: int, seed: int, stream: int = 0) -> list:
    """`count` problems of the task in effect at `step`, the same for the same (seed, stream,
    step); streams keep data apart (0: RL prompts, 1: the SFT warm start). With a spread, each
    problem's difficulty is drawn first (`TaskConfig.spread`)."""
    name, difficulty = task_at(config, step)
    check_task(name)
    rng = np.random.default_rng((seed, stream, step))
    odds = config.spread_decay ** np.arange(config.spread + 1)
    draw = lambda: difficulty + int(rng.choice(len(odds), p=odds / odds.sum()))
    return [TASKS[name].make(rng, draw() if config.spread else difficulty) for _ in range(count)]


def rewards(config: TaskConfig, step: int, batch: Sequence[Any], responses: Sequence[str]):
    """The rewards [B] of `responses` to the problems `batch` of RL step `step`."""
    return TASKS[task_at(config, step)[0]].score(batch, responses)


def rewards_by_step(config: TaskConfig, steps: Sequence[int], batch, responses) -> np.ndarray:
    """`rewards` of a batch whose sequences answer problems of several steps (`steps`, one per
    sequence: partial rollouts train groups of earlier steps), each by its own step's task."""
    out = np.zeros(len(responses), np.float32)
    for step in sorted(set(steps)):
        at = [i for i, s in enumerate(steps) if s == step]
        out[at] = rewards(config, step, [batch[i] for i in at], [responses[i] for i in at])
    return out


def widths(config: TaskConfig, tokenizer, seed: int = 0, samples: int = 1024) -> tuple[int, int]:
    """Static shapes for rollouts and training rows, from `samples` problems of the run's tasks
    (before and after the shift) at their hardest: the prompt width (the longest prompt and an
    eighth more, at least 8 tokens: lengths vary with the numbers drawn, and the sample's longest
    is not the task's) and the longest worked answer (which rollout.max_new_tokens must hold)."""
    seen = []
    for step in (0, config.shift_step) if config.shift_step else (0,):
        name, difficulty = task_at(config, step)
        rng = np.random.default_rng((seed, 0, step))
        seen += [TASKS[name].make(rng, difficulty + config.spread) for _ in range(samples)]
    longest = lambda texts: max(len(tokenizer.encode(t)) for t in texts)
    prompts = longest(p.prompt for p in seen)
    return prompts + max(8, prompts // 8), longest(p.answer for p in seen)


def _pad_rows(rows: list[list[int]], width: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows cut to `width` (with a warning: a cut prompt is not the one scored) and
    right-padded with `fill` [B, width], and their lengths [B]."""
    tokens = np.full((len(rows), width), fill, np.int32)
    lengths = np.asarray([min(len(r), width) for r in rows], np.int32)
    for i, row in enumerate(rows):
        tokens[i, : lengths[i]] = row[:width]
    cut = sum(len(r) > width for r in rows)
    if cut:
        warnings.warn(
            f"{cut} of {len(rows)} rows of tokens were cut to the static width of {width} "
            f"(the longest had {max(map(len, rows))}); the task's problems outgrow the widths "
            "estimated from a sample (jspec.rl.tasks.widths)",
            stacklevel=3,
        )
    return tokens, lengths


def encode_prompts(tokenizer, batch: Sequence[Any], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt tokens right-padded with the tokenizer's padding id [B, width], and their lengths
    [B] (int32). Each distinct prompt is encoded once: a group's responses share theirs."""
    encoded = {
        prompt: tokenizer.encode(prompt) for prompt in dict.fromkeys(p.prompt for p in batch)
    }
    return _pad_rows([encoded[p.prompt] for p in batch], width, tokenizer.pad_id)


def encode_answers(tokenizer, batch: Sequence[Any], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference responses with the end-of-sequence token, right-padded with -1 [B, width], and
    their lengths."""
    return _pad_rows([tokenizer.encode(p.answer) + [tokenizer.eos_id] for p in batch], width, -1)
