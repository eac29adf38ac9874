"""Several processes (torchrun, FSDP2 on gloo): the loss, and so the update, does not depend on
the number of processes (docs/algorithm.md, "the same loss on any number of processes").

The equivalence test takes one fixed batch of rollouts (same prompts, completions, rewards;
uneven completion lengths; one failed-reward row, whose mask is all zero), makes one SGD step
on 2 processes under FSDP2 and on 1 plain process, and compares the weights, for each aggregation
(and for a LoRA policy, whose reference is its base model with the adapters disabled).
"""

import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from grpokit import distributed
from grpokit.run.checkpoint import saved_world_size
from grpokit.config import Config, ConfigError, GRPOConfig, LoraConfig, check_world_size
from grpokit.data import arithmetic
from grpokit.math import masked_outcome_advantages
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.models.precision import set_compute_dtype
from grpokit.rewards import WeightedReward
from grpokit.rollout import SamplingParams, sample_groups
from grpokit.models.reference import frozen_copy
from grpokit.train.algorithm import Batch
from grpokit.train.grpo import GRPOTrainer
from run_helpers import free_port, spawn_ranks

AGGREGATIONS = ("sequence", "token", "constant")
G, PROMPTS, WORLD = 4, 4, 2
FAILED_ROW = 13  # in the second process's half: the two halves have different counts


def tiny(tokenizer):
    return build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)


def fixed_batch():
    """(rows, rollout, rewards, valid): 4 prompts x 4 completions sampled once, uneven lengths."""
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    rows = arithmetic.make_rows(arithmetic.sample_questions(PROMPTS, 0, arithmetic.ChainSpec(), "train"))
    torch.manual_seed(1234)
    rollout = sample_groups(tiny(tokenizer), tokenizer, [r["prompt"] for r in rows], G,
                            SamplingParams(max_new_tokens=10, temperature=1.0), rows)
    rewards = torch.linspace(-1.0, 2.0, PROMPTS * G, dtype=torch.float64).roll(3)
    valid = torch.ones(PROMPTS * G, dtype=torch.bool)
    valid[FAILED_ROW] = False
    return rows, rollout, rewards, valid


# (aggregation, LoRA, compute dtype); bf16: fp32 master weights, FSDP2 gathers them in bf16 and reduces
# gradients in fp32, the one process runs under autocast (models/precision.py)
CASES = [(aggregation, False, "fp32") for aggregation in AGGREGATIONS] + [("token", True, "fp32"),
                                                                          ("token", False, "bf16")]


def one_step(rows, rollout, rewards, valid, aggregation: str, lora: bool, rank: int, world: int, shard: bool,
             micro_batch_size: int, run_dir, steps: int = 1, dtype: str = "fp32") -> dict:
    """One SGD step (lr 1, no clipping) on this process's contiguous whole groups; the full weights
    (before the step with steps=0)."""
    from grpokit.models.lora import apply_lora
    from grpokit.models.sharding import full_state_dict, shard_model

    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    model = tiny(tokenizer)
    if dtype == "bf16":
        set_compute_dtype(model, torch.bfloat16)
    ref = None
    if lora:  # the trainer runs the base model under the adapters as the reference
        model = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    else:
        ref = frozen_copy(model)
    if shard:
        shard_model(model)
        if ref is not None:
            shard_model(ref)
    config = GRPOConfig(num_generations=G, prompts_per_step=PROMPTS, max_completion_length=10, beta=0.04,
                        loss_aggregation=aggregation, micro_batch_size=micro_batch_size, max_grad_norm=1e9)
    unused = WeightedReward("unused", lambda prompts, completions, **_: [0.0] * len(completions))
    with torch.no_grad():  # a forward before training, as eval.before makes: it leaves the FSDP2 root unsharded
        model(input_ids=rollout.input_ids[:2], attention_mask=rollout.attention_mask[:2])
    trainer = GRPOTrainer(model, tokenizer, [unused], rows, config, run_dir, ref_model=ref, progress=False)
    # SGD on the parameters the trainer's optimizer holds: under FSDP2, the shards every update must reach
    trainer.optimizer = torch.optim.SGD(trainer.optimizer.param_groups[0]["params"], lr=1.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
    n = rollout.num_samples // world
    mine = torch.arange(rank * n, (rank + 1) * n)
    local = rollout.take(mine)
    advantages = masked_outcome_advantages(rewards[mine].float(), valid[mine], G)  # whole groups: no communication
    loss_mask = local.completion_mask * valid[mine].unsqueeze(1)
    ref_logp, old_logp = trainer.fixed_logprobs(local)
    if steps:
        trainer.update_policy(Batch(local, None, loss_mask, ref_logp, old_logp, tokenizer, True, layout=trainer.layout),
                              advantages)
    return full_state_dict(model)


def sft_losses(shard: bool) -> list[float]:
    """Two SFT steps (AdamW) on the same demonstrations: the per-step mean token loss of the whole batch."""
    from grpokit.config import SFTConfig
    from grpokit.models.sharding import shard_model
    from grpokit.train.sft import sft_train

    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    model = tiny(tokenizer)
    if shard:
        shard_model(model)
    questions = arithmetic.sample_questions(16, 0, arithmetic.ChainSpec(), "train")
    demos = [(r["prompt"], r["solution"]) for r in arithmetic.make_sft_rows(questions, 0.5, 0)]
    return sft_train(model, tokenizer, demos, SFTConfig(max_steps=2, batch_size=8, warmup_steps=0), progress=False)


def sharded_logprob_tiles(rollout) -> dict:
    """A sharded policy's log-probs go through its own forward with the head tiled: the largest
    number of positions the head saw at once, and the largest difference from the plain model's."""
    from grpokit.models.sharding import shard_model
    from grpokit.models.wrapping import fsdp_root
    from grpokit.models.logprobs import token_logprobs

    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    plain, sharded = tiny(tokenizer), shard_model(tiny(tokenizer))
    args = (rollout.input_ids, rollout.attention_mask, rollout.prompt_length, 0.7, 8)
    expected, _ = token_logprobs(plain, *args, chunk_size=16)
    seen = []
    hook = fsdp_root(sharded).get_output_embeddings().register_forward_hook(
        lambda module, inputs, output: seen.append(output.shape[:-1].numel()))
    logp, entropy = token_logprobs(sharded, *args, with_entropy=True, chunk_size=16)
    hook.remove()
    return {"max_positions": max(seen), "calls": len(seen), "difference": float((logp - expected).abs().max()),
            "entropy": entropy is not None and entropy.shape == logp.shape}


def _equivalence_worker(rank: int, world: int, port: int, batch, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    assert distributed.init(timeout_s=120)
    try:
        tiles = sharded_logprob_tiles(batch[1])
        if rank == 0:
            torch.save(tiles, os.path.join(out_dir, "tiles.pt"))
        for aggregation, lora, dtype in CASES:
            state = one_step(*batch, aggregation, lora, rank, world, shard=True, micro_batch_size=3,
                             run_dir=os.path.join(out_dir, f"rank{rank}"), dtype=dtype)
            if rank == 0:
                torch.save(state, os.path.join(out_dir, f"{aggregation}-{lora}-{dtype}.pt"))
        losses = sft_losses(shard=True)
        if rank == 0:
            torch.save(losses, os.path.join(out_dir, "sft.pt"))
    finally:
        distributed.shutdown()


def test_one_step_on_two_fsdp2_processes_gives_the_weights_of_one_process(tmp_path):
    batch = fixed_batch()
    _, rollout, _, valid = batch
    lengths = rollout.completion_lengths
    assert len(set(lengths.tolist())) > 2, "the batch needs uneven completion lengths"
    assert not valid[FAILED_ROW]

    spawn_ranks(_equivalence_worker, WORLD, batch, str(tmp_path))

    for aggregation, lora, dtype in CASES:
        single = one_step(*batch, aggregation, lora, rank=0, world=1, shard=False, micro_batch_size=64,
                          run_dir=tmp_path / "single", dtype=dtype)
        sharded = torch.load(tmp_path / f"{aggregation}-{lora}-{dtype}.pt")
        assert sharded.keys() == single.keys()
        assert {v.dtype for v in sharded.values()} == {torch.float32}  # bf16 too: the master weights
        torch.manual_seed(0)
        initial = one_step(*batch, aggregation, lora, rank=0, world=1, shard=False, micro_batch_size=64,
                           run_dir=tmp_path / "initial", steps=0, dtype=dtype)
        moved = max(float((single[k] - initial[k]).abs().max()) for k in single)
        worst = max(float((sharded[k] - single[k]).abs().max()) for k in single)
        print(f"{aggregation}{' LoRA' if lora else ''} {dtype}: largest weight change {moved:.3e}, largest "
              f"2-process vs 1-process difference {worst:.3e}")
        assert moved > 1e-3, "the step must move the weights for the comparison to mean anything"
        # fp32: the same arithmetic up to summation order. bf16: FSDP2 computes every op in bf16, autocast
        # keeps norms and reductions in fp32, so the two differ by bf16 rounding of the gradient (2^-8).
        tolerance = 1e-5 if dtype == "fp32" else 0.02 * moved
        for k in single:
            torch.testing.assert_close(sharded[k], single[k], rtol=0, atol=tolerance,
                                       msg=lambda m, k=k: f"{aggregation} {dtype}, {k}: {m}")

    # Under FSDP2 the head saw tiles of at most chunk_size positions, never the whole batch's logits.
    tiles = torch.load(tmp_path / "tiles.pt")
    print(f"sharded log-probs: {tiles}")
    assert tiles["max_positions"] <= 16 and tiles["calls"] > 2 and tiles["entropy"]
    assert tiles["difference"] < 1e-5

    # SFT: each process's share of the batch over the whole batch's token count (uneven lengths)
    two, one = torch.load(tmp_path / "sft.pt"), sft_losses(shard=False)
    print(f"sft: losses on 2 processes {two}, on 1 process {one}")
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)


GEN_PROMPTS = (["Q: 12+7-3\n", "Q: 5\n"], ["Q: 40-1+2+8\n", "Q: 9+9\n", "Q: 3-2\n"])  # each process's own


def _generation_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Greedy generate on the FSDP2 policy: each process its own prompts (another count, other
    lengths), counting the all-gathers the call makes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    assert distributed.init(timeout_s=120)
    try:
        from grpokit.models.sharding import shard_model

        tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
        model = shard_model(tiny(tokenizer))
        gathers = []
        # FSDP2's all-gather, by torch version: all_gather_single (2.13), all_gather_into_tensor (earlier)
        names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(torch.distributed, n)]
        real = {n: getattr(torch.distributed, n) for n in names}

        def counting(name):
            def counted(*args, **kwargs):
                gathers.append(name)
                return real[name](*args, **kwargs)
            return counted

        for name in names:
            setattr(torch.distributed, name, counting(name))
        try:
            out = sample_groups(model, tokenizer, GEN_PROMPTS[rank], 1, SamplingParams(max_new_tokens=12, temperature=0))
        finally:
            for name in names:
                setattr(torch.distributed, name, real[name])
        units = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
        torch.save({"completions": out.completions, "gathers": len(gathers), "units": units},
                   os.path.join(out_dir, f"generate{rank}.pt"))
        # training goes on after generation: a forward and backward with the usual sharding
        loss = model(input_ids=out.input_ids[:, :8]).logits.float().mean()
        loss.backward()
        # backward's last reduce-scatter may still be in flight on the other process: tearing the
        # group down under it aborts gloo (as a run's final checkpoint barrier would prevent)
        distributed.barrier()
    finally:
        distributed.shutdown()


def test_generate_on_fsdp2_gathers_each_unit_once_per_call_not_per_token(tmp_path):
    """HF generate on a sharded policy all-gathers every FSDP2 unit once for the whole call (12
    decoded tokens), not once per token; the processes decode their own prompts, as many as they
    have, without stepping together; and the completions are the unsharded model's."""
    spawn_ranks(_generation_worker, WORLD, str(tmp_path))
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"generate{rank}.pt")
        plain = sample_groups(tiny(tokenizer), tokenizer, GEN_PROMPTS[rank], 1,
                              SamplingParams(max_new_tokens=12, temperature=0))
        assert got["completions"] == plain.completions
        assert got["units"] == 3 and got["gathers"] == got["units"], got  # 2 layers + the root, once each


# --------------------------------------------------------------------------- one process: no-ops and checks


def test_in_one_process_the_collectives_return_their_input():
    assert not distributed.is_initialized() and distributed.world_size() == 1 and distributed.is_main()
    assert distributed.all_reduce_sum(3.5) == 3.5 and distributed.all_reduce_sum(2) == 2
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(distributed.all_reduce_sum(t), t)
    assert distributed.all_agree(True) and not distributed.all_agree(False)
    assert distributed.sum_dict({"a": 1.0}) == {"a": 1.0}
    assert distributed.reduce_metrics({"step": 3, "x": 0.5}) == {"step": 3, "x": 0.5}
    assert distributed.process_seed(7) == 7
    distributed.barrier()


def test_a_tensor_parallel_size_that_does_not_divide_the_processes_per_node_is_a_config_error():
    config = Config()
    config.rollout.engine, config.rollout.tensor_parallel_size = "vllm", 4
    config.grpo.prompts_per_step = 48
    check_world_size(config, 16, per_node=8)  # two nodes of 8 GPUs: two engines per node
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=4 does not divide the 6 process\(es\) per "
                                          r"node .*start torchrun with --nproc_per_node a multiple of 4"):
        check_world_size(config, 12, per_node=6)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide the 1 process\(es\) per node"):
        check_world_size(config, 1)  # one process: nothing to share an engine with


def test_a_world_size_that_does_not_divide_the_batch_is_a_config_error():
    config = Config()
    config.grpo.prompts_per_step = 6
    check_world_size(config, 3)
    with pytest.raises(ConfigError, match=r"prompts_per_step=6.*4 processes \(the world size\)"):
        check_world_size(config, 4)
    config.distributed.fsdp = "off"
    with pytest.raises(ConfigError, match="3 separate models"):
        check_world_size(config, 3)


def _push_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """What a vLLM engine receives from an FSDP2 policy (plain and LoRA), taken from the engine's own
    push path (no vLLM needed for it): each weight whole, one at a time, none kept after the next."""
    import weakref

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    assert distributed.init(timeout_s=120)
    try:
        import grpokit.models.sharding as sharding
        from grpokit.models.lora import apply_lora, lora_merged_weights
        from grpokit.rollout.vllm import VLLMEngine, policy_weights

        def whole_model_gathered(*args, **kwargs):
            raise AssertionError("the push gathered the whole model at once")

        sharding.full_state_dict = whole_model_gathered
        tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
        results = {}
        for lora in (False, True):
            model = tiny(tokenizer)
            if lora:
                model = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["all-linear"]))
                torch.manual_seed(1)
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.data.normal_()  # a non-zero adapter, so merged differs from the base
            expected = {k: (v() if callable(v) else v).detach().clone() for k, v in policy_weights(model).items()}
            sharding.shard_model(model)
            engine = VLLMEngine.__new__(VLLMEngine)  # the push path alone, without starting vLLM
            engine.tie_word_embeddings, engine.dtype = True, torch.float32
            engine._weight_names = set(engine._names(policy_weights(model)))
            pushed, kept_alive, worst, previous = [], 0, 0.0, None
            for name, tensor in engine._weights_for_vllm(policy_weights(model)):
                kept_alive += previous is not None and previous() is not None
                assert type(tensor) is torch.Tensor, f"{name} reached the engine as {type(tensor).__name__}"
                worst = max(worst, float((tensor - expected[name]).abs().max()))
                pushed.append(name)
                previous = weakref.ref(tensor)
                del tensor
            results["lora" if lora else "full"] = {"pushed": pushed, "kept_alive": kept_alive, "worst": worst,
                                                   "expected": sorted(k for k in expected if k != "lm_head.weight")}
        torch.save(results, os.path.join(out_dir, f"push{rank}.pt"))
    finally:
        distributed.shutdown()


def test_a_sharded_policy_reaches_the_engine_one_whole_parameter_at_a_time(tmp_path):
    """The vLLM engine's push from an FSDP2 policy on 2 processes: every weight arrives whole (a plain
    tensor gathered on its device, LoRA layers merged from their gathered W, A and B) and equal to the
    unsharded policy's; the previous one is freed before the next is gathered; the whole state dict is
    never gathered."""
    spawn_ranks(_push_worker, WORLD, str(tmp_path))
    for rank in range(WORLD):
        for setup, result in torch.load(tmp_path / f"push{rank}.pt").items():
            print(f"rank {rank} {setup}: {len(result['pushed'])} weights, largest difference {result['worst']:.2e}")
            assert sorted(result["pushed"]) == result["expected"]  # every weight once, the tied head left out
            assert result["kept_alive"] == 0
            assert result["worst"] < 1e-6


# --------------------------------------------------------------------------- torchrun end to end


def length_reward(prompts, completions, **_):
    """Varies within a group even for an untrained model, so the weights really move."""
    return [len(c) / 16 for c in completions]


TINY = ["--model.tiny.hidden_size=32", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
        "--model.tiny.intermediate_size=64", "--prompts_per_step=4", "--num_generations=4",
        "--max_completion_length=12", "--num_rl_questions=200", "--num_eval_questions=4", "--eval.k=2",
        "--grpo.save_steps=2", "--grpo.warmup_steps=1", "--grpo.learning_rate=1e-3", "--eval.before=false",
        "--distributed.timeout_s=120", "--quiet"]


def run_env() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, here]), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def torchrun(nproc: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
            str(free_port()), "-m", "grpokit", *args]


def config_file(tmp_path) -> str:
    path = tmp_path / "run.yaml"
    path.write_text("rewards:\n  - name: test_distributed:length_reward\n")
    return str(path)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def sigkill_after_rows(command: list[str], metrics, rows: int, log) -> None:
    """Start `command` and SIGKILL it, torchrun and every worker at once, as soon as `metrics` holds
    `rows` rows: a crash with no chance to clean up."""
    import signal
    import time

    proc = subprocess.Popen(command, env=run_env(), stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 900
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    for pid in [proc.pid, *descendants(proc.pid)]:  # the workers are in their own sessions:
        os.kill(pid, signal.SIGKILL)                 # killpg would miss them
    proc.wait(timeout=60)


@pytest.mark.slow
def test_torchrun_two_processes_train_then_sigkill_and_resume_exactly(tmp_path):
    """`torchrun --nproc_per_node=2 -m grpokit train CONFIG` on CPU (gloo): a 4-step run, and the
    same run killed with SIGKILL after step 3 (checkpoint step-2 on disk) and resumed, end with
    the same weights and the same metrics rows but the timings."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpokit.run.metrics import read_metrics

    config = config_file(tmp_path)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = subprocess.run(torchrun(2, "train", config, f"--output_dir={straight}", "--grpo.max_steps=4", *TINY),
                          env=run_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    step4 = straight / "checkpoints" / "step-4"
    assert saved_world_size(step4) == 2 and (step4 / "trainer_state.rank1.pt").is_file()
    AutoModelForCausalLM.from_pretrained(step4)  # one Hugging Face checkpoint, gathered from the shards
    rows = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # rank 0 alone writes
    assert any(r["grad_norm"] > 0 for r in rows) and "greedy accuracy" in done.stdout

    metrics = killed / "metrics.jsonl"
    sigkill_after_rows(torchrun(2, "train", config, f"--output_dir={killed}", "--grpo.max_steps=4", *TINY),
                       metrics, 3, tmp_path / "killed.log")
    assert not (killed / "checkpoints" / "step-4").exists()

    resumed = subprocess.run(torchrun(2, "train", str(killed / "config.yaml"), "--resume"), env=run_env(),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    a, b = load_file(step4 / "model.safetensors"), load_file(killed / "checkpoints" / "step-4" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6)
    assert comparable(read_metrics(metrics)) == comparable(rows)

    # One process cannot resume what two wrote: a clear refusal that says what to do.
    one = subprocess.run([sys.executable, "-m", "grpokit", "train", str(straight / "config.yaml"), "--resume",
                          "--grpo.max_steps=5"], env=run_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 1
    assert "written by 2 processes and this run has 1" in one.stderr and "--nproc_per_node=2" in one.stderr
    assert "--model.name_or_path=" in one.stderr


@pytest.mark.slow
def test_bench_memory_measures_full_and_lora_on_one_and_two_processes(tmp_path):
    """The measured memory table: 4 setups, each a real run (2 processes: torchrun, FSDP2, and a
    LoRA policy sampling through the sharded model)."""
    import json

    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, "-m", "grpokit", "bench", "memory", "--measure", "--table=setups", "--hidden-size=32",
                           "--num-layers=2", "--num-heads=2", "--intermediate-size=64", "--lora-r=4", "--steps=1",
                           "--max-completion-length=8", "--json", str(out)],
                          env=run_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["setup"], r["processes"]) for r in rows] == [("full", 1), ("full", 2), ("LoRA r=4", 1),
                                                            ("LoRA r=4", 2)]
    assert all(r["peak_bytes"] > 0 for r in rows)
    assert "| LoRA r=4 | 2 |" in done.stdout and "vs full, 1 process" in done.stdout


@pytest.mark.slow
def test_when_one_process_dies_the_other_stops_with_a_message_and_no_half_checkpoint(tmp_path):
    import signal
    import time

    config, run = config_file(tmp_path), tmp_path / "run"
    log = tmp_path / "log.txt"
    proc = subprocess.Popen(torchrun(2, "train", config, f"--output_dir={run}", "--grpo.max_steps=500", *TINY),
                            env=run_env(), stdout=subprocess.DEVNULL, stderr=log.open("w"))
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):  # step-2 saved
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    workers = descendants(proc.pid)
    rank1 = [p for p in workers if b"LOCAL_RANK=1\0" in open(f"/proc/{p}/environ", "rb").read()]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    proc.wait(timeout=180)  # well within distributed.timeout_s: the survivor does not hang
    assert proc.returncode != 0
    assert "grpokit: process 0 of 2 stopped" in log.read_text()
    checkpoints = run / "checkpoints"
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]  # no temp directory left
    from grpokit.run.checkpoint import verify_checkpoint

    for step in checkpoints.glob("step-*"):
        assert verify_checkpoint(step) == []


def test_torchrun_refuses_a_batch_the_world_size_does_not_split_before_any_model_loads(tmp_path):
    done = subprocess.run(torchrun(2, "train", f"--output_dir={tmp_path / 'run'}", "--prompts_per_step=3", "--quiet"),
                          env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "grpo.prompts_per_step=3 does not split into whole groups over 2 processes" in done.stderr
    assert "parameters" not in done.stdout  # no model was loaded
    assert not (tmp_path / "run").exists()


def test_torchrun_trains_with_tool_rollouts_and_mixed_prompt_modes(tmp_path):
    """`torchrun --nproc_per_node=2 -m grpokit train` with rollout.tool and CoT + TIR prompts: each
    process samples its own questions through the tool, and the per-mode numbers are the whole
    batch's (summed over processes, the same keys on both even when one holds a single mode)."""
    import json

    run = tmp_path / "run"
    done = subprocess.run(torchrun(2, "train", config_file(tmp_path), f"--output_dir={run}", "--grpo.max_steps=2",
                                   "--rollout.tool=python", "--task.prompt_modes={cot: 0.5, tir: 0.5}", *TINY),
                          env=run_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mode/cot/samples"] + r["mode/tir/samples"] == 16  # 4 questions x 4 samples, both processes
        assert "tool/calls_mean" in r and "tool/stop_answer_frac" in r


def _torchrun_demo_args(seed0_demo) -> list[str]:
    return ["train", f"--model.name_or_path={seed0_demo / 'checkpoints' / 'sft'}", "--grpo.save_steps=50", "--quiet"]


@pytest.fixture(scope="module")
def torchrun_demo(seed0_demo, tmp_path_factory):
    """The demo's RL stage on 2 processes: `torchrun --nproc_per_node=2 -m grpokit train` from the seed-0
    demo's pi_SFT, 150 steps."""
    straight = tmp_path_factory.mktemp("torchrun-demo") / "straight"
    done = subprocess.run(torchrun(2, *_torchrun_demo_args(seed0_demo), f"--output_dir={straight}"), env=run_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return straight


@pytest.mark.slow
def test_torchrun_grpo_from_the_demo_pi_sft_learns(torchrun_demo):
    """It lifts held-out greedy accuracy by >= 15 points."""
    import json

    summary = json.loads((torchrun_demo / "summary.json").read_text())
    print(f"2 processes: held-out greedy {summary['sft_accuracy']:.1%} -> {summary['grpo_accuracy']:.1%} "
          f"in {summary['wall_seconds']:.0f}s")
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary


@pytest.mark.slow
@pytest.mark.long  # two more demo RL stages; test_torchrun_two_processes_train_then_sigkill_and_resume_exactly in CI
def test_torchrun_demo_resumes_exactly_after_sigkill(torchrun_demo, seed0_demo, tmp_path):
    """The same run killed with SIGKILL after step 70 (checkpoint step-50 on disk) and resumed writes the
    same metrics rows, timings aside, and ends with the same weights."""
    from safetensors.torch import load_file

    from grpokit.run.metrics import read_metrics

    killed = tmp_path / "killed"
    metrics = killed / "metrics.jsonl"
    sigkill_after_rows(torchrun(2, *_torchrun_demo_args(seed0_demo), f"--output_dir={killed}"), metrics, 70,
                       tmp_path / "killed.log")
    assert (killed / "checkpoints" / "step-50").is_dir() and not (killed / "checkpoints" / "step-150").exists()
    resumed = subprocess.run(torchrun(2, "train", str(killed / "config.yaml"), "--resume"), env=run_env(),
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step-50" in resumed.stderr
    assert comparable(read_metrics(metrics)) == comparable(read_metrics(torchrun_demo / "metrics.jsonl"))
    a = load_file(torchrun_demo / "checkpoints" / "step-150" / "model.safetensors")
    b = load_file(killed / "checkpoints" / "step-150" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- how a launched process ends

LAUNCHED = {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}  # what distributed.launched() reads


def _launched_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONFAULTHANDLER",)} | LAUNCHED
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_a_launched_process_leaves_with_its_code_its_atexit_handlers_run_and_its_output_flushed():
    """distributed.leave skips the interpreter's teardown (where gloo can abort a finished run), not the
    atexit handlers that stop worker pools, nor output still in a buffer."""
    proc = _launched_python(
        "import atexit, sys\n"
        "from grpokit import distributed\n"
        "atexit.register(lambda: print('pool stopped', flush=True))\n"
        "sys.stdout.write('buffered line\\n')\n"  # a pipe: block-buffered, not yet written
        "distributed.leave(3)\n"
        "print('never')\n")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["buffered line", "pool stopped"]


def test_a_launched_process_that_aborts_prints_the_python_stack_of_the_call_that_aborted():
    """torchrun reports a rank's SIGABRT as a signal number; grpokit's processes print where it came from."""
    proc = _launched_python(
        "import os\n"
        "from grpokit import distributed\n"
        "distributed.report_crashes()\n"
        "def the_call_that_aborts():\n"
        "    os.abort()\n"
        "the_call_that_aborts()\n")
    assert proc.returncode == -6
    assert "Fatal Python error: Aborted" in proc.stderr and "the_call_that_aborts" in proc.stderr, proc.stderr


def test_exit_process_leaves_a_launched_process_and_exits_any_other():
    launched = _launched_python("from grpokit import distributed\ndistributed.exit_process(3)\n")
    assert launched.returncode == 3, launched.stderr
    with pytest.raises(SystemExit) as ended:
        distributed.exit_process(4)  # this test's process: torchrun did not launch it
    assert ended.value.code == 4


def test_every_entry_point_that_joins_a_process_group_ends_through_exit_process():
    """A `python -m` module torchrun can launch (it calls distributed.init) must end through
    distributed.exit_process: `grpokit bench memory`'s probe ended with SystemExit and aborted in gloo's
    teardown ("terminate called without an active exception") in CI's slow tier."""
    src = Path(distributed.__file__).resolve().parent
    entry_points = [path for path in sorted(src.rglob("*.py"))
                    if path.name == "__main__.py" or 'if __name__ == "__main__":' in path.read_text()]
    joins = [path for path in entry_points if path.name == "__main__.py" or "distributed.init(" in path.read_text()]
    assert {path.relative_to(src).as_posix() for path in joins} >= {"__main__.py", "bench/memory_probe.py"}
    for path in joins:
        text = path.read_text()
        main_block = text[text.index('if __name__ == "__main__":'):] if path.name != "__main__.py" else text
        assert "distributed.exit_process(" in main_block, f"{path.relative_to(src)} ends without distributed.exit_process"
