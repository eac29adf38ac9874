"""benchmarks/gpu_check.sh: its time limits, its numbers (MFU), that one failing step leaves the
others running, and (slow) the whole check as a tiny dry run on the CPU, so it cannot rot
between runs on the GPU machine."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check", REPO / "benchmarks" / "gpu_check.py")


def _env() -> dict:
    return {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}


def test_step_time_limits_fit_within_eight_minutes():
    assert gpu_check.DEADLINE_S <= 8 * 60
    assert sum(gpu_check.CAPS.values()) <= gpu_check.DEADLINE_S
    assert set(gpu_check.STEPS) == set(gpu_check.CAPS) | set(gpu_check.VLLM_CAPS)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def test_a_step_past_its_time_limit_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    start = time.perf_counter()
    ran = gpu_check.run_logged(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], tmp_path / "log", timeout=3.0)
    assert ran.returncode is None and "timed out" in ran.why()
    assert time.perf_counter() - start < 20
    child = int(pid_file.read_text())
    deadline = time.perf_counter() + 10  # the signal is sent; a busy machine may take a moment to end it
    while _alive(child) and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert not _alive(child)  # the grandchild too (torchrun's workers)


def test_grpo_numbers_leave_out_the_first_step_and_count_prompt_and_completion_tokens():
    def row(step_s, update_s, length):
        return {"perf/step_time_s": step_s, "perf/rollout_time_s": step_s / 2, "perf/logprob_time_s": 0.5,
                "perf/update_time_s": update_s, "completion/mean_length": length, "skipped_updates": 0}

    rows = [row(99.0, 50.0, 7.0), row(10.0, 2.0, 1024.0), row(12.0, 4.0, 1000.0)]
    n = gpu_check.grpo_numbers(rows, samples=16, prompt_tokens=100, params=500_000_000, peak_flops=790e12)
    tokens = [16 * (100 + 1024), 16 * (100 + 1000)]  # 17984, 17600
    flops = [6 * 500e6 * tokens[0] / 2.0, 6 * 500e6 * tokens[1] / 4.0]  # 2.6976e13, 1.32e13 FLOP/s
    assert n["timed_steps"] == 2 and n["steps"] == 3
    assert n["step_s"] == pytest.approx(11.0) and n["update_s"] == pytest.approx(3.0)
    assert n["trained_tokens_per_step"] == pytest.approx(17792.0)
    assert n["update_model_tflops"] == pytest.approx((2.6976e13 + 1.32e13) / 2 / 1e12)
    assert n["mfu"] == pytest.approx((flops[0] + flops[1]) / 2 / 790e12)
    assert gpu_check.mfu(500_000_000, tokens[0], 2.0, 790e12) == pytest.approx(2.6976e13 / 790e12)
    assert gpu_check.grpo_numbers(rows, 16, 100, 500_000_000, None)["mfu"] is None
    with pytest.raises(ValueError, match="at least 2 steps"):
        gpu_check.grpo_numbers(rows[:1], 16, 100, 500_000_000, 790e12)


def test_the_gpu_policy_has_qwen2_0_5b_shapes_and_tied_embeddings():
    import torch

    rollout_engines = _load("rollout_engines", REPO / "benchmarks" / "rollout_engines.py")
    with torch.device("meta"):  # shapes only: no half-billion random draws
        model, tokenizer = rollout_engines.build_policy("0.5b", tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(tokenizer) == model.config.vocab_size == 151936
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2-0.5B's count


def test_a_failing_step_does_not_stop_the_next(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--steps", "vllm", "--wheels", str(empty),
                           "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["steps"]) == ["setup", "vllm"] and summary["passed"] is False
    assert summary["steps"]["setup"]["status"] == "FAIL"
    assert "no .whl files" in summary["steps"]["setup"]["line"]
    assert summary["steps"]["vllm"]["status"] in ("PASS", "SKIP")  # it ran after the failure
    lines = [line for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert [line.split()[:2] for line in lines] == [["FAIL", "setup:"], [summary["steps"]["vllm"]["status"], "vllm:"]]


def test_unknown_steps_and_caps_are_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--steps", "demo,bogus"])
    assert "--steps: unknown bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--cap", "demo"])
    assert "write STEP=SECONDS" in capsys.readouterr().err


@pytest.mark.slow
def test_dry_run_on_cpu_passes_every_step(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, env=_env(), timeout=600)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert list(steps) == list(gpu_check.STEPS) and summary["passed"] is True
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "summary.json"]  # all OUT brings back
    for name, step in steps.items():
        if name.startswith("vllm") and step["status"] == "SKIP":
            assert "import vllm failed" in step["line"]
        elif name == "movement" and step["status"] == "SKIP":  # until benchmarks/bf16_movement.py lands
            assert not (REPO / "benchmarks" / "bf16_movement.py").exists()
        else:
            assert step["status"] == "PASS", (name, step)
    assert steps["setup"]["python"] == sys.version.split()[0]
    assert math.isfinite(steps["demo"]["gain_points"]) and steps["demo"]["wall_s"] > 0
    tiny = gpu_check.PROFILES["tiny"]
    policy = steps["policy"]
    assert policy["tie_word_embeddings"] is True and policy["prompt_tokens"] > 0
    for name, lora, n_steps in (("grpo_lora", True, tiny.lora_steps), ("grpo_full", False, tiny.full_steps)):
        s = steps[name]
        assert s["lora"] is lora and s["steps"] == n_steps and s["skipped_updates"] == 0
        # the policy's EOS logit is zero among large ones: every completion runs its full length
        assert s["completion_mean_length"] == tiny.completion_length
        assert s["trained_tokens_per_step"] == tiny.prompts * tiny.generations * (policy["prompt_tokens"]
                                                                                  + tiny.completion_length)
        assert s["peak_allocated_gib"] > 0 and s["update_s"] > 0 and s["mfu"] is None  # no CPU peak FLOP/s
    printed = [line.split()[:2] for line in proc.stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]
    assert [name.rstrip(":") for _, name in printed] == list(gpu_check.STEPS)
    assert wall < 300, f"the dry run took {wall:.0f} s"
