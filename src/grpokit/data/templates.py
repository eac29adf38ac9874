"""Prompt templates: the DeepSeekMath chain-of-thought instruction, wrapped in the tokenizer's
chat template when it has one, plain text otherwise."""

from __future__ import annotations

# DeepSeekMath's chain-of-thought instruction (paper, sec. 2.3 / 4.1).
COT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

TEMPLATES = {
    "cot": "{question}\n" + COT_INSTRUCTION,
    "none": "{question}",
}


def instruction_text(question: str, template: str) -> str:
    """The user turn: a named template ("cot", "none") or a custom one containing {question}."""
    pattern = TEMPLATES.get(template, template)
    if "{question}" not in pattern:
        raise ValueError(f"data.template must be one of {sorted(TEMPLATES)} or contain '{{question}}', got {template!r}")
    return pattern.replace("{question}", question.strip())


def render_prompt(question: str, tokenizer, template: str = "cot", chat_template: str = "auto",
                  system_prompt: str = "") -> str:
    """The text the policy continues.

    chat_template "auto" uses the tokenizer's chat template when it has one; "on" requires
    one; "off" gives plain text ending in a newline. The result already holds any special
    tokens (BOS, role markers), so it is tokenized with add_special_tokens=False.
    """
    user = instruction_text(question, template)
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has_chat:
        raise ValueError("data.chat_template='on' but the tokenizer has no chat template; use 'auto' or 'off'")
    if chat_template != "off" and has_chat:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = (system_prompt + "\n\n" if system_prompt else "") + user + "\n"
    bos = getattr(tokenizer, "bos_token", None)
    if bos and getattr(tokenizer, "add_bos_token", False) and not text.startswith(bos):
        text = bos + text  # what the tokenizer would have added itself
    return text
