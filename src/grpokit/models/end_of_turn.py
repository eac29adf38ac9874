"""EOS from the chat template: the token that ends an assistant's turn ends a completion.

With a chat template the policy is prompted as an assistant and ends its reply the way the
template ends a turn (ChatML: <|im_end|>). A tokenizer's own eos_token may be another token (a base
model's <|endoftext|>), which the policy never writes after a reply: sampling would run to the
length limit and SFT would teach the wrong ending. So the end-of-turn token becomes the tokenizer's
EOS and the first of generation_config's EOS ids; the ids named before stay EOS too.
"""

from __future__ import annotations

from grpokit.errors import ConfigError

EOS_KEY = "model.eos_token"
# A reply no template changes, so what follows it in the rendered text is the template's end of turn.
PROBE_REPLY = "grpokit-probe-reply"
PROBE_MESSAGES = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": PROBE_REPLY}]


class NoEndOfTurnToken(ConfigError):
    """A chat template whose assistant turn ends with no single token that can be EOS."""

    key = EOS_KEY


def single_token_id(tokenizer, token: str) -> int | None:
    """The id of `token` when the tokenizer writes it as exactly one token, else None."""
    ids = tokenizer(token, add_special_tokens=False)["input_ids"] if token else []
    return ids[0] if len(ids) == 1 else None


def end_of_turn_token(tokenizer) -> str | None:
    """The added token the chat template writes right after an assistant's reply (whitespace
    between them allowed), or None: no chat template, a template that cannot render a plain
    user/assistant exchange, or one that ends a turn with text that is not a single added token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(PROBE_MESSAGES, tokenize=False)
    except Exception:  # a template may raise on any conversation it does not expect (jinja's own errors)
        return None
    if not isinstance(text, str) or PROBE_REPLY not in text:
        return None
    after = text[text.rindex(PROBE_REPLY) + len(PROBE_REPLY):].lstrip()
    candidates = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)  # the longest match wins
    token = next((t for t in candidates if t.strip() and after.startswith(t)), None)
    return token if token is not None and single_token_id(tokenizer, token) is not None else None


def use_end_of_turn_eos(model, tokenizer, name: str, eos_token: str = "", chat_template: str = "auto") -> None:
    """Make the token that ends a completion the tokenizer's EOS and generation_config's first EOS id:
    `eos_token` (model.eos_token) when set; else, when prompts use the chat template (`chat_template`
    is not "off" and the tokenizer has one), the template's end-of-turn token, a NoEndOfTurnToken
    naming model.eos_token when there is none; else the tokenizer's EOS as it is. `chat_template` "on"
    for a tokenizer without a template is a ConfigError naming data.chat_template."""
    if chat_template == "on" and not getattr(tokenizer, "chat_template", None):  # before any prompt is rendered
        raise ConfigError(f"data.chat_template=on but the tokenizer of {name} has no chat template: set "
                          "data.chat_template=auto (plain text for a tokenizer without one) or off")
    if eos_token:
        if single_token_id(tokenizer, eos_token) is None:
            raise ConfigError(f"{EOS_KEY}={eos_token!r} is not a single token of {name}'s tokenizer: set it to a "
                              "special token the tokenizer has (e.g. the one its chat template ends a turn with)")
        token = eos_token
    elif chat_template != "off" and getattr(tokenizer, "chat_template", None):
        token = end_of_turn_token(tokenizer)
        if token is None:
            raise NoEndOfTurnToken(
                f"the chat template of {name} ends an assistant's turn with no single token that can end a "
                f"completion (EOS): set {EOS_KEY} to the token that ends a reply (e.g. --{EOS_KEY}='<|im_end|>'), "
                "or data.chat_template=off to prompt without the template")
    else:
        return
    tokenizer.eos_token = token
    token_id = single_token_id(tokenizer, token)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        named = generation.eos_token_id
        named = [] if named is None else [named] if isinstance(named, int) else list(named)
        ids = [token_id] + [i for i in named if i != token_id]
        generation.eos_token_id = ids[0] if len(ids) == 1 else ids  # one id stays an int, as checkpoints save it
