'''A verifiable code-writing task for RL of a code language model: write a function's body.

The prompt is Python source a model trained on Python files knows how to continue: the head of
`solve(values)` and its docstring, which lists the steps that turn a list of ints into the result
(`difficulty` of them, drawn from `KINDS`: filters, maps, reorderings, slices, a running sum...)
and shows two examples. The worked answer is the body, verbose and regular (each step's line as a
comment, then a loop that builds a new list), so that a draft has much to predict and a response is
long (about 150 to 220 tokens at difficulty 4 to 6 with a byte-level BPE of 8,192 ids, about 500
at the hardest, 12):

    def solve(values):
        """Return the list that these steps make of values, in order:
        - keep every other number, starting with the first
        - subtract 1 from each number
        >>> solve([3, 15, 4, -7])
        [2, 3]
        >>> solve([9, 15, 12, 20])
        [8, 11]
        """
        # keep every other number, starting with the first      <- the answer starts here
        result = []
        for index in range(len(values)):
            if index % 2 == 0:
                result.append(values[index])
        values = result
        # subtract 1 from each number
        result = []
        for value in values:
            result.append(value - 1)
        values = result
        return values

A response is scored by running it (`jspec.rl.sandbox`): the program is the prompt, the response
and a harness that calls `solve` on six hidden inputs (not the examples) and prints how many
outputs equal the expected lists, after a marker drawn for that run. The reward is the fraction
passed, 0.0 for a response that does not compile, crashes, hangs or exhausts memory. Problems are
drawn until every step shows in the hidden tests (leaving any one out fails one) and at most one
expected output is empty, so a body that skips a step or returns [] does not score 1. (The marker
stops a response that prints a count, not one that reads its own program to find the marker or
the harness's frame to find the expected outputs.)

It suits RL of the code model as `jspec.rl.tasks` suits the tiny ones: the reward is exact (and
graded: a fraction of the tests), the answers are long and regular, and `difficulty` (the number of
steps, 1 to `HARDEST`) is a knob that lengthens both prompt and answer.
'''

from __future__ import annotations

import dataclasses
import itertools
import re
import secrets
from collections.abc import Callable, Sequence

import numpy as np

from jspec.rl import sandbox

Ints = tuple[int, ...]
LOWEST, HIGHEST = -9, 20  # the ints of the inputs
EXAMPLES, HIDDEN = 2, 6  # inputs shown in the docstring, and the hidden tests'
# A right answer runs in milliseconds (request to answer at most 29 ms over 384 worked answers on a
# 2-core machine busy with a test run); a response that loops holds the whole step's scoring until
# its program is killed (at 0.5 s, that was a third to half of an RL step of the code model's, in
# a third to half of its steps), so the limit is a few times the slowest right answer.
TIMEOUT_S = 0.1
# The most steps a problem has: drawing one whose hidden tests tell every step apart takes 0.03 s
# at 12 steps and 0.4 s at 16 (the draws that do not are drawn again), and at 12 a worked answer
# nearly fills the code model's 512-token rollouts.
HARDEST = 12


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    prompt: str
    answer: str  # the worked reference response: the body of solve
    tests: tuple[tuple[Ints, Ints], ...]  # hidden (input, expected output) pairs


@dataclasses.dataclass(frozen=True)
class Step:
    text: str  # its line in the docstring
    code: str  # its lines in the answer, indented by 4 spaces
    apply: Callable[[list[int]], list[int]]  # the reference, for the expected outputs


def _keep(what: str, condition: str, test: Callable[[int], bool]) -> Step:
    code = (
        "    result = []\n"
        "    for value in values:\n"
        f"        if {condition}:\n"
        "            result.append(value)\n"
        "    values = result\n"
    )
    return Step(f"keep {what}", code, lambda values: [v for v in values if test(v)])


def _each(text: str, expression: str, function: Callable[[int], int]) -> Step:
    code = (
        "    result = []\n"
        "    for value in values:\n"
        f"        result.append({expression})\n"
        "    values = result\n"
    )
    return Step(text, code, lambda values: [function(v) for v in values])


def _either(text: str, condition: str, then: str, function: Callable[[int], int]) -> Step:
    code = (
        "    result = []\n"
        "    for value in values:\n"
        f"        if {condition}:\n"
        f"            result.append({then})\n"
        "        else:\n"
        "            result.append(value)\n"
        "    values = result\n"
    )
    return Step(text, code, lambda values: [function(v) for v in values])


def _positions(text: str, condition: str, apply: Callable[[list[int]], list[int]]) -> Step:
    code = (
        "    result = []\n"
        "    for index in range(len(values)):\n"
        f"        if {condition}:\n"
        "            result.append(values[index])\n"
        "    values = result\n"
    )
    return Step(text, code, apply)


REVERSE = (
    "    result = []\n"
    "    for index in range(len(values) - 1, -1, -1):\n"
    "        result.append(values[index])\n"
    "    values = result\n"
)
UNIQUE = (
    "    result = []\n"
    "    for value in values:\n"
    "        if value not in result:\n"
    "            result.append(value)\n"
    "    values = result\n"
)
RUNNING_SUM = (
    "    result = []\n"
    "    total = 0\n"
    "    for value in values:\n"
    "        total = total + value\n"
    "        result.append(total)\n"
    "    values = result\n"
)
APPEND = (
    "    result = []\n"
    "    for value in values:\n"
    "        result.append(value)\n"
    "    result.append({k})\n"
    "    values = result\n"
)

# Each kind of step: the range of its parameter k (inclusive; (0, 0) for none) and its Step.
KINDS: dict[str, tuple[tuple[int, int], Callable[[int], Step]]] = {
    "even": ((0, 0), lambda k: _keep("the even numbers", "value % 2 == 0", lambda v: v % 2 == 0)),
    "odd": ((0, 0), lambda k: _keep("the odd numbers", "value % 2 == 1", lambda v: v % 2 != 0)),
    "greater": (
        (-3, 8),
        lambda k: _keep(f"the numbers greater than {k}", f"value > {k}", lambda v: v > k),
    ),
    "less": (
        (4, 15),
        lambda k: _keep(f"the numbers less than {k}", f"value < {k}", lambda v: v < k),
    ),
    "divisible": (
        (3, 5),
        lambda k: _keep(f"the numbers divisible by {k}", f"value % {k} == 0", lambda v: v % k == 0),
    ),
    "add": ((1, 9), lambda k: _each(f"add {k} to each number", f"value + {k}", lambda v: v + k)),
    "subtract": (
        (1, 9),
        lambda k: _each(f"subtract {k} from each number", f"value - {k}", lambda v: v - k),
    ),
    "multiply": (
        (2, 5),
        lambda k: _each(f"multiply each number by {k}", f"value * {k}", lambda v: v * k),
    ),
    "divide": (
        (2, 4),
        lambda k: _each(
            f"divide each number by {k}, rounding down", f"value // {k}", lambda v: v // k
        ),
    ),
    "remainder": (
        (3, 7),
        lambda k: _each(
            f"replace each number by its remainder after division by {k}",
            f"value % {k}",
            lambda v: v - k * (v // k),
        ),
    ),
    "square": ((0, 0), lambda k: _each("square each number", "value * value", lambda v: v**2)),
    "negate": ((0, 0), lambda k: _each("negate each number", "-value", lambda v: -v)),
    "absolute": (
        (0, 0),
        lambda k: _either("replace each number by its absolute value", "value < 0", "-value", abs),
    ),
    "cap": (
        (5, 15),
        lambda k: _either(
            f"replace each number greater than {k} by {k}",
            f"value > {k}",
            f"{k}",
            lambda v: min(v, k),
        ),
    ),
    "sort": (
        (0, 0),
        lambda k: Step(
            "sort the numbers in ascending order", "    values = sorted(values)\n", sorted
        ),
    ),
    "sort_descending": (
        (0, 0),
        lambda k: Step(
            "sort the numbers in descending order",
            "    values = sorted(values, reverse=True)\n",
            lambda values: sorted(values)[::-1],
        ),
    ),
    "reverse": ((0, 0), lambda k: Step("reverse the order", REVERSE, lambda values: values[::-1])),
    "drop": (
        (1, 3),
        lambda k: _positions(f"drop the first {k} numbers", f"index >= {k}", lambda xs: xs[k:]),
    ),
    "first": (
        (2, 5),
        lambda k: _positions(f"keep the first {k} numbers", f"index < {k}", lambda xs: xs[:k]),
    ),
    "every_other": (
        (0, 0),
        lambda k: _positions(
            "keep every other number, starting with the first",
            "index % 2 == 0",
            lambda xs: xs[::2],
        ),
    ),
    "unique": (
        (0, 0),
        lambda k: Step(
            "remove duplicates, keeping the first of each",
            UNIQUE,
            lambda values: list(dict.fromkeys(values)),
        ),
    ),
    "running_sum": (
        (0, 0),
        lambda k: Step(
            "replace each number by the sum of it and the numbers before it",
            RUNNING_SUM,
            lambda values: list(itertools.accumulate(values)),
        ),
    ),
    "append": (
        (0, 9),
        lambda k: Step(f"put {k} at the end", APPEND.format(k=k), lambda values: values + [k]),
    ),
}

# The hidden tests live in the harness function's locals, and `solve` gets a copy of each input:
# a body cannot name them (as module globals it could `return _wanted`) or change them.
HARNESS = """
def _passed(tests):
    passed = 0
    for given, wanted in tests:
        try:
            got = solve(list(given))
            if type(got) is list and all(type(v) is int for v in got) and got == wanted:
                passed += 1
        except Exception:
            pass
    return passed
print("{marker}", _passed({tests}))
"""


def _run(steps: Sequence[Step], values: Ints) -> Ints:
    out = list(values)
    for step in steps:
        out = step.apply(out)
    return tuple(out)


def _draw_step(rng: np.random.Generator) -> Step:
    (low, high), make = KINDS[list(KINDS)[int(rng.integers(len(KINDS)))]]
    return make(int(rng.integers(low, high + 1)))


def _draw_inputs(rng: np.random.Generator) -> list[Ints]:
    """Distinct lists: EXAMPLES of 3 to 6 ints, then HIDDEN of 0 to 8."""
    inputs: list[Ints] = []
    while len(inputs) < EXAMPLES + HIDDEN:
        shortest, longest = (3, 6) if len(inputs) < EXAMPLES else (0, 8)
        size = int(rng.integers(shortest, longest + 1))
        values = tuple(int(v) for v in rng.integers(LOWEST, HIGHEST + 1, size))
        if values not in inputs:
            inputs.append(values)
    return inputs


def _telling(steps: Sequence[Step], examples: Sequence[Ints], hidden: Sequence[Ints]) -> bool:
    """The examples' outputs are not empty, at most one hidden output is, and the hidden tests
    tell the steps from the steps less any one of them (and from no steps at all)."""
    wanted = [_run(steps, x) for x in hidden]
    if not all(_run(steps, x) for x in examples) or sum(not w for w in wanted) > 1:
        return False
    fewer = [[*steps[:i], *steps[i + 1 :]] for i in range(len(steps))] + [[]]
    return all(
        any(_run(less, x) != w for x, w in zip(hidden, wanted, strict=True)) for less in fewer
    )


def problem(rng: np.random.Generator, difficulty: int) -> CodeProblem:
    """A problem of `difficulty` steps (1 to `HARDEST`), the same for the same state of `rng`."""
    if not 1 <= difficulty <= HARDEST:
        raise ValueError(f"difficulty={difficulty} is not a number of steps from 1 to {HARDEST}.")
    while True:
        steps = [_draw_step(rng) for _ in range(difficulty)]
        inputs = _draw_inputs(rng)
        examples, hidden = inputs[:EXAMPLES], inputs[EXAMPLES:]
        if _telling(steps, examples, hidden):
            break
    lines = "".join(f"    - {step.text}\n" for step in steps)
    shown = "".join(f"    >>> solve({list(x)})\n    {list(_run(steps, x))}\n" for x in examples)
    prompt = (
        'def solve(values):\n    """Return the list that these steps make of values, in order:\n'
        f'{lines}{shown}    """\n'
    )
    answer = "".join(f"    # {step.text}\n{step.code}" for step in steps) + "    return values\n"
    return CodeProblem(prompt, answer, tuple((x, _run(steps, x)) for x in hidden))


def program(problem: CodeProblem, response: str, marker: str) -> str:
    """What runs in the sandbox: the prompt, the response, and the harness printing `marker` and
    the number of hidden tests passed (from column 0 of a new line, whatever the response's end)."""
    tests = [(list(given), list(wanted)) for given, wanted in problem.tests]
    return problem.prompt + response + "\n" + HARNESS.format(tests=tests, marker=marker)


def score(
    problems: Sequence[CodeProblem], responses: Sequence[str], *, timeout_s: float = TIMEOUT_S
) -> np.ndarray:
    """The fraction of its problem's hidden tests each response passes, run all in parallel: 0.0
    when the program does not run to its end within `timeout_s` (a syntax error, a crash, a hang,
    memory). A response given to the same problem more than once (a group's answers often agree,
    word for word) runs once and each copy gets its score."""
    pairs = list(zip(problems, responses, strict=True))
    distinct = list(dict.fromkeys(pairs))
    markers = [secrets.token_hex(16) for _ in distinct]
    programs = [program(p, r, m) for (p, r), m in zip(distinct, markers, strict=True)]
    outcomes = sandbox.run_many(programs, timeout_s=timeout_s)
    scored = {}
    for (p, r), outcome, marker in zip(distinct, outcomes, markers, strict=True):
        passed = re.findall(rf"^{marker} (\d+)$", outcome.stdout, re.MULTILINE)
        ran = outcome.returncode == 0 and passed
        scored[p, r] = min(int(passed[-1]), len(p.tests)) / len(p.tests) if ran else 0.0
    return np.asarray([scored[pair] for pair in pairs])
