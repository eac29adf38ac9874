"""The demo's tiny causal LM: a real transformers architecture, randomly initialised,
with a character-level tokenizer built with `tokenizers`. Both save and load with
`AutoModelForCausalLM` / `AutoTokenizer` like any hub checkpoint.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet`, plus <pad>, <eos> and <unk>."""
    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK] + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join with no separator
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    architecture: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 2048,
    seed: int = 0,
):
    """A randomly initialised Llama or Qwen2 causal LM sized for a laptop CPU."""
    import torch

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    if architecture == "llama":
        config = LlamaConfig(**common)
    elif architecture == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(f"tiny model architecture must be 'llama' or 'qwen2', got {architecture!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model
