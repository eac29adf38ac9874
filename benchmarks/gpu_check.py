"""The GPU check's steps (benchmarks/gpu_check.sh runs this; its header says how to run it on
the GPU machine). Every step runs in its own process(es) with its own time limit, and the whole
check within DEADLINE_S; a step that fails or runs out of time is recorded and the next one
runs. One PASS/FAIL/SKIP line per step, OUT/summary.json and OUT/gpu_check.log (every step's
output) are what it leaves in OUT; models, runs and installed wheels go to a work directory
outside it (OUT comes back from the GPU machine, which returns only a few files).

Steps (the timed ones have the GPU alone; `demo` and `real`, learning checks of small models whose
targets are accuracies, run side by side after them):
  setup      install the wheels (--wheels), import what grpokit needs, the device, its peak bf16 FLOP/s
  generate   a random-init Qwen2 with Qwen2-0.5B's shapes and a character tokenizer built offline (the
             policy the GRPO steps train), then completion tokens/s, 16 prompts x 4 completions of 1,024
             tokens in bf16, for each engine of
             --engines side by side (default: plain `generate` (hf) and the static-cache engine
             hf_static); target: the fast engine >= 10,000 tokens/s
  grpo_lora  GRPO steps of 16 prompts x 4 completions of 1,024 tokens, LoRA r=16, bf16 compute, the
             fast engine: step time (rollout, log-probs, update), peak memory, perf/padding_frac where
             logged; target <= 15 s a step
  grpo_full  the same model full fine-tuned: the update's MFU; target >= 30%
  demo       `grpokit demo` in the default precision (model.dtype auto: bf16 compute on CUDA): gain
             >= +15 points
  real       SmolLM2-135M-Instruct: SFT on GSM8K's training set (at most one epoch), `grpokit eval` on
             its test set (greedy, pass@k), GRPO for as many steps as fit (stopped by SIGTERM, which
             finishes the step and saves), the same evaluation again: the before/after table, the
             paired 95% interval of the greedy gain (target: above zero), the reward curve, step time,
             peak memory. Its files come from --real-dir (benchmarks/gpu_payload.sh builds them); SKIP
             without them. The CPU dry run uses a tiny model and tests/fixtures' GSM8K rows.

MFU = 6 x N x T / update seconds / peak FLOP/s, with N every parameter of the model (the tied
embedding counted once, as the LM head's matmul; the lookup costs nothing) and T the prompt +
completion tokens of the step's samples. This is the usual model-FLOPs count: gradient
checkpointing's recomputed forward and attention's score FLOPs are not counted, and for LoRA
the frozen weights' gradient matmuls (a third of 6N) are counted though not done. The peak is
picked by the device's name (PEAK_BF16_TFLOPS; --peak-tflops overrides it).

    python3 benchmarks/gpu_check.py --device cuda --wheels .whl --out DIR [--real-dir DIR]
    python3 benchmarks/gpu_check.py --device cpu --out DIR   # the tiny dry run (make test-slow)
    python3 benchmarks/gpu_check.py --steps generate ...      # some steps only (setup always runs)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 480  # the whole check, wheels install included
# Each step's time limit in seconds. The steps run one after another, except PARALLEL's, which run
# side by side at the end; schedule_seconds(CAPS) stays within DEADLINE_S (tests/test_gpu_check.py).
CAPS = {"setup": 30, "packing": 20, "generate": 95, "grpo_lora": 95, "grpo_full": 85, "demo": 155, "real": 155}
PARALLEL = ("demo", "real")
STEPS = tuple(CAPS)
# Dense bf16 matrix-product peaks by device name, first match wins: (name part, TFLOP/s, source).
PEAK_BF16_TFLOPS = (
    ("H200", 790.0, "measured on an H200 here (8192^3 bf16 matmul, random data)"),
    ("H100 PCIe", 756.0, "H100 PCIe datasheet, dense bf16"),
    ("H100", 989.0, "H100 SXM datasheet, dense bf16"),
)
TARGETS = {"generate_tokens_per_s": 10_000.0, "grpo_lora_step_s": 15.0, "grpo_full_mfu": 0.30,
           "demo_gain_points": 15.0}
Z95 = 1.959964  # the standard normal's 97.5% quantile
PROMPT = "Question {i:04d}: what is {a:02d} + {b:02d}? Think step by step, then put the final answer in \\boxed{{}}."
FIXTURES = REPO / "tests" / "fixtures"


def schedule_seconds(caps: dict, steps=STEPS) -> float:
    """The longest `steps` can take: the sequential steps' limits plus the longest of the parallel ones'."""
    return (sum(caps[s] for s in steps if s not in PARALLEL)
            + max((caps[s] for s in steps if s in PARALLEL), default=0.0))


@dataclass
class RealSizes:
    """The real step's sizes. model_args: grpokit overrides that choose the model (the tiny dry run
    builds one; the GPU's comes from --real-dir)."""

    sft_max_steps: int  # at most one epoch of the training file: ceil(rows / sft_batch) caps it
    sft_batch: int
    sft_lr: float
    eval_rows: int
    eval_k: int
    max_new_tokens: int
    prompts: int
    generations: int
    grpo_lr: float
    grpo_max_steps: int  # the SIGTERM at the GRPO phase's time limit usually ends it first
    grpo_max_seconds: float | None  # the GRPO phase's limit; None = what the step leaves after the last evaluation
    model_args: list[str] = field(default_factory=list)


@dataclass
class Profile:
    """The sizes of one run of the check: `full` for the GPU, `tiny` for the CPU dry run."""

    gated: bool  # targets fail their step (full); the dry run only prints them
    cap_scale: float  # the step limits and the deadline times this: a busy CPU's process start-ups are no GPU's
    demo_overrides: list[str]
    policy_size: str  # a size of benchmarks/rollout_engines.py
    prompts: int
    generations: int
    completion_length: int
    lora_steps: int
    full_steps: int
    real: RealSizes


PROFILES = {
    "full": Profile(
        gated=True, cap_scale=1.0, demo_overrides=[], policy_size="0.5b", prompts=16, generations=4, completion_length=1024,
        lora_steps=3, full_steps=2,
        real=RealSizes(sft_max_steps=60, sft_batch=64, sft_lr=2e-5, eval_rows=500, eval_k=4, max_new_tokens=256,
                       prompts=16, generations=8, grpo_lr=3e-6, grpo_max_steps=1000, grpo_max_seconds=None)),
    "tiny": Profile(
        gated=False, cap_scale=2.0,
        demo_overrides=["--model.tiny.hidden_size=64", "--model.tiny.intermediate_size=128", "--model.tiny.num_layers=1",
                        "--sft.max_steps=10", "--sft.batch_size=8", "--task.num_sft_examples=100",
                        "--task.num_sft_tir_examples=0", "--task.num_eval_questions=16", "--eval.k=2",
                        "--eval.tir=false", "--grpo.max_steps=3", "--grpo.prompts_per_step=4",
                        "--grpo.num_generations=4"],
        policy_size="tiny", prompts=2, generations=2, completion_length=16, lora_steps=3, full_steps=2,
        real=RealSizes(sft_max_steps=4, sft_batch=8, sft_lr=3e-3, eval_rows=30, eval_k=2, max_new_tokens=24,
                       prompts=4, generations=2, grpo_lr=1e-4, grpo_max_steps=1000, grpo_max_seconds=4.0,
                       model_args=["--model.name_or_path=", "--model.tiny.alphabet=ascii", "--model.tiny.hidden_size=32",
                                   "--model.tiny.num_layers=1", "--model.tiny.num_heads=2",
                                   "--model.tiny.intermediate_size=64"])),
}


# ---------------------------------------------------------------------------------- numbers


def mfu(params: int, tokens: float, seconds: float, peak_flops: float) -> float:
    """Model-FLOPs utilisation of an update: 6 x params x tokens over seconds x peak FLOP/s."""
    return 6.0 * params * tokens / seconds / peak_flops


def peak_for(device_name: str | None) -> tuple[float, str] | None:
    """(dense bf16 peak FLOP/s, where the figure comes from) for a device name, or None when unknown."""
    for part, tflops, source in PEAK_BF16_TFLOPS:
        if device_name and part.lower() in device_name.lower():
            return tflops * 1e12, f"{tflops:.0f} TFLOP/s for '{part}' ({source})"
    return None


def paired_interval(before: list[bool], after: list[bool]) -> dict:
    """The mean per-question change after - before (each 0 or 1) and its 95% interval, mean +- 1.96
    x sd / sqrt(n), sd the differences' sample standard deviation (n - 1): the paired interval of
    the gain in accuracy, as a fraction."""
    if len(before) != len(after) or len(before) < 2:
        raise ValueError(f"need two or more paired results, got {len(before)} before and {len(after)} after")
    d = [int(a) - int(b) for b, a in zip(before, after)]
    n, mean = len(d), sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = Z95 * sd / math.sqrt(n)
    return {"n": n, "gain": mean, "low": mean - half, "high": mean + half, "better": d.count(1), "worse": d.count(-1)}


def engine_numbers(rows: list[dict]) -> dict:
    """A separate engine's medians over the steps after the first: push + sync probe seconds and the
    engine-vs-trainer log-prob mismatch per token (empty for the hf engines, which log neither)."""
    timed = [r for r in rows[1:] if "rollout/sync_time_s" in r]
    if not timed:
        return {}
    return {"sync_s": statistics.median(float(r["rollout/sync_time_s"]) for r in timed),
            "logp_mismatch": statistics.median(float(r.get("rollout/logp_mismatch", float("nan"))) for r in timed)}


def grpo_numbers(rows: list[dict], samples: int, prompt_tokens: int, params: int, peak_flops: float | None) -> dict:
    """Medians over the steps after the first (it warms up) of a GRPO run's metrics.jsonl rows:
    step time and its parts, trained tokens per step (prompt + completion tokens of the
    step's `samples`), the update's model TFLOP/s and, given the device's peak, its MFU;
    perf/padding_frac and the rollout engine's compilations where the run logs them."""
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
    if all("perf/padding_frac" in r for r in timed):
        out["padding_frac"] = median("perf/padding_frac")
    if any("rollout/compiles" in r for r in rows):
        out["compiles"] = sum(int(r.get("rollout/compiles", 0)) for r in rows)
        out["recompiles"] = sum(int(r.get("rollout/recompiles", 0)) for r in rows)
    return out


def reward_curve(rows: list[dict], points: int = 5) -> list[float]:
    """reward/mean over the run in `points` consecutive stretches of steps, each its mean (fewer
    points when the run has fewer steps): the learning curve in a few numbers."""
    rewards = [float(r["reward/mean"]) for r in rows if "reward/mean" in r]
    if not rewards:
        return []
    points = min(points, len(rewards))
    bounds = [round(i * len(rewards) / points) for i in range(points + 1)]
    return [statistics.fmean(rewards[a:b]) for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------------------------- processes


@dataclass
class Ran:
    returncode: int | None  # None: stopped at its time limit
    seconds: float
    tail: str  # the last lines it printed
    asked_to_stop: bool = False  # should_stop() held and SIGTERM was sent (it then finished on its own, or not)

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


def run_logged(command: list[str], log_path: Path, timeout: float, env: dict | None = None, cwd: Path = REPO,
               should_stop=None) -> Ran:
    """Run `command` in its own process group, its output appended to log_path. Once should_stop()
    holds (polled every half second) the process itself (not its group: grpokit's verifier workers
    stay up to finish the step) gets one SIGTERM, which grpokit train answers by finishing its step
    and saving; at the time limit the whole group is stopped: SIGTERM, then SIGKILL."""
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        start_offset = log.tell()
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)
        asked = False
        try:
            while should_stop is not None and not asked and proc.poll() is None:
                if time.perf_counter() - start >= timeout:
                    raise subprocess.TimeoutExpired(command, timeout)
                if should_stop():
                    asked = True
                    proc.send_signal(signal.SIGTERM)
                else:
                    time.sleep(0.5)
            returncode = proc.wait(timeout=max(timeout - (time.perf_counter() - start), 0.1))
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
    return Ran(returncode, seconds, tail, asked)


def fresh(*paths: Path) -> None:
    """Remove what an earlier check left at `paths` (folders or files)."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _has_a_row(path: Path) -> bool:
    """Whether a JSONL file being written holds one whole line yet."""
    return path.is_file() and b"\n" in path.read_bytes()


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


class StepFailed(Exception):
    """A step's check did not hold; the message is its FAIL line (and its numbers, when any)."""


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
    peak_tflops: float | None  # --peak-tflops; else the device's name picks it (setup)
    engines: list[str]  # the generate step's engines; the last is the fast path its target is for
    real_dir: Path | None
    caps: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)  # what setup found: versions, device, engines, peak FLOP/s
    step_started: dict = field(default_factory=dict)
    logs: dict = field(default_factory=dict)  # a step's own log while it runs beside another

    @property
    def log(self) -> Path:
        return self.out / "gpu_check.log"

    def log_of(self, name: str) -> Path:
        return self.logs.get(name, self.log)

    def remaining(self) -> float:
        return self.deadline_s - (time.perf_counter() - self.started)

    def left_in(self, name: str) -> float:
        """Seconds step `name` may still run: what is left of its limit and of the check's."""
        return min(self.caps[name] - (time.perf_counter() - self.step_started[name]), self.remaining())

    def run(self, name: str, command: list[str], should_stop=None) -> Ran:
        """`command` within what is left of step `name`'s time limit and of the check's."""
        limit = self.left_in(name)
        if limit <= 1:
            raise StepFailed(f"no time left: {self.caps[name]:.0f} s step limit, {self.remaining():.0f} s of the "
                             f"check's {self.deadline_s:.0f}")
        return run_logged(command, self.log_of(name), limit, env=self.env, should_stop=should_stop)

    def grpokit(self, *args: str) -> list[str]:
        return [self.python, "-m", "grpokit.cli", *args]

    @property
    def peak_flops(self) -> float | None:
        return self.facts.get("peak_flops")

    @property
    def fast_engine(self) -> str:
        return self.engines[-1]

    def rollout_engine(self) -> str:
        """The engine GRPO runs with: the fast one where this grpokit registers it, else hf."""
        return self.fast_engine if self.fast_engine in self.facts.get("engines", []) else "hf"

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
            "from grpokit.rollout import ENGINES\n"
            "from math_verify import parse, verify\n"
            "assert verify(parse('$\\\\frac{1}{2}$'), parse('\\\\boxed{0.5}')), 'math_verify: 1/2 != 0.5'\n"
            f"device = {self.device!r}\n"
            "if device == 'cuda':\n"
            "    assert torch.cuda.is_available(), 'torch sees no CUDA device'\n"
            "facts = {'python': sys.version.split()[0], 'torch': torch.__version__,\n"
            "         'transformers': transformers.__version__, 'peft': peft.__version__,\n"
            "         'pydantic': pydantic.VERSION, 'grpokit': grpokit.__file__, 'engines': sorted(ENGINES),\n"
            "         'gpu': torch.cuda.get_device_name(0) if device == 'cuda' else None}\n"
            "print('FACTS ' + json.dumps(facts))\n"
        )
        ran = self.run("setup", [self.python, "-c", probe])
        facts = next((json.loads(line[6:]) for line in ran.tail.splitlines() if line.startswith("FACTS ")), None)
        if not ran.ok or facts is None:
            raise StepFailed(f"imports or device: {ran.why()}")
        self.facts.update(facts)
        if self.peak_tflops:
            self.facts.update(peak_flops=self.peak_tflops * 1e12, peak_source=f"{self.peak_tflops:g} TFLOP/s (--peak-tflops)")
        elif self.device == "cuda" and peak_for(facts["gpu"]):
            flops, source = peak_for(facts["gpu"])
            self.facts.update(peak_flops=flops, peak_source=source)
        else:
            self.facts.update(peak_flops=None, peak_source="none known for this device: MFU not computed "
                                                           "(--peak-tflops gives one)")
        return (f"torch {facts['torch']}, transformers {facts['transformers']}, python {facts['python']}; "
                f"{facts['gpu'] or self.device}; MFU peak: {self.facts['peak_source']}; engines "
                f"{', '.join(facts['engines'])}", dict(facts))

    def _policy(self) -> tuple[Path, dict]:
        info = self.work / "policy" / "policy.json"
        if not info.is_file():
            raise StepFailed("no policy: step `generate` did not build one")
        return info.parent, json.loads(info.read_text())

    def step_packing(self) -> tuple[str, dict]:
        """Packed against padded log-probs under flash_attention_2, two packed rows a forward: whether the
        kernel keeps packed samples apart there, and that grpokit pads where it does not."""
        ran = self.run("packing", [self.python, __file__, "packing", "--device", self.device])
        found = next((json.loads(line[8:]) for line in ran.tail.splitlines() if line.startswith("PACKING ")), None)
        if found is None:
            raise StepFailed(ran.why() if not ran.ok else "no PACKING line")
        if "skip" in found:
            raise StepSkipped(found["skip"])
        line = (f"flash_attention_2, {found['rows']} packed rows of {found['samples']} samples in one forward: max "
                f"|packed - padded| log-prob {found['max_diff']:.3g} (bf16 tolerance {found['tolerance']}); grpokit "
                f"{'packs' if found['packs'] else 'pads'} under grpo.pack_rows=auto")
        if found["max_diff"] > found["tolerance"] and found["packs"]:
            raise StepFailed(line + ": packed samples attend to each other, yet grpokit packs")
        return line, found

    def step_generate(self) -> tuple[str, dict]:
        """Build the benchmark policy (the GRPO steps train it), then time each engine on it; one
        process for both, one start-up fewer."""
        prof, policy, result = self.profile, self.work / "policy", self.work / "generate.json"
        fresh(policy, result)
        ran = self.run("generate", [self.python, __file__, "generate", str(policy), "--build", prof.policy_size,
                                    "--engines", ",".join(self.engines), "--prompts", str(prof.prompts),
                                    "--generations", str(prof.generations), "--max-new-tokens",
                                    str(prof.completion_length), "--device", self.device, "--json", str(result)])
        if not result.is_file():
            raise StepFailed(ran.why() if not ran.ok else "no generate.json")
        numbers = json.loads(result.read_text())
        p = numbers["policy"] = json.loads((policy / "policy.json").read_text())
        parts = []
        for name in self.engines:
            e = numbers["engines"].get(name, {})
            if "error" in e:
                parts.append(f"{name}: {e['error']}")
            else:
                first = f", first call {e['first_call_s']:.1f} s with {e['compiles']} compiles" if e["calls"] > 1 else ""
                parts.append(f"{name} {e['tokens_per_s']:,.0f} tokens/s ({e['tokens']:,} tokens in {e['seconds']:.2f} s"
                             f"{first}; peak {e['peak_gib']:.1f} GiB)")
        fast = numbers["engines"].get(self.fast_engine, {})
        target = TARGETS["generate_tokens_per_s"]
        line = (f"random-init Qwen2 {p['size']} ({p['params'] / 1e6:.1f}M parameters, tied embeddings, prompts of "
                f"{p['prompt_tokens']} tokens); {prof.prompts * prof.generations} completions of "
                f"{prof.completion_length} tokens, "
                f"{numbers['dtype'].removeprefix('torch.')}: "
                + "; ".join(parts) + f" [target: {self.fast_engine} >= {target:,.0f}"
                + ("" if prof.gated else ", dry run: not gated") + "]")
        if not ran.ok:
            raise StepFailed(f"{ran.why()}; {line}", numbers)
        if prof.gated and fast.get("tokens_per_s", 0.0) < target:
            raise StepFailed(line, numbers)
        return line, numbers

    def step_grpo(self, name: str, lora: bool) -> tuple[str, dict]:
        policy, p = self._policy()
        prof = self.profile
        steps = prof.lora_steps if lora else prof.full_steps
        run_dir, peak_json = self.work / name, self.work / f"{name}-peak.json"
        fresh(run_dir, peak_json)  # a reused --work must not lend this run an earlier one's numbers
        engine = self.rollout_engine()
        train = ["train", f"--model.name_or_path={policy}", "--model.gradient_checkpointing=false",
                 f"--rollout.engine={engine}",
                 f"--data.sources=[{{path: {str(policy / 'prompts.jsonl')!r}, format: plain}}]",
                 "--data.heldout_fraction=0", "--data.template=none", "--data.chat_template=off",
                 "--rewards=[{name: math_accuracy}]", f"--grpo.max_steps={steps}",
                 f"--grpo.prompts_per_step={prof.prompts}", f"--grpo.num_generations={prof.generations}",
                 f"--grpo.max_completion_length={prof.completion_length}", "--grpo.temperature=1.0",
                 f"--output_dir={run_dir}", "--quiet"]
        if lora:
            train += ["--model.lora.r=16", "--model.lora.alpha=32"]
        ran = self.run(name, [self.python, __file__, "probe", "--peak-json", str(peak_json), "--", *train])
        rows = read_rows(run_dir / "metrics.jsonl")
        if not ran.ok:  # the steps it finished still give numbers (the probe writes its peak as it goes)
            if len(rows) < 2 or not peak_json.is_file():
                raise StepFailed(f"{ran.why()}; {len(rows)} of {steps} steps done")
            line, numbers = self._grpo_numbers(rows, json.loads(peak_json.read_text()), p, lora, engine)
            raise StepFailed(f"{ran.why()}; {len(rows)} of {steps} steps done: {line}", numbers)
        if len(rows) != steps:
            raise StepFailed(f"{len(rows)} steps in metrics.jsonl, expected {steps}")
        line, numbers = self._grpo_numbers(rows, json.loads(peak_json.read_text()), p, lora, engine)
        checkpoint = run_dir / "checkpoints" / f"step-{steps}"
        saved = (checkpoint / "adapter_model.safetensors").is_file() if lora else checkpoint.is_dir()
        if numbers["skipped_updates"]:
            raise StepFailed(f"{numbers['skipped_updates']} updates skipped (non-finite loss or gradient); " + line,
                             numbers)
        if not saved:
            raise StepFailed(f"no checkpoint at {checkpoint}; " + line, numbers)
        if prof.gated and lora and numbers["step_s"] > TARGETS["grpo_lora_step_s"]:
            raise StepFailed(line, numbers)
        if prof.gated and not lora and (numbers["mfu"] is None or numbers["mfu"] < TARGETS["grpo_full_mfu"]):
            raise StepFailed(line, numbers)
        return line, numbers

    def _grpo_numbers(self, rows: list[dict], peak: dict, policy: dict, lora: bool, engine: str) -> tuple[str, dict]:
        prof = self.profile
        samples = prof.prompts * prof.generations
        numbers = {**grpo_numbers(rows, samples, policy["prompt_tokens"], policy["params"], self.peak_flops),
                   **engine_numbers(rows),
                   "peak_allocated_gib": peak["peak_bytes"] / 2**30,
                   "peak_reserved_gib": peak.get("reserved_bytes", 0) / 2**30, "peak_measure": peak["measure"],
                   "lora": lora, "engine": engine, "params": policy["params"], "samples_per_step": samples,
                   "completion_length": prof.completion_length, "peak_source": self.facts.get("peak_source")}
        mfu_text = f"MFU {numbers['mfu']:.1%}" if numbers["mfu"] is not None else "MFU n/a (no peak FLOP/s known)"
        padding = f", padding {numbers['padding_frac']:.1%}" if "padding_frac" in numbers else ""
        compiles = (f", {numbers['compiles']} compiles ({numbers['recompiles']} recompiles)"
                    if "compiles" in numbers else "")
        if lora:
            target = f"target: step <= {TARGETS['grpo_lora_step_s']:.0f} s"
        else:
            target = f"target: MFU >= {TARGETS['grpo_full_mfu']:.0%}"
        line = (f"{'LoRA r=16' if lora else 'full fine-tune'}, engine {engine}, {samples} x "
                f"{numbers['completion_mean_length']:.0f} tokens: step {numbers['step_s']:.2f} s (rollout "
                f"{numbers['rollout_s']:.2f}, log-probs {numbers['logprob_s']:.2f}, update {numbers['update_s']:.2f}; "
                f"median of {numbers['timed_steps']}){padding}{compiles}, peak {numbers['peak_allocated_gib']:.2f} GiB "
                f"({peak['measure']}), update {numbers['update_model_tflops']:.2f} TFLOP/s, {mfu_text} "
                f"[{target}{'' if prof.gated else ', dry run: not gated'}]")
        return line, numbers

    def step_demo(self) -> tuple[str, dict]:
        run_dir = self.work / "demo"
        fresh(run_dir)
        # the default precision: model.dtype auto (bf16 compute on CUDA), what `make demo` runs
        ran = self.run("demo", self.grpokit("demo", f"--model.device={self.device}", "--seed", "0", "--quiet",
                                            "--output-dir", str(run_dir), *self.profile.demo_overrides))
        summary_path = run_dir / "summary.json"
        if not ran.ok or not summary_path.is_file():
            raise StepFailed(ran.why() if not ran.ok else "no summary.json")
        s = json.loads(summary_path.read_text())
        gain = float(s["improvement_points"])
        numbers = {"sft_accuracy": s["sft_accuracy"], "grpo_accuracy": s["grpo_accuracy"], "gain_points": gain,
                   "wall_s": s["wall_seconds"], "sft_s": s.get("sft_seconds"), "rl_s": s.get("rl_seconds"),
                   "precision": "default (model.dtype auto)"}
        target = TARGETS["demo_gain_points"]
        line = (f"default precision: sft {s['sft_accuracy']:.1%} -> grpo {s['grpo_accuracy']:.1%} ({gain:+.1f} pt"
                + (f", target >= +{target:.0f}" if self.profile.gated else ", dry run: no target")
                + f"), demo wall {s['wall_seconds']:.0f} s" + (" (beside `real`)" if "real" in self.logs else ""))
        if self.profile.gated and gain < target:
            raise StepFailed(line, numbers)
        return line, numbers

    # ------------------------------------------------------------------ the real checkpoint

    def _real_files(self) -> tuple[list[str], Path, Path]:
        """(grpokit overrides naming the model, GSM8K's train file, its test file); SKIP without them."""
        if self.profile.real.model_args:  # the dry run: a tiny model and the fixtures' GSM8K rows
            return (list(self.profile.real.model_args), FIXTURES / "gsm8k_train_sample.jsonl",
                    FIXTURES / "gsm8k_test_sample.jsonl")
        if self.real_dir is None:
            raise StepSkipped("no --real-dir: benchmarks/gpu_payload.sh builds the model and GSM8K files (its "
                              "header says how to send them)")
        model, train, test = (self.real_dir / "model", self.real_dir / "gsm8k" / "train.jsonl",
                              self.real_dir / "gsm8k" / "test.jsonl")
        missing = [str(p) for p in (model / "config.json", train, test) if not p.is_file()]
        if missing:
            raise StepSkipped(f"--real-dir {self.real_dir}: missing {', '.join(missing)} (benchmarks/gpu_payload.sh "
                              "builds them)")
        return [f"--model.name_or_path={model}"], train, test

    def step_real(self) -> tuple[str, dict]:
        r, base = self.profile.real, self.work / "real"
        model_args, train, test = self._real_files()
        fresh(base)
        base.mkdir(parents=True)
        data = f"[{{path: {str(train)!r}, format: gsm8k}}]"
        rows = sum(1 for line in train.read_text().splitlines() if line.strip())
        sft_steps = max(1, min(r.sft_max_steps, rows // r.sft_batch))  # at most one epoch
        engine = self.rollout_engine()
        # evaluation with plain generate: a one-off pass over a few batches, where compiling costs more than it saves
        evaluate = ["eval", "--data", f"gsm8k={test}", "--mode", "cot", "--max-rows", str(r.eval_rows), "--k",
                    str(r.eval_k), "--max-new-tokens", str(r.max_new_tokens), "--device", self.device, "--quiet"]
        plan = {
            "sft": ["sft", *model_args, f"--data.sft_sources={data}", "--data.template=cot",
                    f"--sft.max_steps={sft_steps}", f"--sft.batch_size={r.sft_batch}", f"--sft.learning_rate={r.sft_lr}",
                    "--sft.warmup_steps=10", f"--model.device={self.device}", f"--output_dir={base / 'sft'}", "--quiet"],
            "eval": evaluate,
            "train": ["train", f"--model.device={self.device}", f"--rollout.engine={engine}", f"--data.sources={data}",
                      "--data.heldout_fraction=0", "--data.template=cot", "--rewards=[{name: math_accuracy}]",
                      f"--grpo.max_steps={r.grpo_max_steps}", f"--grpo.prompts_per_step={r.prompts}",
                      f"--grpo.num_generations={r.generations}", f"--grpo.max_completion_length={r.max_new_tokens}",
                      f"--grpo.learning_rate={r.grpo_lr}", "--grpo.beta=0", "--grpo.warmup_steps=2",
                      f"--output_dir={base / 'grpo'}", "--quiet"],
        }
        (base / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
        phases_file, metrics = base / "phases.jsonl", base / "grpo" / "metrics.jsonl"

        def should_stop() -> bool:
            """GRPO runs (a step logged) and must stop: the time left would barely hold the second evaluation
            (as long as the first, with room to finish the step and save), or the profile's GRPO limit is up."""
            phases = {p["phase"]: p for p in read_rows(phases_file)} if _has_a_row(phases_file) else {}
            if "eval_before" not in phases or "grpo" in phases or not _has_a_row(metrics):
                return False
            if r.grpo_max_seconds is not None and time.time() - phases["eval_before"]["at"] >= r.grpo_max_seconds:
                return True
            return self.left_in("real") < 1.3 * phases["eval_before"]["seconds"] + 15.0

        ran = self.run("real", [self.python, __file__, "real-run", str(base)], should_stop=should_stop)
        phases = {p["phase"]: p for p in read_rows(phases_file)}
        numbers: dict = {"sft_steps": sft_steps, "sft_epochs": sft_steps * r.sft_batch / rows, "engine": engine,
                         **{f"{name}_s": p["seconds"] for name, p in phases.items()}}
        if not ran.ok or "eval_after" not in phases:
            done = ", ".join(phases) or "none"
            raise StepFailed(f"{ran.why() if not ran.ok else 'no second evaluation'}; phases done: {done}", numbers)
        sft_rows, grpo_rows = read_rows(base / "sft" / "sft_metrics.jsonl"), read_rows(metrics)
        peak = json.loads((base / "grpo-peak.json").read_text())
        before, after = (_eval_result(base / "eval-before"), _eval_result(base / "eval-after"))
        ci = paired_interval(before[1], after[1])
        numbers.update(
            sft_final_loss=float(sft_rows[-1]["loss"]) if sft_rows else None, grpo_steps=len(grpo_rows),
            stopped_by_signal=ran.asked_to_stop,
            step_s=statistics.median(float(x["perf/step_time_s"]) for x in grpo_rows[1:] or grpo_rows),
            peak_allocated_gib=peak["peak_bytes"] / 2**30, peak_measure=peak["measure"],
            reward_curve=reward_curve(grpo_rows), rewards=[round(float(x["reward/mean"]), 4) for x in grpo_rows],
            before=before[0], after=after[0], gain=ci)
        line = self._real_line(numbers, ci, before[1], after[1])
        if self.profile.gated and not ci["low"] > 0:
            raise StepFailed(line, numbers)
        return line, numbers

    def _real_line(self, n: dict, ci: dict, before: list[bool], after: list[bool]) -> str:
        k = self.profile.real.eval_k

        def accuracies(scores: dict, correct: list[bool]) -> str:
            passk = scores.get(f"pass@{k}")
            return f"greedy {sum(correct) / len(correct):.1%}" + (f", pass@{k} {passk:.1%}" if passk is not None else "")

        curve = " -> ".join(f"{x:.3f}" for x in n["reward_curve"])
        return (f"SFT {n['sft_steps']} steps ({n['sft_epochs']:.2f} epoch, {n['sft_s']:.0f} s); {ci['n']} test "
                f"questions ({n['eval_before_s']:.0f} s an evaluation): before {accuracies(n['before'], before)}; "
                f"after {n['grpo_steps']} GRPO steps ({n['grpo_s']:.0f} s) "
                f"{accuracies(n['after'], after)}; greedy gain {ci['gain'] * 100:+.1f} pt, 95% interval "
                f"[{ci['low'] * 100:+.1f}, {ci['high'] * 100:+.1f}] ({ci['better']} better, {ci['worse']} worse"
                + (", target: above 0" if self.profile.gated else ", dry run: no target")
                + f"); reward {curve}; step {n['step_s']:.2f} s ({n['engine']}), peak {n['peak_allocated_gib']:.2f} GiB"
                + (" (beside `demo`)" if "demo" in self.logs else ""))


def _eval_result(out: Path) -> tuple[dict, list[bool]]:
    """`grpokit eval`'s GSM8K CoT scores in `out` (accuracy, pass@k, maj@k) and each question's greedy
    verdict, in the file's order."""
    scores = json.loads((out / "results.json").read_text())["results"]["gsm8k"]["cot"]
    return scores, [bool(x["correct"]) for x in read_rows(out / "completions-gsm8k-cot.jsonl")]


def _record(check: Check, name: str, action) -> dict:
    """Run one step; its status, line, seconds and numbers."""
    start = check.step_started[name] = time.perf_counter()
    numbers: dict = {}
    try:
        line, numbers = action()
        status = "PASS"
    except StepSkipped as skip:
        status, line = "SKIP", str(skip)
    except StepFailed as failure:
        status, line = "FAIL", str(failure.args[0])
        numbers = failure.args[1] if len(failure.args) > 1 else {}
    except Exception as err:  # a bug or an unexpected file: recorded like any failure
        status, line = "FAIL", f"{type(err).__name__}: {err}"
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), "line": line, **numbers}


def run_check(check: Check, steps: list[str]) -> dict:
    """The steps in order, each recorded whatever the others did (PARALLEL's side by side, each
    with its own log appended to the main one when done); summary.json after each."""
    summary = {"device": check.device, "started": datetime.datetime.now().isoformat(timespec="seconds"),
               "deadline_s": check.deadline_s, "work_dir": str(check.work), "steps": {}}
    actions = {"setup": check.step_setup, "packing": check.step_packing, "generate": check.step_generate,
               "grpo_lora": lambda: check.step_grpo("grpo_lora", lora=True),
               "grpo_full": lambda: check.step_grpo("grpo_full", lora=False),
               "demo": check.step_demo, "real": check.step_real}
    groups = [[s] for s in steps if s not in PARALLEL] + ([[s for s in steps if s in PARALLEL]]
                                                          if any(s in PARALLEL for s in steps) else [])
    for group in groups:
        sections = {}
        for name in group:
            if len(group) > 1:
                check.logs[name] = check.work / f"{name}.log"
                check.logs[name].write_text("")
            with open(check.log_of(name), "a") as log:
                log.write(f"\n===== {name} (at {time.perf_counter() - check.started:.0f} s"
                          + (f", beside {', '.join(s for s in group if s != name)}" if len(group) > 1 else "") + ")\n")
                sections[name] = log.tell()
        with ThreadPoolExecutor(max_workers=len(group)) as pool:
            results = dict(zip(group, pool.map(lambda name: _record(check, name, actions[name]), group)))
        for name in group:
            step = summary["steps"][name] = results[name]
            text = f"{step['status']} {name}: {step['line']} [{step['seconds']:.0f} s]"
            with open(check.log_of(name), "a") as log:
                log.write(text + "\n")
            output = []
            with open(check.log_of(name), "rb") as log:
                log.seek(sections[name])
                output = log.read().decode(errors="replace").splitlines()[:-1]  # less the status line
            if name in check.logs:  # its own log joins the main one
                with open(check.log, "a") as log:
                    log.write(check.logs.pop(name).read_text())
            summary["facts"] = check.facts
            summary["wall_s"] = round(time.perf_counter() - check.started, 1)
            summary["passed"] = all(s["status"] != "FAIL" for s in summary["steps"].values())
            (check.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
            print(text, flush=True)
            if step["status"] == "FAIL" and output:  # where it broke, without opening the log
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


def generation_benchmark(policy_dir: Path, engines: list[str], prompts: int, generations: int, max_new_tokens: int,
                         device: str) -> dict:
    """Completion tokens/s of each rollout engine (by registered name) on the saved policy, in bf16
    on CUDA (fp32 on the CPU): `prompts` x `generations` completions of up to max_new_tokens, as a
    GRPO step samples them. An engine whose first call compiled something (rollout/compiles) is
    timed again: the second call is its steady state, the first is reported beside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.config.schema import RolloutConfig
    from grpokit.rollout import ENGINES, SamplingParams, make_engine

    cuda = device == "cuda"
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    model.to(device).eval()
    texts = [json.loads(line)["prompt"] for line in (policy_dir / "prompts.jsonl").read_text().splitlines()][:prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, batch_size=prompts * generations)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with torch.no_grad():  # cuBLAS and the allocator start up outside the timings
        ids = tokenizer(texts[:1], return_tensors="pt").input_ids.to(device)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    out = {"device": device, "dtype": str(model.dtype), "completions": prompts * generations,
           "max_new_tokens": max_new_tokens, "engines": {}}
    for name in engines:
        if name not in ENGINES:
            out["engines"][name] = {"error": f"not registered in this grpokit (registered: {', '.join(sorted(ENGINES))})"}
            continue
        config = RolloutConfig(engine=name)
        problems = list(ENGINES[name].check(config) or []) if ENGINES[name].check else []
        if problems:
            out["engines"][name] = {"error": problems[0]}
            continue
        engine = make_engine(config, model, tokenizer, seed=0, weights_dir=str(policy_dir))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        calls = []
        for _ in range(2):
            sync()
            start = time.perf_counter()
            rollout = engine.generate(texts, generations, params)
            sync()
            seconds = time.perf_counter() - start
            report = engine.rollout_metrics() if hasattr(engine, "rollout_metrics") else {}
            calls.append({"seconds": seconds, "tokens": int(rollout.completion_mask.sum()),
                          "compiles": int(report.get("rollout/compiles", 0)),
                          "recompiles": int(report.get("rollout/recompiles", 0))})
            if not calls[-1]["compiles"]:
                break  # nothing compiled: this call was the steady state
        last = calls[-1]
        out["engines"][name] = {
            "tokens": last["tokens"], "seconds": last["seconds"], "tokens_per_s": last["tokens"] / last["seconds"],
            "calls": len(calls), "first_call_s": calls[0]["seconds"], "compiles": calls[0]["compiles"],
            "recompiles": sum(c["recompiles"] for c in calls[1:]),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
        print(f"{name}: {json.dumps(out['engines'][name])}", flush=True)
        engine.close()
    return out


def packing_probe(device: str) -> int:
    """The packing step's measurement in one process: a small random Llama under flash_attention_2 in bf16,
    8 samples packed into rows of two or three, log-probs packed (one forward of every packed row) against
    padded, and what grpokit's grpo.pack_rows=auto decides for it. Prints one PACKING {json} line."""
    import importlib.util

    import torch

    if device != "cuda" or importlib.util.find_spec("flash_attn") is None:
        why = "no CUDA device" if device != "cuda" else "flash_attn is not installed"
        print("PACKING " + json.dumps({"skip": f"{why}: flash_attention_2 not measured (grpokit pads under it)"}))
        return 0
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpokit.models.logprobs import token_logprobs
    from grpokit.train.packing import decide_packing
    from grpokit.types import Rollout

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="flash_attention_2")
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    samples, prompt, completion = 8, 16, 48
    ids = torch.randint(3, 512, (samples, prompt + completion), device="cuda")
    mask = torch.ones_like(ids)
    for row in range(samples):  # completions of different lengths, so samples share packed rows unevenly
        mask[row, prompt + completion - 4 * row:] = 0
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, mask, prompt, micro_batch_size=64)
        width = 2 * (prompt + completion)
        packed, _ = token_logprobs(model, ids, mask, prompt, micro_batch_size=64, pack=True, pack_width=width)
    rollout = Rollout(prompts=[""] * samples, completions=[""] * samples, input_ids=ids.cpu(), attention_mask=mask.cpu(),
                      completion_mask=mask[:, prompt:].cpu(), truncated=torch.zeros(samples, dtype=torch.bool),
                      prompt_length=prompt, group_size=samples)
    packs = decide_packing("auto", model, rollout, 0, 16384, 1)
    print("PACKING " + json.dumps({"samples": samples, "rows": -(-samples * (prompt + completion) // width),
                                   "max_diff": float((packed - padded).abs().max()), "tolerance": 0.1,
                                   "packs": packs}))
    return 0


def real_run(base: Path) -> int:
    """The real step's phases in this one process (one start-up, not four), as base/plan.json gives
    them: SFT, `grpokit eval` of pi_SFT, GRPO from it (peak memory as `probe` measures it), `grpokit
    eval` of its last checkpoint. Each phase's seconds and end time go to base/phases.jsonl as it
    ends, which the check reads to decide when to stop GRPO. SIGTERM is ignored outside GRPO's loop
    (which installs its own handler: finish the step, save), so a late one cannot cut an evaluation."""
    from grpokit.cli import main as grpokit

    # a no-op handler, not SIG_IGN: the processes it starts (verifier workers) would inherit an ignored signal
    signal.signal(signal.SIGTERM, lambda *_: print("real-run: SIGTERM outside GRPO's loop: ignored", flush=True))
    plan = json.loads((base / "plan.json").read_text())

    def phase(name: str, run) -> None:
        start = time.perf_counter()
        code = run()
        if code:
            raise SystemExit(f"real-run: {name} failed (exit {code}); its output is above")
        with open(base / "phases.jsonl", "a") as f:
            f.write(json.dumps({"phase": name, "seconds": time.perf_counter() - start, "at": time.time()}) + "\n")

    sft = base / "sft" / "checkpoints" / "sft"
    phase("sft", lambda: grpokit(plan["sft"]))
    phase("eval_before", lambda: grpokit([plan["eval"][0], str(sft), *plan["eval"][1:], "--output-dir",
                                          str(base / "eval-before")]))
    phase("grpo", lambda: probe(base / "grpo-peak.json", [*plan["train"], f"--model.name_or_path={sft}"]))
    checkpoints = sorted((base / "grpo" / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    if not checkpoints:
        raise SystemExit(f"real-run: GRPO left no checkpoint in {base / 'grpo' / 'checkpoints'}")
    phase("eval_after", lambda: grpokit([plan["eval"][0], str(checkpoints[-1]), *plan["eval"][1:], "--output-dir",
                                         str(base / "eval-after")]))
    return 0


def probe(peak_json: Path, cli_args: list[str]) -> int:
    """`grpokit <cli_args>` in this process, then its peak memory to peak_json: CUDA
    max_memory_allocated (and reserved) over the whole run, or the CPU's peak resident size.
    Written every 2 s as the run goes too, so a run stopped at its time limit leaves one."""
    import torch

    from grpokit.bench.memory_probe import peak_bytes, reset_peak
    from grpokit.cli import main

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if not cuda or torch.cuda.is_initialized():  # what ran before in this process (real-run's SFT) is not counted
        reset_peak(device)

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

    stop = threading.Event()
    writer = threading.Thread(target=keep_writing, args=(stop,), daemon=True)
    writer.start()
    try:
        code = main(cli_args)
    finally:  # an interrupted run (SIGTERM: finish the step, save, exit 1) still leaves its peak
        stop.set()
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
    if argv[:1] == ["packing"]:
        p = argparse.ArgumentParser(prog="gpu_check.py packing")
        p.add_argument("--device", default="cuda")
        return packing_probe(p.parse_args(argv[1:]).device)
    if argv[:1] == ["generate"]:
        p = argparse.ArgumentParser(prog="gpu_check.py generate")
        p.add_argument("policy", type=Path)
        p.add_argument("--build", metavar="SIZE", help="first build and save the benchmark policy of SIZE there")
        p.add_argument("--engines", default="hf,hf_static")
        p.add_argument("--prompts", type=int, default=16)
        p.add_argument("--generations", type=int, default=4)
        p.add_argument("--max-new-tokens", type=int, default=1024)
        p.add_argument("--device", default="cuda")
        p.add_argument("--json", type=Path, required=True)
        a = p.parse_args(argv[1:])
        if a.build:
            save_policy(a.build, a.policy, 4 * a.prompts, a.device)
        result = generation_benchmark(a.policy, a.engines.split(","), a.prompts, a.generations, a.max_new_tokens,
                                      a.device)
        a.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    if argv[:1] == ["real-run"]:
        return real_run(Path(argv[1]))
    if argv[:1] == ["probe"]:
        if "--" not in argv:
            raise SystemExit("usage: gpu_check.py probe --peak-json PATH -- GRPOKIT_ARGS...")
        cut = argv.index("--")
        p = argparse.ArgumentParser(prog="gpu_check.py probe")
        p.add_argument("--peak-json", type=Path, required=True)
        return probe(p.parse_args(argv[1:cut]).peak_json, argv[cut + 1 :])

    parser = argparse.ArgumentParser(description="grpokit's GPU check: generation speed, GRPO steps (LoRA and full) "
                                     "on a Qwen2-0.5B-shaped policy, the demo and a real checkpoint on GSM8K, each "
                                     "step within its own time limit",
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
    parser.add_argument("--engines", default="hf,hf_static",
                        help="rollout engines the generate step times, by registered name; the last is the fast "
                             "path (its target, and the engine of the GRPO steps where registered)")
    parser.add_argument("--real-dir", type=Path,
                        help="the real step's files: DIR/model (a Hugging Face folder) and DIR/gsm8k/{train,test}.jsonl "
                             "(benchmarks/gpu_payload.sh builds them)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak for MFU (default: by the "
                        f"device's name: {', '.join(f'{n} {t:.0f}' for n, t, _ in PEAK_BF16_TFLOPS)})")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    unknown = set(args.steps.split(",")) - set(STEPS) if args.steps else set()
    if unknown:
        parser.error(f"--steps: unknown {', '.join(sorted(unknown))}; choose from {', '.join(STEPS)}")
    steps = list(STEPS) if not args.steps else [s for s in STEPS if s == "setup" or s in args.steps.split(",")]
    if any(s in ("grpo_lora", "grpo_full") for s in steps) and "generate" not in steps:
        steps.insert(steps.index("setup") + 1, "generate")  # it builds the policy they train
    profile = args.profile or ("full" if args.device == "cuda" else "tiny")
    scale = PROFILES[profile].cap_scale
    caps = {name: seconds * scale for name, seconds in CAPS.items()}
    deadline = args.deadline * scale
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if args.device == "cpu":  # tiny models: one thread each is faster, and far faster on a busy machine
        env.setdefault("OMP_NUM_THREADS", "1")
    check = Check(device=args.device, profile=PROFILES[profile], out=out, work=work, python=sys.executable,
                  wheels=args.wheels, started=started, deadline_s=deadline, peak_tflops=args.peak_tflops,
                  engines=[e for e in args.engines.split(",") if e], real_dir=args.real_dir, caps=caps, env=env)
    print(f"grpokit GPU check on {args.device} ({profile} sizes), steps {', '.join(steps)} ({' and '.join(PARALLEL)} "
          f"side by side); at most {deadline:.0f} s (step limits {schedule_seconds(caps, steps):.0f} s); "
          f"work dir {work}", flush=True)
    summary = run_check(check, steps)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
