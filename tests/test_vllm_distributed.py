"""vLLM under torchrun (gloo on CPU): one colocated engine per process, on that process's device,
through vLLM's external_launcher executor; each process samples its own groups with its own
per-request seeds, and a sharded policy is pushed one parameter at a time.

The check is the one the hf engine passes (tests/test_distributed.py): one GRPO step on 2
processes ends with the weights of the same step in 1 process, within 1e-5, for a full
fine-tune, for LoRA (the engines receive the merged weights) and with tensor_parallel_size=2
(both processes hold one engine's weight shards and pool their prompts).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from grpokit.rollout.vllm_cpu_shm import ENGINE_SEGMENTS, SHM_DIR
from test_distributed import config_file, free_port

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (CPU: `make .venv-vllm` then `make test-vllm`)"),
]

# head_dim 32: vLLM's CPU attention has no kernel for 16
TINY = ["--model.tiny.hidden_size=64", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
        "--model.tiny.intermediate_size=64", "--prompts_per_step=4", "--num_generations=4",
        "--max_completion_length=12", "--num_rl_questions=200", "--num_eval_questions=4", "--eval.k=2",
        "--grpo.save_steps=1", "--grpo.max_steps=1", "--grpo.warmup_steps=1", "--grpo.learning_rate=1e-3",
        "--eval.before=false", "--distributed.timeout_s=120", "--rollout.engine=vllm", "--quiet"]
LORA = ["--model.lora.r=4", "--model.lora.alpha=8"]
# vLLM's CPU collectives under external_launcher: one segment per process, named after the group
STALE_SEGMENT = SHM_DIR / "-tp:0-[0-1]-cpushm_0"


def run_env() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, here]), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def grpokit(nproc: int, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
                 str(free_port())] if nproc > 1 else [sys.executable])
    return subprocess.run([*launcher, "-m", "grpokit", *args], env=run_env(), capture_output=True, text=True,
                          timeout=timeout)


def step_weights(run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    step = run / "checkpoints" / "step-1"
    adapter = step / "adapter_model.safetensors"
    return load_file(adapter if adapter.is_file() else step / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One step of the same runs in one process: {"full": run dir, "lora": run dir}."""
    out = tmp_path_factory.mktemp("one-process")
    config = config_file(out)
    runs = {}
    for name, extra in (("full", []), ("lora", LORA)):
        done = grpokit(1, "train", config, f"--output_dir={out / name}", *TINY, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = out / name
    return runs


@pytest.mark.parametrize("setup", ["full", "lora", "tensor_parallel_2"])
def test_one_step_with_an_engine_per_process_gives_the_weights_of_one_process(tmp_path, one_process, setup):
    extra = {"full": [], "lora": LORA, "tensor_parallel_2": ["--rollout.tensor_parallel_size=2"]}[setup]
    if setup == "tensor_parallel_2":  # what a killed run leaves: the segment this run's rank 0 creates
        STALE_SEGMENT.write_bytes(b"\0" * 64)
    done = grpokit(2, "train", config_file(tmp_path), f"--output_dir={tmp_path / 'run'}", *TINY, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    # the stale one removed, and the run's own gone although its processes skip vLLM's teardown
    assert sorted(SHM_DIR.glob(ENGINE_SEGMENTS)) == []
    log = done.stdout + done.stderr
    assert "Traceback" not in log  # the engines shut down before the process group, without errors
    # external_launcher joined torchrun's group (vLLM logs from rank 0 only): world size 2, and with
    # tensor_parallel_size=2 both processes in one engine
    assert "rank 0 in world size 2 is assigned as DP rank 0" in log
    tp = 2 if setup == "tensor_parallel_2" else 1
    assert "Using external launcher for distributed inference" in log and f"tensor_parallel_size={tp}," in log

    single = step_weights(one_process["lora" if setup == "lora" else "full"])
    sharded = step_weights(tmp_path / "run")
    # the gathered checkpoint also writes the tied head (the embedding again); from_pretrained reads both
    assert set(single) <= set(sharded) and set(sharded) - set(single) <= {"lm_head.weight"}
    worst = max(float((sharded[k] - single[k]).abs().max()) for k in single)
    print(f"{setup}: largest 2-process vs 1-process weight difference {worst:.3e}")
    assert worst < 1e-5

    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    alone = json.loads((one_process["lora" if setup == "lora" else "full"] / "metrics.jsonl").read_text()
                       .splitlines()[0])
    assert row["reward/mean"] == pytest.approx(alone["reward/mean"], abs=1e-9)  # the same completions
    assert row["rollout/logp_mismatch"] < 1e-5  # each engine holds the policy's weights


@pytest.mark.slow
@pytest.mark.long  # 150 steps of two vLLM engines on 2 cores; CI keeps the one-step check above
@pytest.mark.timeout(1800)
def test_two_engines_train_the_demo_rl_stage(tmp_path, vllm_demo):
    """`torchrun --nproc_per_node=2 -m grpokit train --rollout.engine=vllm` from the vLLM demo's pi_SFT:
    two engines, one per process, 150 steps; held-out greedy accuracy rises by >= 15 points."""
    sft = vllm_demo / "checkpoints" / "sft"
    done = grpokit(2, "train", f"--model.name_or_path={sft}", "--rollout.engine=vllm",
                   f"--output_dir={tmp_path / 'run'}", "--quiet", timeout=1700)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"2 processes, 2 vLLM engines: held-out greedy {summary['sft_accuracy']:.1%} -> "
          f"{summary['grpo_accuracy']:.1%} in {summary['wall_seconds']:.0f}s")
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary
