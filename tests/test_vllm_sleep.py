"""The vLLM engine's CUDA-only memory paths, on any machine: a fake `vllm.LLM` records the calls."""

import pytest
import torch

from grpokit.rollout.vllm import VLLMEngine, sleep_level


class RecordingLLM:
    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


@pytest.fixture
def calls(monkeypatch):
    recorded = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: recorded.append(("empty_cache",)))
    return recorded


def _sleeping_engine(calls) -> VLLMEngine:
    """A VLLMEngine as on CUDA with enable_sleep_mode, without starting vLLM."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.sleep_enabled = RecordingLLM(calls), True
    engine._asleep, engine._weights_discarded = set(), False
    return engine


def test_sleep_level_is_2_only_when_new_weights_come_next():
    assert sleep_level(weights_pushed_next=True) == 2
    assert sleep_level(weights_pushed_next=False) == 1


def test_release_before_a_push_discards_the_weights_and_the_cache_is_emptied_before_waking(calls):
    engine = _sleeping_engine(calls)
    engine.release_memory(weights_pushed_next=True)
    engine.release_memory(weights_pushed_next=True)  # already asleep: nothing more
    assert calls == [("sleep", 2)]
    engine._wake(("weights",))  # what sync_weights does before it pushes
    assert calls[1:] == [("empty_cache",), ("wake_up", ("weights",))]
    engine._weights_discarded = False  # the push landed
    engine._wake(("weights", "kv_cache"))  # what generate does
    assert calls[3:] == [("empty_cache",), ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]


def test_generate_after_a_level_2_sleep_without_a_push_is_refused(calls):
    engine = _sleeping_engine(calls)
    engine.release_memory(weights_pushed_next=True)
    with pytest.raises(RuntimeError, match="level-2 sleep discarded the engine's weights"):
        engine._wake(("weights", "kv_cache"))


def test_release_without_a_push_keeps_the_weights(calls):
    engine = _sleeping_engine(calls)
    engine.release_memory(weights_pushed_next=False)
    engine._wake(("weights", "kv_cache"))
    assert calls == [("sleep", 1), ("empty_cache",), ("wake_up", ("weights", "kv_cache")), ("reset_prefix_cache",)]


def test_without_sleep_mode_release_does_nothing(calls):
    engine = _sleeping_engine(calls)
    engine.sleep_enabled = False
    engine.release_memory(weights_pushed_next=True)
    engine._wake(("weights", "kv_cache"))
    assert calls == []
