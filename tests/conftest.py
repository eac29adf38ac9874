"""Shared fixtures: a real tiny transformers model and a real char tokenizer, built here."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from grpokit.data import arithmetic
from grpokit.models import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer(arithmetic.ALPHABET)


@pytest.fixture
def tiny_model(tokenizer):
    torch.manual_seed(0)
    return build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)


@pytest.fixture(scope="session")
def chain_rows():
    task = arithmetic.ChainTask()
    return arithmetic.make_rows(arithmetic.sample_questions(64, 0, task, "train"))
