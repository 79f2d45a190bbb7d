"""Prompt templates: the text the model sees for a question (chat template, plain base-model form, or
as is) and the instruction that asks for a checkable final answer."""

from __future__ import annotations

import dataclasses
from typing import Any

from ict_jax.data.datasets import Dataset
from ict_jax.model.tokenizers import QWEN2P5_CHAT_TEMPLATE, HFTokenizer, render_chat_template

TEMPLATES = ("qwen_chat", "plain", "none")
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MC_INSTRUCTION = "Please reason step by step, and put the letter of the correct option within \\boxed{}."


def format_prompt(question: str, template: str = "qwen_chat", tokenizer: Any = None, *,
                  instruction: str = BOXED_INSTRUCTION) -> str:
    """The text the model sees.

    ``qwen_chat``: one user turn ``"{question}\\n{instruction}"`` through the tokenizer's chat template
    (Qwen2.5's ``QWEN2P5_CHAT_TEMPLATE`` when the tokenizer has none, or no tokenizer is given), with
    the generation prompt. ``plain`` (base models): ``"Question: {question}\\n{instruction}\\nAnswer:"``.
    ``none``: the question as is. An empty ``instruction`` adds none (the question alone, no blank line).
    """
    if template == "none":
        return question
    asked = f"{question}\n{instruction}" if instruction else question
    if template == "plain":
        return f"Question: {asked}\nAnswer:"
    if template == "qwen_chat":
        messages = [{"role": "user", "content": asked}]
        if tokenizer is None or isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is None:
            return render_chat_template(QWEN2P5_CHAT_TEMPLATE, messages)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")


def instruction_for(scorer: str | None) -> str:
    """The instruction a data set's prompts get: ``MC_INSTRUCTION`` for multiple choice (``scorer`` ``mc``),
    else ``BOXED_INSTRUCTION``."""
    return MC_INSTRUCTION if scorer == "mc" else BOXED_INSTRUCTION


def template_mismatch(tokenizer: Any, template: str) -> str | None:
    """Why ``template`` does not fit ``tokenizer``, or None when it does (or cannot be told). The one case
    that can be told from the tokenizer alone: ``qwen_chat`` with a tokenizer that has no chat template of
    its own and no ``<|im_start|>`` token (a base model's, or a tokenizer from another family): the Qwen2.5
    ChatML fallback would spell its markers out of ordinary tokens, text the model never saw."""
    if template != "qwen_chat" or not isinstance(tokenizer, HFTokenizer) or tokenizer.chat_template is not None:
        return None
    if tokenizer.token_to_id("<|im_start|>") is not None:
        return None
    return ("the tokenizer has no chat template and no <|im_start|> token, so template qwen_chat writes Qwen's "
            "ChatML markers as ordinary text the model never saw (a base model? use template plain or none)")


def template_dataset(dataset: Any, tokenizer: Any, template: str = "qwen_chat") -> Any:
    """A copy of ``dataset`` (a :class:`~ict_jax.data.datasets.Dataset`) whose prompts are the full templated texts,
    with the instruction that fits its scorer (``MC_INSTRUCTION`` for multiple choice, else
    ``BOXED_INSTRUCTION``, as :func:`ict_jax.data.prompts.encode_prompts` does). Use with a generator built with
    ``template="none"`` when benchmarks of several kinds share one generator (``ict-jax eval``)."""
    instruction = instruction_for(dataset.scorer)
    examples = [dataclasses.replace(ex, prompt=format_prompt(ex.prompt, template, tokenizer, instruction=instruction))
                for ex in dataset]
    return Dataset(dataset.name, examples, dataset.scorer, dataset.split)

