"""The code-writing task: its reference answers pass their hidden tests, wrong, hanging and
crashing bodies do not, the reward cannot be had by printing, and problems are reproducible."""

import numpy as np
import pytest

from jspec.rl import code_task


def problems(difficulty: int, seeds: range) -> list[code_task.CodeProblem]:
    return [code_task.problem(np.random.default_rng(seed), difficulty) for seed in seeds]


def test_the_reference_answer_passes_every_hidden_test():
    """Correctness, not speed: a right answer runs in milliseconds, but on a CPU busy with the
    rest of the suite a program's start has once taken longer than the run's 0.1 s limit."""
    batch = [p for d in range(1, 9) for p in problems(d, range(6))]
    scores = code_task.score(batch, [p.answer for p in batch], timeout_s=2.0)
    assert scores.tolist() == [1.0] * len(batch)


def test_a_body_that_leaves_out_a_step_or_returns_early_fails_a_test():
    """Problems are drawn so the hidden tests tell every step (and returning [] passes one test
    at most)."""
    batch, responses = [], []
    for p in problems(4, range(4)):
        chunks = p.answer.split("    # ")[1:]  # each step: its comment, then its code
        for i in range(len(chunks)):
            batch.append(p)
            responses.append("".join("    # " + c for j, c in enumerate(chunks) if j != i))
        batch += [p, p]
        responses += ["    return values\n", "    return []\n"]
    rewards = code_task.score(batch, responses)
    assert (rewards < 1).all()
    empty = np.asarray(responses) == "    return []\n"
    assert (rewards[empty] <= 1 / code_task.HIDDEN).all()


def test_a_response_repeated_for_its_problem_runs_once_and_each_copy_is_scored(monkeypatch):
    p, q = problems(3, range(2))
    batch = [p, p, q, p, q]
    responses = [p.answer, p.answer, p.answer, "    return []\n", q.answer]
    ran = []
    run_many = code_task.sandbox.run_many
    monkeypatch.setattr(
        code_task.sandbox,
        "run_many",
        lambda programs, **kw: ran.extend(programs) or run_many(programs, **kw),
    )
    rewards = code_task.score(batch, responses).tolist()
    assert len(ran) == 4  # p's answer once, for p; p's answer to q; [] to p; q's answer
    assert rewards[0] == rewards[1] == rewards[4] == 1.0 and rewards[2] < 1 and rewards[3] < 1


def test_hangs_crashes_and_bad_syntax_score_zero():
    p = code_task.problem(np.random.default_rng(0), 3)
    responses = [
        "    while True:\n        pass\n",
        "    raise ValueError('no')\n",
        "    return values[\n",
        "    import os\n    os._exit(0)\n",
        "    x = bytearray(10**10)\n",
        "return values\n",  # outside the function
    ]
    assert code_task.score([p] * len(responses), responses).tolist() == [0.0] * len(responses)


def test_printing_a_count_a_lookalike_or_the_harness_s_answers_does_not_score():
    p = code_task.problem(np.random.default_rng(1), 3)
    forged = [
        "    return []\nprint(6)\nprint('0 6')\nimport sys\nsys.exit(0)\n",
        "    return []\nimport atexit\natexit.register(print, 'passed', 6)\n",
        "    class Equal(list):\n        def __eq__(self, other):\n            return True\n"
        "    return Equal()\n",
        "    return _wanted\n",  # the harness's names are not the response's to read
        "    return wanted\n",
        "    global _expected\n    return _expected\n_expected = []\n",
    ]
    assert code_task.score([p] * len(forged), forged).tolist() == [0.0] * len(forged)


def test_the_harness_runs_after_any_ending_of_the_response():
    p = code_task.problem(np.random.default_rng(2), 5)
    endings = [p.answer.rstrip("\n"), p.answer + "        ", p.answer + "\nprint(solve([1, 2]))\n"]
    assert code_task.score([p] * len(endings), endings).tolist() == [1.0] * len(endings)


def test_problems_are_reproducible_and_vary():
    assert problems(5, range(3)) == problems(5, range(3))
    assert len({p.prompt for p in problems(5, range(20))}) == 20


@pytest.mark.parametrize("difficulty", range(1, 9))
def test_the_prompt_lists_the_steps_and_hides_the_tests(difficulty):
    for p in problems(difficulty, range(10)):
        assert p.prompt.startswith("def solve(values):\n") and p.prompt.endswith('    """\n')
        assert p.prompt.count("\n    - ") == difficulty
        assert p.prompt.count(">>> solve(") == code_task.EXAMPLES
        assert len(p.tests) == code_task.HIDDEN
        for given, _ in p.tests:
            assert f"solve({list(given)})" not in p.prompt
        assert p.answer.endswith("    return values\n")


def test_difficulty_is_a_number_of_steps():
    assert len(code_task.KINDS) >= 12
    for difficulty in (0, code_task.HARDEST + 1):
        with pytest.raises(ValueError, match="difficulty"):
            code_task.problem(np.random.default_rng(0), difficulty)


@pytest.mark.parametrize("decay", [0.5, 0.75])
def test_a_spread_of_difficulties_has_a_long_tail_and_the_widths_cover_its_hardest(decay):
    """Each step of difficulty is `decay` times as likely as the one below; the static widths are
    those of the hardest problems, so no prompt of the spread is cut."""
    from jspec.config import ConfigError, TaskConfig
    from jspec.rl import tasks
    from jspec.tokenizers import ByteTokenizer

    config = TaskConfig(name="code", difficulty=2, spread=4, spread_decay=decay)
    drawn = [
        p.prompt.count("\n    - ") for step in range(8) for p in tasks.problems(config, step, 64, 0)
    ]
    counts = np.bincount(drawn, minlength=7)[2:]
    expected = len(drawn) * decay ** np.arange(5) / np.sum(decay ** np.arange(5))
    assert counts.sum() == len(drawn) and (counts > 0).all()
    assert np.abs(counts - expected).max() < 4 * np.sqrt(expected).max()  # binomial, 4 sigma
    tokenizer = ByteTokenizer()
    prompt_width, answer_width = tasks.widths(config, tokenizer)
    hardest = tasks.widths(TaskConfig(name="code", difficulty=6), tokenizer)
    assert (prompt_width, answer_width) == hardest
    assert max(len(tokenizer.encode(p.prompt)) for p in tasks.problems(config, 0, 64, 0)) <= (
        prompt_width
    )
    with pytest.raises(ConfigError, match=r"rl.task.difficulty=9 plus rl.task.spread=4 passes 12"):
        tasks.check_tasks(TaskConfig(name="code", difficulty=9, spread=4))
    with pytest.raises(
        ConfigError, match=r"difficulty=7 plus rl.task.spread=2 passes 8, .* 'addition'"
    ):
        tasks.check_tasks(
            TaskConfig(
                name="code", shift_step=5, shifted_name="addition", shifted_difficulty=7, spread=2
            )
        )
    tasks.check_tasks(TaskConfig(name="code", difficulty=8, spread=4))  # the code task's hardest


def test_the_prompt_width_holds_problems_beyond_its_sample_and_a_cut_is_named():
    """The widths come from a sample of problems; the numbers drawn make some prompts longer than
    the sample's longest, which the width's margin holds. A row cut all the same is warned of."""
    from jspec.config import TaskConfig
    from jspec.rl import tasks
    from jspec.tokenizers import ByteTokenizer

    config, tokenizer = TaskConfig(name="code", difficulty=4), ByteTokenizer()
    width, _ = tasks.widths(config, tokenizer)
    drawn = [p for step in range(200) for p in tasks.problems(config, step, 16, 0)]
    assert max(len(tokenizer.encode(p.prompt)) for p in drawn) <= width
    with pytest.warns(UserWarning, match="2 of 2 rows of tokens were cut to the static width of 9"):
        tasks.encode_prompts(tokenizer, drawn[:2], 9)
