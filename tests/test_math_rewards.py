"""Math-answer rewards: extraction, equivalence via math-verify, stuffing, deadlines, threads,
and agreement with reference data (fixtures always; the full benchmark when the data is here)."""

import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from grpokit.rewards import (
    WeightedReward,
    get_reward_function,
    math_accuracy,
    score_completions,
)
from grpokit.data.answers import (
    answer_count,
    extract_final_answer,
    final_answers,
    gsm8k_reference,
    math_reference,
)
from grpokit.rewards.math_rewards import (
    format_reward,
    math_accuracy_with_stats,
    overlong_penalty,
)
from grpokit.rewards.verify_pool import VerifierPool

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).with_name("fixtures")
DATA = Path(os.environ.get("GRPOKIT_DATA") or REPO.parent / "shared" / "data")


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("verifier_benchmark", REPO / "benchmarks" / "verifier.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


def load(name: str) -> list[dict]:
    return bench.load_jsonl(FIXTURES / name)


@pytest.fixture(scope="module")
def pool():
    p = VerifierPool(workers=2, timeout_s=2.0, grace_s=1.0)
    yield p
    p.close()


def accuracy(pool, completions, answers):
    return math_accuracy_with_stats([""] * len(completions), completions, answers, verifier=pool)


# ---- extraction ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        (r"so $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2}\right)"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
        (r"\fbox{7}", "7"),
        (r"\boxed {  42 }", "42"),
        (r"first \boxed{5}, again \boxed{ 5 }", "5"),  # the same answer twice is one answer
        (r"\boxed{5} or maybe \boxed{6}", None),  # several different answers: none
        (r"\boxed{\boxed{5}}", r"\boxed{5}"),  # only the outermost box counts
        (r"\boxed{5", None),  # never closes
        ("\\boxed{5\n#### 6", "6"),  # an unclosed box is no answer; the next format is
        ("Natalia sold 72 clips.\n#### 72", "72"),
        ("#### 1,000", "1,000"),
        ("So the answer is 42. I hope it is correct.", "42"),
        ("The final answer is $\\frac{3}{4}$.", r"\frac{3}{4}"),
        ("the answer is 3.5.", "3.5"),
        ("The answer is 18 dollars.", "18"),
        ("The answer is 1.8 billion", "1.8 billion"),  # a magnitude word is part of the value
        ("She makes $18.\nA: 18", "18"),
        ("A: $18", "18"),
        ("A: 12\nA: 13", None),
        ("I do not know.", None),
        ("", None),
    ],
)
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected


def test_formats_rank_boxed_first():
    assert final_answers("The answer is 3.\n\\boxed{4}\nA: 5") == ["4"]
    assert answer_count(r"\boxed{2} and \boxed{2}") == 2


def test_references():
    assert gsm8k_reference("48/2 = <<48/2=24>>24\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        gsm8k_reference("no marker here")
    solution = r"First $\boxed{1}$, so finally $\boxed{\frac{\pi}{2}}$."
    assert math_reference(solution) == r"\frac{\pi}{2}"
    assert math_reference(solution, answer=" 7 ") == "7"
    with pytest.raises(ValueError, match="boxed"):
        math_reference("no box")


@pytest.mark.parametrize(
    "text",
    [
        "x" * 100_000,
        "{" * 100_000,
        "}" * 50_000 + "{" * 50_000,
        "\\boxed{" * 20_000,
        "\\boxed{" + "{" * 50_000 + "5" + "}" * 50_000 + "}",
        "A: " + "9" * 100_000,
        "#" * 100_000,
        "the answer is " * 7_000,
        "\\" * 100_000,
    ],
)
def test_extraction_is_fast_on_huge_inputs(text):
    start = time.perf_counter()
    final_answers(text)
    answer_count(text)
    assert time.perf_counter() - start < 1.0


# ---- equivalence -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac{2}{4}}", r"\frac12", 1.0),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", 1.0),
        (r"\boxed{(3,\pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"\boxed{\frac{ c }{ a }}", r"\frac{c}{a}", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("The answer is $18.", "18", 1.0),
        ("A: 18 dollars", "18", 1.0),
        (r"\boxed{\$18}", "18", 1.0),
        (r"\boxed{18\text{ dollars}}", "18", 1.0),
        (r"\boxed{10^\circ}", r"10^\circ", 1.0),
        (r"\boxed{17}", "18", 0.0),
        (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
        ("A: 1.8 billion", "1.8", 0.0),
        ("no final answer", "18", 0.0),
        (r"\boxed{1} \boxed{2} \boxed{3}", "2", 0.0),  # stuffing never pays
        (r"\boxed{2}. Check: \boxed{2}", "2", 1.0),
        (r"\boxed{15\frac{39}{40}}, or $\boxed{\frac{639}{40}}$", r"\frac{639}{40}", 1.0),  # same value twice
        (r"\boxed{\frac{639}{40}} or \boxed{16}", r"\frac{639}{40}", 0.0),
    ],
)
def test_equivalences(pool, completion, answer, expected):
    assert accuracy(pool, [completion], [answer]).scores == [expected]


def test_batch_and_stats(pool):
    completions = [r"\boxed{0.5}", r"\boxed{0.5}", "nothing", r"\boxed{2}", r"\boxed{1/2}"]
    result = accuracy(pool, completions, [r"\frac{1}{2}"] * 5)
    assert result.scores == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert (result.timeouts, result.errors, result.no_answer, result.verified) == (0, 0, 1, 4)


def test_lengths_must_match(pool):
    with pytest.raises(ValueError, match="2 completions but 1"):
        math_accuracy_with_stats(["p", "p"], ["a", "b"], ["1"], verifier=pool)


# ---- pathological inputs, deadlines, threads ----------------------------------------------------


PATHOLOGICAL = [
    r"\boxed{10^{10^{10^{10}}}}",
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{9**9**9**9}",
    "The answer is 9**9**9**9",
    r"\boxed{(10^{100000})!}",
    "\\boxed{" + "{" * 300 + "5" + "}" * 300 + "}",  # deep, yet short enough to reach math-verify
    "\\boxed{" + "{" * 50_000 + "5" + "}" * 50_000 + "}",
    "x" * 100_000,
    "{" * 100_000,
    "A: " + "1+" * 50_000 + "1",
]


def test_pathological_inputs_return_quickly_and_score_zero():
    pool = VerifierPool(workers=2, timeout_s=1.0, grace_s=1.0)
    try:
        start = time.perf_counter()
        result = accuracy(pool, PATHOLOGICAL, ["5"] * len(PATHOLOGICAL))
        elapsed = time.perf_counter() - start
    finally:
        pool.close()
    assert result.scores == [0.0] * len(PATHOLOGICAL)
    assert elapsed < 15.0
    assert result.timeouts >= 1  # the towers of powers cannot be decided in a second


def test_timeouts_are_counted():
    pool = VerifierPool(workers=1, timeout_s=0.5, grace_s=1.0)
    try:
        result = accuracy(pool, [r"\boxed{10^{10^{10^{10}}}}", r"\boxed{5}", r"\boxed{2^{10^{10}}}"], ["5", "5", "7"])
    finally:
        pool.close()
    assert result.scores == [0.0, 1.0, 0.0]
    assert result.timeouts == 2


def test_unresponsive_worker_is_killed_and_replaced():
    pool = VerifierPool(workers=1, timeout_s=0.5, grace_s=0.5)
    try:
        assert pool.run([("1", ["1.0"])]) == ["yes"]
        worker = pool._workers[0]
        os.kill(worker.proc.pid, signal.SIGSTOP)  # deaf to its own timer: only the pool's kill helps
        start = time.perf_counter()
        assert pool.run([("1", ["2"])]) == ["timeout"]
        assert time.perf_counter() - start < 5.0
        assert pool.restarts == 1 and worker.proc.poll() is not None
        assert pool.run([("1", ["1.0"])]) == ["yes"]
    finally:
        pool.close()


def test_dead_worker_is_replaced_and_the_job_retried():
    pool = VerifierPool(workers=1, timeout_s=1.0)
    try:
        assert pool.run([("1", ["1.0"])]) == ["yes"]
        os.kill(pool._workers[0].proc.pid, signal.SIGKILL)
        pool._workers[0].proc.wait()
        assert pool.run([(r"\frac{1}{2}", ["0.5"])]) == ["yes"]
        assert pool.restarts == 1
    finally:
        pool.close()


_KILLED_OWNER = """
import os, signal, sys, time
from grpokit.rewards.verify_pool import VerifierPool
pool = VerifierPool(workers=1)
assert pool.run([("1", ["1.0"])]) == ["yes"]
holder = os.fork()
if holder == 0:  # a forked child (as a data loader would be) keeps the worker's stdin pipe open
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # but not the test's pipes: the test reads them to their end
    os.dup2(devnull, 2)
    time.sleep(120)
    os._exit(0)
print(pool._workers[0].proc.pid, holder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is gone too
        return f.read().split(") ")[-1][0] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_worker_ends_when_the_pools_process_is_killed_though_a_fork_holds_its_stdin():
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _KILLED_OWNER], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    worker, holder = map(int, proc.stdout.split())
    try:
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the math-verify worker outlived the process that owned its pool"
        assert _alive(holder)  # the pipe was still open: the worker did not end from end-of-file
    finally:
        for pid in (holder, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_math_accuracy_from_a_worker_thread():
    out = {}

    def work():
        try:
            out["scores"] = math_accuracy(["p"] * 3, [r"\boxed{0.5}", "A: 3", r"\boxed{10^{10^{10^{10}}}}"],
                                          answer=[r"\frac{1}{2}", "4", "5"])
        except BaseException as err:  # reported below: a thread's exception would vanish
            out["error"] = err

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in out, out.get("error")
    assert out["scores"] == [1.0, 0.0, 0.0]


def test_trainer_scoring_path_with_its_timeout_thread():
    # score_completions runs a function with timeout_s in a separate thread.
    spec = WeightedReward("math", get_reward_function("math_accuracy"), timeout_s=60.0)
    res = score_completions([spec], ["p"] * 3, [r"\boxed{\frac{2}{4}}", r"\boxed{3}", r"\boxed{10^{10^{10^{10}}}}"],
                            {"answer": ["0.5", "2", "5"]})
    assert res.valid.all()
    assert res.total.tolist() == [1.0, 0.0, 0.0]
    assert res.timeouts == {"math": 1}  # counted, so the trainer logs it as rewards/timeouts


def test_registry_and_exports():
    from grpokit import rewards

    assert get_reward_function("math_accuracy") is math_accuracy is rewards.math_accuracy
    assert get_reward_function("format") is format_reward


# ---- format and length ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        (r"so \boxed{4}", 1.0),
        (r"\boxed{4} and \boxed{4}", 0.0),
        (r"\boxed{4} and \boxed{5}", 0.0),
        ("work\n#### 4", 1.0),
        ("The answer is 4.", 1.0),
        ("A: 4", 1.0),
        ("A: 4\nA: 5", 0.0),
        ("just 4", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(["p"], [completion]) == [expected]


def test_overlong_penalty():
    penalty = overlong_penalty(max_length=10, soft_cache=4)
    assert penalty(["p"] * 4, ["x" * 6, "x" * 8, "x" * 10, "x" * 11]) == [0.0, -0.5, -1.0, -1.0]

    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    by_tokens = overlong_penalty(max_length=4, soft_cache=2, tokenizer=WordTokenizer())
    assert by_tokens(["p"] * 2, ["a b", "a b c"]) == [0.0, -0.5]
    with pytest.raises(ValueError, match="soft_cache"):
        overlong_penalty(max_length=4, soft_cache=5)


# ---- reference data --------------------------------------------------------------------------------


def test_fixture_math500_solutions_match_their_answers(pool):
    check = bench.check_math500(load("math500_sample.jsonl"), pool)
    assert check.checked == 40 and check.agreed == 40, check.disagreements


def test_fixture_math_test_solutions_match_perturbed_answers(pool):
    rows = load("math_test_sample.jsonl")
    check = bench.check_math_test(rows, pool)
    # Only a solution that boxes several different answers may fail: the reward refuses those.
    several = {r["unique_id"] for r in rows if len(final_answers(r["solution"])) > 1}
    failed = {line.split()[0].rstrip(":") for line in check.disagreements}
    assert failed <= several
    assert "test/intermediate_algebra/25.json" in failed  # boxes (10, 0) and (0,0)
    assert check.agreed >= check.checked - len(several) and check.checked == 30


def test_fixture_gsm8k_samples_agree_with_labels(pool):
    check = bench.check_gsm8k(load("gsm8k_solutions_sample.jsonl"), pool)
    assert check.checked == 120 and check.agreed == 120, check.disagreements


def test_fixture_gsm8k_train_answers(pool):
    rows = load("gsm8k_train_sample.jsonl")
    refs = [gsm8k_reference(r["answer"]) for r in rows]
    assert all(ref.lstrip("-").replace(".", "").isdigit() for ref in refs)
    assert accuracy(pool, [r["answer"] for r in rows], refs).scores == [1.0] * len(rows)
    wrong = [r["answer"].rsplit("####", 1)[0] + f"#### {int(ref) + 1}" for r, ref in zip(rows, refs)]
    assert accuracy(pool, wrong, refs).scores == [0.0] * len(rows)


def test_perturb_keeps_values_and_changes_text():
    assert bench.perturb(r"\left( 3, \dfrac{\pi}{2} \right)") == r"( 3, \frac{\pi}{ 2 } )"
    assert bench.perturb(r"11,\! 111,\! 100") == "11,111,100"
    assert bench.perturb(r"\frac{3}{4}") == "3/4"
    assert bench.perturb(r"2 \frac{1}{2}") == r"2 \frac{ 1 }{ 2 }"  # a mixed number keeps its \frac
    assert bench.perturb("42") == "42.0"


@pytest.mark.skipif(not (DATA / "math500" / "test.jsonl").is_file(),
                    reason=f"reference data not found at {DATA} (set GRPOKIT_DATA)")
def test_full_benchmark(pool):
    math500, math_test, gsm8k = bench.run_all(DATA, pool)
    assert (math500.agreed, math500.checked) == (500, 500), math500.disagreements
    assert math_test.checked == 5000 and math_test.agreed / math_test.checked >= 0.995, math_test.disagreements
    assert (gsm8k.agreed, gsm8k.checked) == (5276, 5276), gsm8k.disagreements
