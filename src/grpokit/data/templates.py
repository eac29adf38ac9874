"""Prompt templates: DeepSeekMath's chain-of-thought (cot) and tool-integrated (tir)
instructions after the question, wrapped in the tokenizer's chat template when it has one, else
laid out as plain text. Training, in-run evaluation and `grpokit eval` all render through
`render_prompt`, so the same settings give the same prompt everywhere."""

from __future__ import annotations

from grpokit.data.files import DatasetError

# A conversational row's messages, beside its rendered "prompt": what reward functions receive as prompts.
MESSAGES = "prompt_messages"

# DeepSeekMath's chain-of-thought and tool-integrated instructions (paper, sec. 2.3 / 4.1, Table 5).
COT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TIR_INSTRUCTION = (
    "Please integrate natural language reasoning with programs to solve the problem above, "
    "and put your final answer within \\boxed{}."
)

TEMPLATES = {
    "cot": "{question}\n" + COT_INSTRUCTION,
    "tir": "{question}\n" + TIR_INSTRUCTION,
    "none": "{question}",
}
# Plain-text layouts for a tokenizer without a chat template: the user turn and a newline
# (training's default), or DeepSeekMath's chat layout (`grpokit eval`'s default for a model
# that comes without a run's settings).
PLAIN_LAYOUTS = {"bare": "{prompt}\n", "user-assistant": "User: {prompt}\n\nAssistant:"}


def instruction_text(question: str, template: str) -> str:
    """The user turn: a named template ("cot", "tir", "none") or a custom one containing {question}."""
    pattern = TEMPLATES.get(template, template)
    if "{question}" not in pattern:
        raise ValueError(f"data.template must be one of {sorted(TEMPLATES)} or contain '{{question}}', got {template!r}")
    return pattern.replace("{question}", question.strip())


def plain_text(user: str, layout: str = "bare", system_prompt: str = "") -> str:
    """The user turn laid out as plain text (PLAIN_LAYOUTS), after the system message if any."""
    if layout not in PLAIN_LAYOUTS:
        raise ValueError(f"data.plain_layout must be one of {sorted(PLAIN_LAYOUTS)}, got {layout!r}")
    prompt = user.strip() if layout == "user-assistant" else user
    return (system_prompt + "\n\n" if system_prompt else "") + PLAIN_LAYOUTS[layout].replace("{prompt}", prompt)


def render_prompt(question: str, tokenizer, template: str = "cot", chat_template: str = "auto",
                  system_prompt: str = "", plain_layout: str = "bare") -> str:
    """The text the policy continues.

    chat_template "auto" uses the tokenizer's chat template when it has one; "on" requires
    one; "off" gives plain text in `plain_layout`. The result already holds any special
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
    text = plain_text(user, plain_layout, system_prompt)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and adds_bos(tokenizer) and not text.startswith(bos):
        text = bos + text  # what the tokenizer would have added itself
    return text


def adds_bos(tokenizer) -> bool:
    """Whether encoding with special tokens puts BOS first: through add_bos_token, or through the
    tokenizer.json's post-processor alone (Gemma's and Llama 3's, whose add_bos_token may be unset)."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos_id and tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [bos_id]


def render_messages(messages: list[dict], tokenizer, where: str) -> str:
    """A conversational prompt (TRL's list of {"role", "content"} messages) as the policy reads it:
    the tokenizer's chat template with the generation prompt, nothing added (as TRL renders it)."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DatasetError(
            f"{where}: its prompt is a list of messages, which needs a chat template, and the tokenizer of "
            f"{name!r} has none: give one with data.chat_template_file=TEMPLATE.jinja, or give the prompt as text "
            "(laid out by data.template and data.plain_layout)")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja2's TemplateError: a role or an order the template refuses
        roles = ", ".join(str(m.get("role")) for m in messages)
        raise DatasetError(f"{where}: field 'prompt' (roles {roles}): the chat template of "
                                f"{getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'} rejects it "
                                f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                                "give roles it accepts (system, user, assistant)") from None


def last_user_text(messages: list[dict]) -> str:
    """The question of a conversational prompt: its last user message (else its last message)."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return (users or [messages[-1]["content"]])[-1]
