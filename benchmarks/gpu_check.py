"""The GPU check's steps (benchmarks/gpu_check.sh runs this; its header says how to run it on
the GPU machine). Every step runs in its own process with its own time limit, and the whole
check within DEADLINE_S; a step that fails or runs out of time is recorded and the next one
runs. One PASS/FAIL/SKIP line per step, OUT/summary.json and OUT/gpu_check.log (every step's
output) are what it leaves in OUT; models, checkpoints and installed wheels go to a work
directory outside it (OUT comes back from the GPU machine, which returns only a few files).

Steps:
  setup      install the wheels (--wheels), import what grpokit needs, check the device
  demo       `grpokit demo` in bf16 compute (fp32 master weights): held-out gain >= +15 points
  movement   benchmarks/bf16_movement.py from the demo's pi_SFT: bf16 moves the weights as fp32 does
  policy     a random-init Qwen2 with Qwen2-0.5B's shapes and a character tokenizer built offline
  grpo_lora  GRPO steps with 1,024-token completions, FSDP2 (world size 1), LoRA, gradient
             checkpointing, bf16: peak memory, step time (rollout, log-probs, update), update MFU
  grpo_full  the same, full fine-tune
  vllm       generation throughput hf vs vllm; skipped, with the reason, where `import vllm` fails
  vllm_grpo  grpo_lora's run with rollout.engine=vllm (engine built from the base, merged weights pushed
             every step, the sync probe, sleep mode): step and sync times, the engine-vs-trainer log-prob
             mismatch; skipped where `import vllm` fails

MFU = 6 x N x T / update seconds / peak FLOP/s, with N every parameter of the model (the tied
embedding counted once, as the LM head's matmul; the lookup costs nothing) and T the prompt +
completion tokens of the step's samples. This is the usual model-FLOPs count: gradient
checkpointing's recomputed forward and attention's score FLOPs are not counted, and for LoRA
the frozen weights' gradient matmuls (a third of 6N) are counted though not done, so LoRA's
MFU by work actually done is 2/3 of the figure.

    python3 benchmarks/gpu_check.py --device cuda --wheels .whl --out DIR
    python3 benchmarks/gpu_check.py --device cpu --out DIR   # the tiny dry run (make test-slow)
    python3 benchmarks/gpu_check.py --steps demo,movement ... # some steps only (setup always runs)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 480  # the whole check, wheels install included
# Each step's time limit in seconds; their sum stays within DEADLINE_S (tests/test_gpu_check.py).
CAPS = {"setup": 30, "demo": 170, "movement": 60, "policy": 30, "grpo_lora": 120, "grpo_full": 70}
# Only where vllm imports; each gets what is left of DEADLINE_S, at most this.
VLLM_CAPS = {"vllm": 60, "vllm_grpo": 120}
STEPS = (*CAPS, *VLLM_CAPS)
H200_BF16_FLOPS = 790e12  # dense bf16 matrix products measured on the H200 (8192^3, random data)
MIN_GAIN_POINTS = 15.0
PROMPT = "Question {i:04d}: what is {a:02d} + {b:02d}? Think step by step, then put the final answer in \\boxed{{}}."


@dataclass
class Profile:
    """The sizes of one run of the check: `full` for the GPU, `tiny` for the CPU dry run."""

    demo_overrides: list[str]
    min_gain_points: float | None  # None: the dry run's demo only has to finish
    movement_steps: int
    movement_extra: list[str]  # grpokit train overrides for benchmarks/bf16_movement.py's runs
    gate_movement: bool  # the ratio must lie within 0.9..1.1 (the tiny run only has to finish)
    policy_size: str  # a size of benchmarks/rollout_engines.py
    prompts: int
    generations: int
    completion_length: int
    lora_steps: int
    full_steps: int


PROFILES = {
    "full": Profile(demo_overrides=[], min_gain_points=MIN_GAIN_POINTS, movement_steps=12, movement_extra=[],
                    gate_movement=True, policy_size="0.5b", prompts=4, generations=4, completion_length=1024,
                    lora_steps=4, full_steps=2),
    "tiny": Profile(
        demo_overrides=["--model.tiny.hidden_size=64", "--model.tiny.intermediate_size=128", "--model.tiny.num_layers=1",
                        "--sft.max_steps=10", "--sft.batch_size=8", "--task.num_sft_examples=100",
                        "--task.num_sft_tir_examples=0", "--task.num_eval_questions=16", "--eval.k=2",
                        "--eval.tir=false", "--grpo.max_steps=3", "--grpo.prompts_per_step=4",
                        "--grpo.num_generations=4"],
        min_gain_points=None, movement_steps=2, movement_extra=["--grpo.prompts_per_step=4", "--grpo.num_generations=2", "--grpo.max_completion_length=16",
                        "--eval.k=2"],
        gate_movement=False, policy_size="tiny", prompts=2, generations=2, completion_length=16, lora_steps=3,
        full_steps=2),
}


# ---------------------------------------------------------------------------------- numbers


def mfu(params: int, tokens: float, seconds: float, peak_flops: float) -> float:
    """Model-FLOPs utilisation of an update: 6 x params x tokens over seconds x peak FLOP/s."""
    return 6.0 * params * tokens / seconds / peak_flops


def engine_numbers(rows: list[dict]) -> dict:
    """A separate engine's medians over the steps after the first: push + sync probe seconds and the
    engine-vs-trainer log-prob mismatch per token (empty for the hf engine, which logs neither)."""
    timed = [r for r in rows[1:] if "rollout/sync_time_s" in r]
    if not timed:
        return {}
    return {"sync_s": statistics.median(float(r["rollout/sync_time_s"]) for r in timed),
            "logp_mismatch": statistics.median(float(r.get("rollout/logp_mismatch", float("nan"))) for r in timed)}


def grpo_numbers(rows: list[dict], samples: int, prompt_tokens: int, params: int, peak_flops: float | None) -> dict:
    """Medians over the steps after the first (it warms up) of a GRPO run's metrics.jsonl rows:
    step time and its parts, trained tokens per step (prompt + completion tokens of the
    step's `samples`), the update's model TFLOP/s and, given the device's peak, its MFU."""
    if len(rows) < 2:
        raise ValueError(f"need at least 2 steps to leave out the first, got {len(rows)}")
    timed = rows[1:]

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in timed)

    tokens = [samples * (prompt_tokens + float(r["completion/mean_length"])) for r in timed]
    flops = [6.0 * params * t / float(r["perf/update_time_s"]) for t, r in zip(tokens, timed)]
    out = {
        "steps": len(rows), "timed_steps": len(timed),
        "step_s": median("perf/step_time_s"), "rollout_s": median("perf/rollout_time_s"),
        "logprob_s": median("perf/logprob_time_s"), "update_s": median("perf/update_time_s"),
        "completion_mean_length": median("completion/mean_length"),
        "trained_tokens_per_step": statistics.median(tokens),
        "update_model_tflops": statistics.median(flops) / 1e12,
        "skipped_updates": sum(int(r.get("skipped_updates", 0)) for r in rows),
    }
    out["mfu"] = statistics.median(f / peak_flops for f in flops) if peak_flops else None
    return out


# ---------------------------------------------------------------------------------- processes


@dataclass
class Ran:
    returncode: int | None  # None: stopped at its time limit
    seconds: float
    tail: str  # the last lines it printed

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def why(self) -> str:
        if self.returncode is None:
            return f"timed out after {self.seconds:.0f} s"
        lines = [line.strip() for line in self.tail.splitlines() if line.strip()]
        # grpokit's own one-line error says more than the traceback of a script that ran it
        errors = [line for line in lines if line.startswith("grpokit: ") and "error" in line]
        last = errors[-1] if errors else lines[-1] if lines else "no output"
        return f"exit {self.returncode}: {last[:300]}"


def run_logged(command: list[str], log_path: Path, timeout: float, env: dict | None = None, cwd: Path = REPO) -> Ran:
    """Run `command` in its own process group, its output appended to log_path; at the time
    limit the whole group (torchrun's workers too) is stopped: SIGTERM, then SIGKILL."""
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        start_offset = log.tell()
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)
        try:
            returncode = proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            returncode = None
            for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        seconds = time.perf_counter() - start
    with open(log_path, "rb") as log:
        log.seek(start_offset)
        tail = log.read()[-4000:].decode(errors="replace")
    return Ran(returncode, seconds, tail)


def fresh(*paths: Path) -> None:
    """Remove what an earlier check left at `paths` (folders or files)."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


class StepFailed(Exception):
    """A step's check did not hold; the message is its FAIL line."""


class StepSkipped(Exception):
    """A step that cannot run here; the message says why."""


# ---------------------------------------------------------------------------------- the check


@dataclass
class Check:
    device: str
    profile: Profile
    out: Path
    work: Path
    python: str
    wheels: Path | None
    started: float
    deadline_s: float
    peak_flops: float | None
    caps: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)  # what setup found: versions, device, precision keys
    step_started: float = 0.0

    @property
    def log(self) -> Path:
        return self.out / "gpu_check.log"

    def remaining(self) -> float:
        return self.deadline_s - (time.perf_counter() - self.started)

    def run(self, name: str, command: list[str]) -> Ran:
        """`command` within what is left of step `name`'s time limit and of the check's."""
        left_in_step = self.caps[name] - (time.perf_counter() - self.step_started)
        limit = min(left_in_step, self.remaining())
        if limit <= 1:
            raise StepFailed(f"no time left: {left_in_step:.0f} s of the step's {self.caps[name]:.0f}, "
                             f"{self.remaining():.0f} s of the check's {self.deadline_s:.0f}")
        return run_logged(command, self.log, limit, env=self.env)

    def grpokit(self, *args: str) -> list[str]:
        return [self.python, "-m", "grpokit.cli", *args]

    def precision(self) -> list[str]:
        """bf16 compute with fp32 master weights; where this grpokit has no model.master_dtype
        yet, bf16 alone (weights held in bf16), which setup reports."""
        return ["--model.dtype=bf16"] + (["--model.master_dtype=fp32"] if self.facts.get("master_dtype") else [])

    # ------------------------------------------------------------------ steps

    def step_setup(self) -> tuple[str, dict]:
        if self.wheels is not None:
            wheels = sorted(self.wheels.glob("*.whl"))
            if not wheels:
                raise StepFailed(f"--wheels {self.wheels}: no .whl files there (make gpu-wheels builds them)")
            site = self.work / "site"
            ran = self.run("setup", [self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                     "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                                     *map(str, wheels)])
            if not ran.ok:
                raise StepFailed(f"pip install of {len(wheels)} wheels: {ran.why()}")
            self.env["PYTHONPATH"] = os.pathsep.join([str(site), self.env["PYTHONPATH"]])
        probe = (
            "import json, sys, torch, transformers, peft, pydantic, math_verify, grpokit\n"
            "from grpokit.config import ModelConfig\n"
            "from math_verify import parse, verify\n"
            "assert verify(parse('$\\\\frac{1}{2}$'), parse('\\\\boxed{0.5}')), 'math_verify: 1/2 != 0.5'\n"
            f"device = {self.device!r}\n"
            "if device == 'cuda':\n"
            "    assert torch.cuda.is_available(), 'torch sees no CUDA device'\n"
            "facts = {'python': sys.version.split()[0], 'torch': torch.__version__,\n"
            "         'transformers': transformers.__version__, 'peft': peft.__version__,\n"
            "         'pydantic': pydantic.VERSION, 'grpokit': grpokit.__file__,\n"
            "         'master_dtype': 'master_dtype' in ModelConfig.__dataclass_fields__,\n"
            "         'gpu': torch.cuda.get_device_name(0) if device == 'cuda' else None}\n"
            "print('FACTS ' + json.dumps(facts))\n"
        )
        ran = self.run("setup", [self.python, "-c", probe])
        facts = next((json.loads(line[6:]) for line in ran.tail.splitlines() if line.startswith("FACTS ")), None)
        if not ran.ok or facts is None:
            raise StepFailed(f"imports or device: {ran.why()}")
        self.facts.update(facts)
        master = "fp32 master weights" if facts["master_dtype"] else \
            "NO model.master_dtype in this grpokit: weights held in bf16"
        return (f"torch {facts['torch']}, transformers {facts['transformers']}, "
                f"{facts['gpu'] or self.device}; bf16 compute, {master}", facts)

    def step_demo(self) -> tuple[str, dict]:
        run_dir = self.work / "demo"
        fresh(run_dir)
        ran = self.run("demo", self.grpokit("demo", f"--model.device={self.device}", *self.precision(), "--seed", "0",
                                            "--quiet", "--output-dir", str(run_dir), *self.profile.demo_overrides))
        summary_path = run_dir / "summary.json"
        if not ran.ok or not summary_path.is_file():
            raise StepFailed(ran.why() if not ran.ok else "no summary.json")
        s = json.loads(summary_path.read_text())
        gain = float(s["improvement_points"])
        numbers = {"sft_accuracy": s["sft_accuracy"], "grpo_accuracy": s["grpo_accuracy"], "gain_points": gain,
                   "wall_s": s["wall_seconds"], "sft_s": s.get("sft_seconds"), "rl_s": s.get("rl_seconds"),
                   "precision": self.precision()}
        line = (f"sft {s['sft_accuracy']:.1%} -> grpo {s['grpo_accuracy']:.1%} ({gain:+.1f} pt"
                + (f", target >= +{self.profile.min_gain_points:.0f}" if self.profile.min_gain_points is not None
                   else ", dry run: no target") + f"), demo wall {s['wall_seconds']:.0f} s")
        if self.profile.min_gain_points is not None and gain < self.profile.min_gain_points:
            raise StepFailed(line, numbers)
        return line, numbers

    def step_movement(self) -> tuple[str, dict]:
        script = REPO / "benchmarks" / "bf16_movement.py"
        if not script.is_file():
            raise StepSkipped("benchmarks/bf16_movement.py is not in this tree")
        out = self.work / "movement"
        sft = self.work / "demo" / "checkpoints" / "sft"
        # fp32 and bf16 compute over fp32 masters: the two the check compares (not bf16 weights alone)
        command = [self.python, str(script), "--device", self.device, "--steps", str(self.profile.movement_steps),
                   "--lr", "2e-6", "--out", str(out), "--variants", "fp32", "bf16"]
        if (sft / "config.json").is_file():  # the demo's pi_SFT: no second SFT
            command += ["--sft-dir", str(sft)]
        if self.profile.movement_extra:
            command += ["--extra", *self.profile.movement_extra]  # last: it takes the rest
        result = out / "movement.json"
        fresh(out)
        ran = self.run("movement", command)
        if not result.is_file():  # it exits 1 when the ratio is off, movement.json written: judged below
            raise StepFailed(ran.why() if not ran.ok else "no movement.json")
        m = json.loads(result.read_text())
        line = (f"mean |dW| fp32 {m['fp32_mean_abs_dw']:.3e}, bf16 {m['bf16_mean_abs_dw']:.3e}, "
                f"ratio {'n/a' if m['ratio'] is None else format(m['ratio'], '.3f')} "
                f"(within 0.9..1.1: {'yes' if m['pass'] else 'NO'}"
                + ("" if self.profile.gate_movement else "; dry run: not gated") + ")"
                + ("" if "--sft-dir" in command else "; trained its own pi_SFT"))
        if self.profile.gate_movement and not m["pass"]:
            raise StepFailed(line, m)
        return line, m

    def step_policy(self) -> tuple[str, dict]:
        ran = self.run("policy", [self.python, __file__, "save-policy", self.profile.policy_size,
                                  str(self.work / "policy"), "--prompts", str(4 * self.profile.prompts),
                                  "--device", self.device])
        info = self.work / "policy" / "policy.json"
        if not ran.ok or not info.is_file():
            raise StepFailed(ran.why() if not ran.ok else "no policy.json")
        p = json.loads(info.read_text())
        return (f"random-init Qwen2 {p['size']}: {p['params'] / 1e6:.1f}M parameters, tied embeddings, "
                f"vocabulary {p['vocab_size']}, prompts of {p['prompt_tokens']} tokens", p)

    def step_grpo(self, name: str, lora: bool, engine: str = "hf") -> tuple[str, dict]:
        if engine == "vllm":
            self._require_vllm()
        policy = self.work / "policy"
        info = policy / "policy.json"
        if not info.is_file():
            raise StepFailed("no policy: step `policy` did not build one")
        p, prof = json.loads(info.read_text()), self.profile
        steps = prof.lora_steps if lora else prof.full_steps
        run_dir, peak_json = self.work / name, self.work / f"{name}-peak.json"
        fresh(run_dir, peak_json)  # a reused --work must not lend this run an earlier one's numbers
        train = ["train", f"--model.name_or_path={policy}", *self.precision(), "--distributed.fsdp=on",
                 "--model.gradient_checkpointing=true",
                 f"--data.sources=[{{path: {str(policy / 'prompts.jsonl')!r}, format: plain}}]",
                 "--data.heldout_fraction=0", "--data.template=none", "--data.chat_template=off",
                 "--rewards=[{name: math_accuracy}]", f"--grpo.max_steps={steps}",
                 f"--grpo.prompts_per_step={prof.prompts}", f"--grpo.num_generations={prof.generations}",
                 f"--grpo.max_completion_length={prof.completion_length}", "--grpo.temperature=1.0",
                 f"--output_dir={run_dir}", "--quiet"]
        if lora:
            train += ["--model.lora.r=16", "--model.lora.alpha=32"]
        if engine == "vllm":
            train += ["--rollout.engine=vllm", "--rollout.gpu_memory_utilization=0.3"]
        ran = self.run(name, [self.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                              __file__, "probe", "--peak-json", str(peak_json), "--", *train])
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.is_file() else []
        if not ran.ok:  # the steps it finished still give numbers (the probe writes its peak as it goes)
            if len(rows) < 2 or not peak_json.is_file():
                raise StepFailed(f"{ran.why()}; {len(rows)} of {steps} steps done")
            line, numbers = self._grpo_numbers(rows, json.loads(peak_json.read_text()), p, lora)
            raise StepFailed(f"{ran.why()}; {len(rows)} of {steps} steps done: {line}", numbers)
        if len(rows) != steps:
            raise StepFailed(f"{len(rows)} steps in metrics.jsonl, expected {steps}")
        line, numbers = self._grpo_numbers(rows, json.loads(peak_json.read_text()), p, lora)
        checkpoint = run_dir / "checkpoints" / f"step-{steps}"
        saved = (checkpoint / "adapter_model.safetensors").is_file() if lora else checkpoint.is_dir()
        if numbers["skipped_updates"]:
            raise StepFailed(f"{numbers['skipped_updates']} updates skipped (non-finite loss or gradient); " + line,
                             numbers)
        if not saved:
            raise StepFailed(f"no checkpoint at {checkpoint}; " + line, numbers)
        return line, numbers

    def _grpo_numbers(self, rows: list[dict], peak: dict, policy: dict, lora: bool) -> tuple[str, dict]:
        prof = self.profile
        samples = prof.prompts * prof.generations
        numbers = {**grpo_numbers(rows, samples, policy["prompt_tokens"], policy["params"], self.peak_flops),
                   **engine_numbers(rows),
                   "peak_allocated_gib": peak["peak_bytes"] / 2**30,
                   "peak_reserved_gib": peak.get("reserved_bytes", 0) / 2**30, "peak_measure": peak["measure"],
                   "lora": lora, "params": policy["params"], "samples_per_step": samples,
                   "completion_length": prof.completion_length}
        mfu_text = f"MFU {numbers['mfu']:.1%}" if numbers["mfu"] is not None else "MFU n/a (no peak FLOP/s given)"
        engine = (f", vLLM push + sync probe {numbers['sync_s'] * 1e3:.0f} ms, log-prob mismatch "
                  f"{numbers['logp_mismatch']:.1e}" if "sync_s" in numbers else "")
        line = (f"{'LoRA r=16' if lora else 'full fine-tune'}{engine}, {samples} x "
                f"{numbers['completion_mean_length']:.0f} tokens: step {numbers['step_s']:.2f} s (rollout "
                f"{numbers['rollout_s']:.2f}, log-probs {numbers['logprob_s']:.2f}, update {numbers['update_s']:.2f}; "
                f"median of {numbers['timed_steps']}), peak {numbers['peak_allocated_gib']:.2f} GiB "
                f"({peak['measure']}), update {numbers['update_model_tflops']:.2f} TFLOP/s, {mfu_text}")
        return line, numbers

    def _require_vllm(self) -> None:
        probe = run_logged([self.python, "-c", "import vllm; print(vllm.__version__)"], self.log,
                           min(30.0, max(self.remaining(), 0.1)), env=self.env)
        if not probe.ok:
            raise StepSkipped(f"import vllm failed ({probe.why()})")

    def step_vllm(self) -> tuple[str, dict]:
        self._require_vllm()
        ran = self.run("vllm", [self.python, str(REPO / "benchmarks" / "rollout_engines.py"), "--sizes",
                                self.profile.policy_size,
                                "--device", self.device, "--dtype", "bfloat16", "--kv-cache-gb", "4", "--threads", "4"])
        if not ran.ok:
            raise StepFailed(ran.why())
        table = [line for line in ran.tail.splitlines() if line.startswith("| Qwen2")]
        return (table[-1] if table else "ran"), {"table_row": table[-1] if table else None}


def run_check(check: Check, steps: list[str]) -> dict:
    """Every step in order, each recorded whatever the others did; summary.json after each."""
    summary = {"device": check.device, "started": datetime.datetime.now().isoformat(timespec="seconds"),
               "deadline_s": check.deadline_s, "work_dir": str(check.work), "steps": {}}
    actions = {"setup": check.step_setup, "demo": check.step_demo, "movement": check.step_movement,
               "policy": check.step_policy, "grpo_lora": lambda: check.step_grpo("grpo_lora", lora=True),
               "grpo_full": lambda: check.step_grpo("grpo_full", lora=False), "vllm": check.step_vllm,
               "vllm_grpo": lambda: check.step_grpo("vllm_grpo", lora=True, engine="vllm")}
    for name in steps:
        start = check.step_started = time.perf_counter()
        with open(check.log, "a") as log:
            log.write(f"\n===== {name} (at {time.perf_counter() - check.started:.0f} s)\n")
            section = log.tell()
        numbers: dict = {}
        try:
            line, numbers = actions[name]()
            status = "PASS"
        except StepSkipped as skip:
            status, line = "SKIP", str(skip)
        except StepFailed as failure:
            status, line = "FAIL", str(failure.args[0])
            numbers = failure.args[1] if len(failure.args) > 1 else {}
        except Exception as err:  # a bug or an unexpected file: recorded like any failure
            status, line = "FAIL", f"{type(err).__name__}: {err}"
        seconds = time.perf_counter() - start
        summary["steps"][name] = {"status": status, "seconds": round(seconds, 1), "line": line, **numbers}
        summary["facts"] = check.facts
        summary["wall_s"] = round(time.perf_counter() - check.started, 1)
        summary["passed"] = all(s["status"] != "FAIL" for s in summary["steps"].values())
        (check.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        text = f"{status} {name}: {line} [{seconds:.0f} s]"
        print(text, flush=True)
        with open(check.log, "a") as log:
            log.write(text + "\n")
        if status == "FAIL":  # where it broke, without opening the log
            with open(check.log, "rb") as log:
                log.seek(section)
                output = log.read().decode(errors="replace").splitlines()[:-1]  # less the FAIL line
            if output:
                print("    | " + "\n    | ".join(output[-12:]), flush=True)
    print(f"{'all steps passed' if summary['passed'] else 'FAILED'} in {summary['wall_s']:.0f} s; "
          f"{check.out / 'summary.json'}", flush=True)
    return summary


# ---------------------------------------------------------------------------------- subcommands


def save_policy(size: str, directory: Path, num_prompts: int, device: str) -> None:
    """The benchmark policy of `size` (tied embeddings, bf16 on disk like Qwen2-0.5B's own
    checkpoint), its tokenizer, prompts.jsonl (prompts of one token length, so a step's prompt
    tokens are known) and policy.json (parameters, prompt tokens). Initialised on `device`:
    half a billion random draws take seconds on a GPU."""
    import random

    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from rollout_engines import build_policy

    with torch.device(device):
        model, tokenizer = build_policy(size, tied=True)
    params = sum(p.numel() for p in model.parameters())  # the tied matrix once
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    rng = random.Random(0)
    rows = []
    for i in range(num_prompts):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": PROMPT.format(i=i, a=a, b=b), "answer": str(a + b)})
    lengths = {len(tokenizer(r["prompt"], add_special_tokens=False).input_ids) for r in rows}
    if len(lengths) != 1:
        raise SystemExit(f"prompts of several token lengths {sorted(lengths)}: the step's token count would be unknown")
    (directory / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = {"size": size, "params": params, "vocab_size": model.config.vocab_size, "prompt_tokens": lengths.pop(),
            "hidden_size": model.config.hidden_size, "layers": model.config.num_hidden_layers,
            "tie_word_embeddings": model.config.tie_word_embeddings}
    (directory / "policy.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


def probe(peak_json: Path, cli_args: list[str]) -> int:
    """`grpokit <cli_args>` in this process, then its peak memory to peak_json: CUDA
    max_memory_allocated (and reserved) over the whole run, or the CPU's peak resident size.
    Written every 2 s as the run goes too, so a run stopped at its time limit leaves one."""
    import threading

    import torch

    from grpokit.bench.memory_probe import peak_bytes
    from grpokit.cli import main

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")

    def write(final: bool) -> None:
        if cuda:  # allocator statistics are host-side: no synchronisation while the run goes on
            out = {"peak_bytes": peak_bytes(device) if final else torch.cuda.max_memory_allocated(device),
                   "reserved_bytes": torch.cuda.max_memory_reserved(device),
                   "measure": "torch.cuda.max_memory_allocated"}
        else:
            out = {"peak_bytes": peak_bytes(device), "measure": "peak resident set size"}
        partial = peak_json.with_suffix(".partial")
        partial.write_text(json.dumps({**out, "final": final}) + "\n")
        os.replace(partial, peak_json)

    def keep_writing(stop: threading.Event) -> None:
        while not stop.wait(2.0):
            if not cuda or torch.cuda.is_initialized():  # never the one to initialise CUDA
                write(final=False)

    main_process = int(os.environ.get("RANK", "0")) == 0
    stop = threading.Event()
    writer = threading.Thread(target=keep_writing, args=(stop,), daemon=True)
    if main_process:
        writer.start()
    code = main(cli_args)
    stop.set()
    if main_process:
        writer.join()  # its last write must not land after the final one
        write(final=True)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["save-policy"]:
        p = argparse.ArgumentParser(prog="gpu_check.py save-policy")
        p.add_argument("size")
        p.add_argument("directory", type=Path)
        p.add_argument("--prompts", type=int, default=16)
        p.add_argument("--device", default="cpu")
        a = p.parse_args(argv[1:])
        save_policy(a.size, a.directory, a.prompts, a.device)
        return 0
    if argv[:1] == ["probe"]:
        if "--" not in argv:
            raise SystemExit("usage: gpu_check.py probe --peak-json PATH -- GRPOKIT_ARGS...")
        cut = argv.index("--")
        p = argparse.ArgumentParser(prog="gpu_check.py probe")
        p.add_argument("--peak-json", type=Path, required=True)
        return probe(p.parse_args(argv[1:cut]).peak_json, argv[cut + 1 :])

    parser = argparse.ArgumentParser(description="grpokit's GPU check: the demo, bf16 weight movement and GRPO on a "
                                     "Qwen2-0.5B-shaped policy, each step within its own time limit",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (default), or cpu for the tiny dry run")
    parser.add_argument("--out", type=Path, help="summary.json and gpu_check.log (default: a new /tmp folder)")
    parser.add_argument("--wheels", type=Path, help="folder of .whl files (make gpu-wheels) installed before the steps")
    parser.add_argument("--work", type=Path, help="models, runs and installed wheels (default: a new /tmp folder)")
    parser.add_argument("--profile", choices=sorted(PROFILES), help="sizes: full (default on cuda) or tiny (on cpu)")
    parser.add_argument("--steps", help=f"comma-separated subset of {','.join(STEPS)} (setup always runs)")
    parser.add_argument("--cap", action="append", default=[], metavar="STEP=SECONDS",
                        help="another time limit for a step (the check's deadline still holds)")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole check")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak for MFU "
                        f"(default: {H200_BF16_FLOPS / 1e12:.0f} on cuda, none on cpu)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    steps = list(STEPS) if not args.steps else [s for s in STEPS if s == "setup" or s in args.steps.split(",")]
    unknown = set(args.steps.split(",")) - set(STEPS) if args.steps else set()
    if unknown:
        parser.error(f"--steps: unknown {', '.join(sorted(unknown))}; choose from {', '.join(STEPS)}")
    if any(s.startswith(("grpo_", "vllm_grpo")) for s in steps) and "policy" not in steps:
        steps.insert(steps.index(next(s for s in steps if s.startswith(("grpo_", "vllm_grpo")))), "policy")
    caps = {**CAPS, **VLLM_CAPS}
    for item in args.cap:
        name, _, value = item.partition("=")
        if name not in caps or not value:
            parser.error(f"--cap {item!r}: write STEP=SECONDS with STEP one of {', '.join(STEPS)}")
        caps[name] = float(value)
    out = args.out or Path(tempfile.mkdtemp(prefix="grpokit-gpu-check-out-"))
    work = args.work or Path(tempfile.mkdtemp(prefix="grpokit-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.log").write_text("")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (H200_BF16_FLOPS if args.device == "cuda" else None)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if args.device == "cpu":  # tiny models: one thread each is faster, and far faster on a busy machine
        env.setdefault("OMP_NUM_THREADS", "1")
    check = Check(device=args.device, profile=PROFILES[args.profile or ("full" if args.device == "cuda" else "tiny")],
                  out=out, work=work, python=sys.executable, wheels=args.wheels, started=started,
                  deadline_s=args.deadline, peak_flops=peak, caps=caps, env=env)
    print(f"grpokit GPU check on {args.device} ({args.profile or ('full' if args.device == 'cuda' else 'tiny')} sizes), "
          f"steps {', '.join(steps)}; at most {args.deadline:.0f} s; work dir {work}", flush=True)
    summary = run_check(check, steps)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
