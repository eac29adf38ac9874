"""`hf_static`: transformers' `generate` on the live policy, with a static KV cache whose decode
step is compiled (torch.compile, mode "reduce-overhead": CUDA graphs).

Why: a small model decoding a batch through `generate`'s dynamic cache spends most of each step
launching kernels (about ten per layer per token). With a static cache every decode step has the
same shapes, so torch.compile captures it once and replays it as one CUDA graph per step.

How it stays compiled across a run:
- Shapes: a batch of n rows is padded (with copies of its last row, dropped afterwards) to a
  bucket of rows (a power of two, at most the call's batch size), and the cache holds a bucket of
  positions (a power of two covering the longest prompt + max_new_tokens) that only grows. Each
  (rows, positions) bucket has one StaticCache, allocated once and reset in place before each use:
  its tensors keep their addresses, so the CUDA graphs recorded for it replay without re-recording.
- Weights: the compiled forward reads the policy's parameters where they lie. The optimizer
  (torch.optim.AdamW) updates them in place and LoRA adapters are never merged into the base
  (models/lora.py), so an update changes values, not tensors: no recompilation, no weight sync.
- Counting: compilations (torch._dynamo's frame counter) during sampling are reported after each
  batch as rollout/compiles, and those beyond one per newly seen bucket as rollout/recompiles, which
  stays 0 in a healthy run (tests/test_hf_static.py checks it across optimizer steps).

Log-probs: each sampled token's log-prob under the distribution it was drawn from (temperature
and top_p applied by transformers' own warpers, then log_softmax), as vLLM's processed log-probs,
so the loss's off-policy correction and the rollout/logp_mismatch metric work as with vLLM. They
are recorded one step at a time (a logits processor), never as [steps, rows, vocabulary] scores.

Where it does not compile: on CPU (no CUDA graphs; inductor's CPU code gains little on decode) and
for a sharded (FSDP2) policy, it samples with plain `generate` and says so once; it still reports
log-probs. A compile that fails falls back to plain `generate` for the rest of the run with one
warning. Multi-turn tool rollouts go through `continue_ids`, as with `hf`.

transformers' continuous batching (`generate_batch`, paged attention) is the other way to fast
decoding; it is not used here: it is no CPU path, and while its manager runs it switches the shared
model config to paged attention, which breaks the training forward beside it (docs/guides/fast-generation.md).
"""

from __future__ import annotations

import copy
import importlib.metadata
import sys
import warnings

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from grpokit.models.wrapping import is_sharded
from grpokit.rollout.registry import register_engine
from grpokit.rollout.sampler import (Continuation, SamplingParams, cache_argument, continue_ids,
                                    note_ignored_sampling_defaults, sample_groups)
from grpokit.types import Rollout
from grpokit.models.device import model_device

ENGINE = "hf_static"
# The oldest transformers whose generate takes a user StaticCache, CompileConfig and disable_compile
# as used here (pyproject.toml's lower bound, tested by `make test-oldest`).
MIN_TRANSFORMERS = (5, 17)
ROW_BUCKET_MIN = 8  # fewer rows are padded to 8: one graph serves every small batch
POSITION_STEP = 256  # cache lengths are multiples of it: a few more compiles, far less attention over empty slots
# Compiled shapes one decode function may hold before torch._dynamo stops compiling it: every
# (rows, positions) bucket is one; dynamo's default (8) is too few for a run's buckets.
RECOMPILE_LIMIT = 64

_said: set[str] = set()  # notes and warnings given once per process


def _say_once(key: str, message: str, warning: bool = False) -> None:
    if key in _said:
        return
    _said.add(key)
    if warning:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    else:
        print(f"grpokit: {message}", file=sys.stderr)


def transformers_problem() -> str | None:
    """Why the installed transformers cannot run this engine, naming the key and the version needed; or None."""
    installed = importlib.metadata.version("transformers")
    numbers = tuple(int(part) for part in installed.split(".")[:2] if part.isdigit())
    needed = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        from transformers import CompileConfig, StaticCache  # noqa: F401
    except ImportError:
        numbers = (0,)
    if numbers < MIN_TRANSFORMERS:
        return (f"rollout.engine={ENGINE} needs transformers>={needed} (its static cache and compile options); "
                f"transformers {installed} is installed: `pip install -U 'transformers>={needed}'`, or use "
                f"rollout.engine=hf")
    return None


def _check_config(rollout_config):
    problem = transformers_problem()
    if problem:
        yield problem


def _bucket(n: int, least: int, most: int | None = None) -> int:
    """The smallest power of two >= n and >= least, capped at `most` (never below n)."""
    size = max(least, 1 << max(0, n - 1).bit_length())
    return max(n, min(size, most)) if most else size


def _compile_counter() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


class SampledLogprobs(LogitsProcessor):
    """Last in `generate`'s processor list: it sees the scores the next token is drawn from and keeps
    their log_softmax until the next call, whose input_ids end with the token drawn; `finish` takes
    the last one's from the returned ids."""

    def __init__(self):
        self.previous: torch.Tensor | None = None
        self.logps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.logps.append(self.previous.gather(1, input_ids[:, -1:]))
        # x - logsumexp(x), as the trainer computes log-probs (models/logprobs.py): torch.log_softmax's CPU
        # kernel was measured 5e-4 off float64 over Qwen3's 151,936 logits, where logsumexp is within 2e-6.
        scores = scores.float()
        self.previous = scores - torch.logsumexp(scores, dim=-1, keepdim=True)
        return scores

    def finish(self, new_ids: torch.Tensor) -> torch.Tensor:
        """[n, T] log-probs of the T new ids (a row's ids after its EOS are padding: their values mean nothing)."""
        done = len(self.logps)
        if self.previous is not None and done < new_ids.shape[1]:
            self.logps.append(self.previous.gather(1, new_ids[:, done : done + 1]))
        self.previous = None
        if not self.logps:
            return torch.zeros(new_ids.shape, dtype=torch.float32, device=new_ids.device)
        return torch.cat(self.logps, dim=1)[:, : new_ids.shape[1]]


def _with_own_warpers(gen_config: GenerationConfig) -> tuple[GenerationConfig, list[LogitsProcessor]]:
    """(`gen_config` without temperature and top_p, those two as transformers' own warpers in its own order).
    generate puts a caller's processors before its warpers; passing the warpers ourselves, followed
    by SampledLogprobs, lets the recorder see exactly the scores sampling draws from."""
    config = copy.deepcopy(gen_config)
    warpers: list[LogitsProcessor] = []
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(config.temperature))
        if config.top_p is not None and config.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    config.temperature, config.top_p = None, None
    return config, warpers


class StaticCacheDecoder:
    """The `decode` of sample_ids (rollout/sampler.py): generate with a static cache, compiled, or plain
    generate where that cannot run; every path reports the sampled tokens' log-probs.

    static: None = where it compiles (CUDA), True = always (tests run it on CPU), False = never.
    compile: None = with the static cache where `generate` compiles (CUDA), True = on any device
        (CPU: inductor, slow to build), False = the static cache uncompiled.
    backend: torch.compile's backend (tests pass "eager" to exercise dynamo's guards quickly)."""

    def __init__(self, static: bool | None = None, compile: bool | None = None, backend="inductor",
                 mode: str | None = "reduce-overhead"):
        self.static, self.compile, self.backend, self.mode = static, compile, backend, mode
        self.failed: str | None = None  # why compiled decoding was given up, if it was
        self._caches: dict[tuple[int, int], object] = {}
        self._positions = 0  # the cache length in use; it only grows
        self._seen: set[tuple[int, int]] = set()
        self.compiles = 0  # since the last report
        self.recompiles = 0
        self.compiles_total = 0

    def path(self, model: torch.nn.Module) -> str:
        """"compiled", "static" (uncompiled static cache) or "plain" for `model` now."""
        device = model_device(model)
        static = self.static if self.static is not None else device.type == "cuda"
        if self.failed or not static or is_sharded(model):
            return "plain"
        compiles = self.compile if self.compile is not None else device.type == "cuda"
        return "compiled" if compiles else "static"

    def note_path(self, model: torch.nn.Module) -> None:
        """Say once why sampling runs plain generate, where it does."""
        if self.failed:
            return
        if is_sharded(model) and self.static is not False:
            _say_once("sharded", f"rollout.engine={ENGINE}: a sharded (FSDP2) policy samples with plain generate "
                                 "(its gathered weights are not the tensors a compiled graph would keep)")
        elif self.path(model) == "plain" and self.static is None:
            _say_once("cpu", f"rollout.engine={ENGINE}: on {model_device(model).type} it samples with "
                             "plain generate (the static cache and its compiled decode step are for CUDA); the "
                             "sampler's log-probs are still reported")

    def __call__(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, gen_config: GenerationConfig,
                 batch_size: int | None = None, **generate_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """(new ids [n, T], their log-probs [n, T]) of the left-padded ids [n, P]; `batch_size` (the
        call's rows per generate) caps the row bucket."""
        path = self.path(model)
        if path != "plain":
            try:
                return self._static(model, ids, mask, gen_config, path == "compiled", batch_size, generate_kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # a failed compile: plain generate for the rest of the run, said once
                if path != "compiled":
                    raise
                self.failed = _one_line(err)
                self._caches.clear()
                _say_once("compile-failed", f"rollout.engine={ENGINE}: compiling the decode step failed "
                                            f"({self.failed}); sampling with plain generate for the rest of the "
                                            "run", warning=True)
        return self._generate(model, ids, mask, gen_config, generate_kwargs)

    def _generate(self, model, ids, mask, gen_config, generate_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        config, warpers = _with_own_warpers(gen_config)
        recorder = SampledLogprobs()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                             logits_processor=LogitsProcessorList([*warpers, recorder]), **generate_kwargs)
        new_ids = out[:, ids.shape[1] :]
        return new_ids, recorder.finish(new_ids)

    def _static(self, model, ids, mask, gen_config, compiled: bool, batch_size: int | None, generate_kwargs):
        n, width = ids.shape
        rows = _bucket(n, ROW_BUCKET_MIN, batch_size)
        if rows > n:  # copies of the last row fill the bucket; their completions are dropped
            ids = torch.cat([ids, ids[-1:].expand(rows - n, -1)])
            mask = torch.cat([mask, mask[-1:].expand(rows - n, -1)])
        cache, shape = self._cache_for(model, rows, width + gen_config.max_new_tokens)
        config = copy.deepcopy(gen_config)
        if compiled:
            from transformers import CompileConfig

            compile_config = CompileConfig(fullgraph=False, dynamic=False, backend=self.backend, mode=self.mode)
            compile_config._compile_all_devices = True  # generate compiles off CUDA too (the tests' CPU runs)
            config.compile_config, config.disable_compile = compile_config, False
            _raise_recompile_limit()
        else:
            config.disable_compile = True
        before = _compile_counter()
        try:
            new_ids, logp = self._generate(model, ids, mask, config, {**generate_kwargs, cache_argument(model): cache})
        finally:
            compiled_now = _compile_counter() - before
            new_shape = compiled_now > 0 and shape not in self._seen
            self._seen.add(shape)
            self.compiles += compiled_now
            self.compiles_total += compiled_now
            self.recompiles += max(0, compiled_now - int(new_shape))
        return new_ids[:n], logp[:n]

    def _cache_for(self, model: torch.nn.Module, rows: int, positions: int):
        """The StaticCache of (rows, the cache length covering `positions`), reset; made once per bucket."""
        from transformers import StaticCache

        length = max(self._positions, -(-positions // POSITION_STEP) * POSITION_STEP)
        if length != self._positions:  # a longer cache: the shorter ones are not used again
            self._caches = {key: c for key, c in self._caches.items() if key[1] == length}
            self._positions = length
        key = (rows, length)
        if key not in self._caches:
            config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
            self._caches[key] = StaticCache(config=config, max_cache_len=length)
        cache = self._caches[key]
        cache.reset()
        return cache, key

    def report(self) -> dict[str, float]:
        """rollout/compiles and rollout/recompiles since the last report (then zeroed: the first step's
        include the evaluation before RL), and the run's total."""
        out = {"rollout/compiles": float(self.compiles), "rollout/recompiles": float(self.recompiles),
               "rollout/compiles_total": float(self.compiles_total)}
        self.compiles = self.recompiles = 0
        return out

    def release(self) -> None:
        self._caches.clear()
        self._positions = 0


def _one_line(err: BaseException) -> str:
    """`Type: first line` of an error, and of the error that caused it (a compiler's own) when there is one."""
    def line(e: BaseException) -> str:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"

    root = err
    while (getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = getattr(root, "inner_exception", None) or root.__cause__
    return line(err) if root is err else f"{line(err)} {line(root)}"


def _raise_recompile_limit() -> None:
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < RECOMPILE_LIMIT:
        setattr(config, name, RECOMPILE_LIMIT)


class StaticCacheEngine:
    """`hf` with a static KV cache and a compiled decode step (module docstring). Like HFEngine it
    samples from the policy object itself, so a sync only re-points it, and it draws from torch's
    global RNG (per-request seeds are ignored)."""

    copies_weights = False

    def __init__(self, model: torch.nn.Module, tokenizer, decoder: StaticCacheDecoder | None = None):
        self.model, self.tokenizer = model, tokenizer
        note_ignored_sampling_defaults(model)  # said once, however the engine is built
        self.decoder = decoder or StaticCacheDecoder()
        self._evaluation: StaticCacheEngine | None = None

    def for_evaluation(self) -> StaticCacheEngine:
        """The same policy through a decoder of its own: evaluation's batch shapes (other rows, longer
        prompts) never grow or replace the static caches, nor the compiled graphs, training's rollouts use."""
        if self._evaluation is None:
            d = self.decoder
            self._evaluation = StaticCacheEngine(self.model, self.tokenizer,
                                                 StaticCacheDecoder(d.static, d.compile, d.backend, d.mode))
        self._evaluation.model = self.model  # the policy as training last re-pointed it
        return self._evaluation

    def _decode(self, params: SamplingParams):
        self.decoder.note_path(self.model)

        def decode(model, ids, mask, gen_config, **kwargs):  # the call's batch size caps the row bucket
            return self.decoder(model, ids, mask, gen_config, batch_size=params.batch_size, **kwargs)
        # Plain generate continues from a shared prompt's cache; the static cache path fills its own.
        decode.takes_prefilled_cache = self.decoder.path(self.model) == "plain"
        return decode

    def generate(self, prompts, num_generations, params, rows=None, seeds=None) -> Rollout:
        return sample_groups(self.model, self.tokenizer, prompts, num_generations, params, rows,
                             decode=self._decode(params))

    def continue_ids(self, contexts: list[list[int]], budgets: list[int], params: SamplingParams,
                     seeds: list[int] | None = None) -> list[Continuation]:
        """One continuation of each token-id context (multi-turn rollouts, rollout/multi_turn.py)."""
        return continue_ids(self.model, self.tokenizer, contexts, budgets, params, decode=self._decode(params))

    def rollout_metrics(self) -> dict[str, float]:
        """Compilations since the last batch's report (the training loop logs them)."""
        return self.decoder.report()

    def sync_weights(self, model: torch.nn.Module, state_dict: dict | None = None) -> None:
        """The trainer's policy is the object sampled from; another object (another model) gets new caches."""
        if model is not self.model:
            self.decoder.release()
        self.model = model

    def release_memory(self, weights_pushed_next: bool) -> None:
        """The caches stay: new ones would have new addresses, and their CUDA graphs would be recorded again."""

    def close(self) -> None:
        self.decoder.release()
        if self._evaluation is not None:
            self._evaluation.close()


@register_engine(ENGINE, copies_weights=False, runs_in_worker=True, check=_check_config)
def _build(rollout_config, model, tokenizer, seed, model_len, weights_dir) -> StaticCacheEngine:
    return StaticCacheEngine(model, tokenizer)
