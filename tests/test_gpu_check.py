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
    assert gpu_check.schedule_seconds(gpu_check.CAPS) <= gpu_check.DEADLINE_S
    assert set(gpu_check.STEPS) == set(gpu_check.CAPS) and set(gpu_check.PARALLEL) <= set(gpu_check.STEPS)
    assert "movement" not in gpu_check.STEPS  # answered (bf16 moves the weights as fp32 does): dropped


def test_the_scripts_header_lists_every_step_with_its_limit():
    import re

    listed = re.findall(r"^#   ([a-z_]+) +(\d+) s  ", SCRIPT.read_text(), flags=re.M)
    assert [(name, int(seconds)) for name, seconds in listed] == list(gpu_check.CAPS.items())


def test_the_schedule_adds_the_sequential_limits_and_the_longest_parallel_one():
    caps = {"setup": 10, "generate": 20, "demo": 30, "real": 50}
    assert gpu_check.schedule_seconds(caps, list(caps)) == 10 + 20 + 50
    assert gpu_check.schedule_seconds(caps, ["setup", "demo"]) == 10 + 30
    assert gpu_check.schedule_seconds(caps, ["setup"]) == 10


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


def test_should_stop_sends_one_sigterm_and_the_process_finishes(tmp_path):
    script = "trap 'echo finishing-the-step; exit 0' TERM; while true; do sleep 0.1; done"
    checks = []

    def should_stop():
        checks.append(time.perf_counter())
        return len(checks) >= 3  # polled until it holds, then never again

    ran = gpu_check.run_logged(["bash", "-c", script], tmp_path / "log", timeout=30.0, should_stop=should_stop)
    assert ran.ok and ran.asked_to_stop and "finishing-the-step" in ran.tail
    assert len(checks) == 3 and ran.seconds < 20
    never = gpu_check.run_logged(["bash", "-c", script], tmp_path / "log2", timeout=2.0, should_stop=lambda: False)
    assert never.returncode is None and not never.asked_to_stop  # the time limit stops it


def test_paired_interval_of_the_gain_worked_by_hand():
    # differences 0, 1, 0, 0, 1: mean 0.4; sample variance (0.16 + 0.36 + 0.16 + 0.16 + 0.36) / 4 = 0.3;
    # half width 1.959964 x sqrt(0.3) / sqrt(5) = 1.959964 x 0.2449490 = 0.4800911
    ci = gpu_check.paired_interval([True, False, False, True, False], [True, True, False, True, True])
    assert ci["n"] == 5 and ci["gain"] == pytest.approx(0.4) and (ci["better"], ci["worse"]) == (2, 0)
    assert ci["low"] == pytest.approx(0.4 - 0.4800911, abs=1e-6)
    assert ci["high"] == pytest.approx(0.4 + 0.4800911, abs=1e-6)
    same = gpu_check.paired_interval([True, False], [True, False])
    assert (same["low"], same["high"]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="paired"):
        gpu_check.paired_interval([True, False], [True])


def test_peak_flops_by_device_name():
    assert gpu_check.peak_for("NVIDIA H200")[0] == 790e12
    assert gpu_check.peak_for("NVIDIA H100 80GB HBM3")[0] == 989e12  # SXM
    assert gpu_check.peak_for("NVIDIA H100 PCIe")[0] == 756e12
    assert "H200" in gpu_check.peak_for("NVIDIA H200")[1]
    assert gpu_check.peak_for("NVIDIA A100-SXM4-80GB") is None and gpu_check.peak_for(None) is None


def test_reward_curve_is_the_mean_of_consecutive_stretches():
    rows = [{"reward/mean": float(i)} for i in range(10)]
    assert gpu_check.reward_curve(rows) == [0.5, 2.5, 4.5, 6.5, 8.5]
    assert gpu_check.reward_curve(rows[:3]) == [0.0, 1.0, 2.0]
    assert gpu_check.reward_curve([]) == []


def test_the_real_step_skips_in_one_line_without_its_files(tmp_path):
    check = gpu_check.Check(device="cuda", profile=gpu_check.PROFILES["full"], out=tmp_path, work=tmp_path,
                            python=sys.executable, wheels=None, started=time.perf_counter(), deadline_s=480,
                            peak_tflops=None, engines=["hf", "hf_static"], real_dir=None, caps=dict(gpu_check.CAPS))
    with pytest.raises(gpu_check.StepSkipped, match="no --real-dir: benchmarks/gpu_payload.sh"):
        check.step_real()
    check.real_dir = tmp_path / "payload"
    (check.real_dir / "gsm8k").mkdir(parents=True)
    (check.real_dir / "gsm8k" / "train.jsonl").write_text("{}\n")
    with pytest.raises(gpu_check.StepSkipped, match="missing .*model/config.json, .*test.jsonl") as skipped:
        check.step_real()
    assert "\n" not in str(skipped.value) and "train.jsonl" not in str(skipped.value)


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
    assert "padding_frac" not in n and "compiles" not in n  # printed only where the run logs them
    logged = [{**r, "perf/padding_frac": f, "rollout/compiles": c, "rollout/recompiles": 0}
              for r, f, c in zip(rows, (0.9, 0.25, 0.35), (2, 0, 1))]
    m = gpu_check.grpo_numbers(logged, 16, 100, 500_000_000, 790e12)
    assert m["padding_frac"] == pytest.approx(0.30) and (m["compiles"], m["recompiles"]) == (3, 0)


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
    # a generous limit for the step that runs after the failure: only that it runs is under test
    proc = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--steps", "generate", "--cap", "generate=300",
                           "--wheels", str(empty), "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["steps"]) == ["setup", "generate"] and summary["passed"] is False
    assert summary["steps"]["setup"]["status"] == "FAIL"
    assert "no .whl files" in summary["steps"]["setup"]["line"]
    assert summary["steps"]["generate"]["status"] == "PASS"  # it ran after the failure
    lines = [line for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert [line.split()[:2] for line in lines] == [["FAIL", "setup:"], ["PASS", "generate:"]]


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
    # flash_attention_2 needs CUDA: on the CPU the packing step says so and skips; every other step passes
    assert steps["packing"]["status"] == "SKIP" and steps["packing"]["line"].startswith("no CUDA device"), steps["packing"]
    for name, step in steps.items():
        assert name == "packing" or step["status"] == "PASS", (name, step)
    assert steps["setup"]["python"] == sys.version.split()[0] and "hf_static" in steps["setup"]["engines"]
    tiny = gpu_check.PROFILES["tiny"]
    policy = steps["generate"]["policy"]
    assert policy["tie_word_embeddings"] is True and policy["prompt_tokens"] > 0
    completions = tiny.prompts * tiny.generations
    for engine in ("hf", "hf_static"):  # side by side; on the CPU hf_static samples with plain generate
        e = steps["generate"]["engines"][engine]
        assert e["tokens"] == completions * tiny.completion_length and e["tokens_per_s"] > 0
    for name, lora, n_steps in (("grpo_lora", True, tiny.lora_steps), ("grpo_full", False, tiny.full_steps)):
        s = steps[name]
        assert s["lora"] is lora and s["steps"] == n_steps and s["skipped_updates"] == 0
        assert s["engine"] == "hf_static"
        # the policy's EOS logit is zero among large ones: every completion runs its full length
        assert s["completion_mean_length"] == tiny.completion_length
        assert s["trained_tokens_per_step"] == completions * (policy["prompt_tokens"] + tiny.completion_length)
        assert s["peak_allocated_gib"] > 0 and s["update_s"] > 0 and s["mfu"] is None  # no CPU peak FLOP/s
    assert math.isfinite(steps["demo"]["gain_points"]) and steps["demo"]["wall_s"] > 0
    real = steps["real"]
    assert real["gain"]["n"] == 30 and real["gain"]["low"] <= real["gain"]["gain"] <= real["gain"]["high"]
    assert real["grpo_steps"] >= 1 and len(real["rewards"]) == real["grpo_steps"] and real["step_s"] > 0
    assert real["sft_epochs"] <= 1.0 and real["peak_allocated_gib"] > 0
    assert {"accuracy", f"pass@{tiny.real.eval_k}"} <= set(real["before"]) & set(real["after"])
    printed = [line.split()[:2] for line in proc.stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]
    assert [name.rstrip(":") for _, name in printed] == list(gpu_check.STEPS)
    assert wall < 300, f"the dry run took {wall:.0f} s"
