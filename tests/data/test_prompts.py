"""The one prompt front door (data.prompts.encode_prompt) and the one response decoder
(model.tokenizers.decode_response): hand-computed cases, and the users that go through them (training
data, the text generator, the inspector, diagnose, `ict-jax sample`)."""

from __future__ import annotations

import numpy as np
import pytest

from ict_jax.data.datasets import Dataset
from ict_jax.data.example import Example
from ict_jax.data.prompts import EncodedPrompt, PromptRefused, encode_prompt, encode_prompts
from ict_jax.data.templates import BOXED_INSTRUCTION, MC_INSTRUCTION, format_prompt, instruction_for
from ict_jax.model.tokenizers import CharTokenizer, decode_response, decode_responses


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


def test_encode_prompt_templates_tokenises_and_checks(tok):
    one = encode_prompt("1+2=", tok, template="plain")
    assert isinstance(one, EncodedPrompt) and one.ids.dtype == np.int32
    assert one.text == f"Question: 1+2=\n{BOXED_INSTRUCTION}\nAnswer:" == format_prompt("1+2=", "plain")
    assert one.ids.tolist() == tok.encode(one.text)
    assert encode_prompt("1+2=", tok, template="none").text == "1+2="
    # instruction "" adds none; the chat template gets the question alone
    assert encode_prompt("hi", tok, template="plain", instruction="").text == "Question: hi\nAnswer:"
    assert encode_prompt("hi", tok, template="qwen_chat", instruction="").text == "<bos><user>hi<eos><assistant>"
    assert instruction_for("mc") == MC_INSTRUCTION and instruction_for("math") == BOXED_INSTRUCTION


def test_encode_prompt_refuses_with_one_line_saying_by_how_much(tok):
    assert len(encode_prompt("x" * 10, tok, template="none", max_len=10).ids) == 10  # at the limit: kept
    with pytest.raises(PromptRefused) as e:
        encode_prompt("x" * 13, tok, template="none", max_len=10)
    assert str(e.value) == ("the prompt is 13 tokens after templating, 3 more than rollout.max_prompt_len=10 "
                            "(prompts are never truncated)")
    with pytest.raises(PromptRefused, match="2 more than data.eval_max_prompt_len=1"):
        encode_prompt("abc", tok, template="none", max_len=1, limit_key="data.eval_max_prompt_len")
    with pytest.raises(PromptRefused, match="encodes to zero tokens"):
        encode_prompt("", tok, template="none")
    with pytest.raises(PromptRefused, match="token id 99 but the model's vocabulary has 50 ids"):
        encode_prompt("Z", tok, template="none", vocab_size=50)  # 'Z' is the last id, 99
    assert issubclass(PromptRefused, ValueError)  # the CLI prints it as one line, exit 2


def test_encode_prompts_is_the_front_door_per_example(tok):
    exs = [Example(prompt="1+1=", answer="2"), Example(prompt="x" * 40, answer="0"), Example(prompt="", answer="0")]
    enc = encode_prompts(Dataset("d", exs, "math", "test"), tok, template="none", max_prompt_len=16)
    assert enc.dropped == 2 and enc.dropped_indices == [1, 2]
    assert [i.tolist() for i in enc.ids] == [encode_prompt("1+1=", tok, template="none").ids.tolist()]


def test_decode_response_drops_padding_and_eos(tok):
    eos, pad = tok.eos_ids[0], tok.pad_id
    ids = tok.encode("12") + [eos, pad, pad]
    assert decode_response(tok, ids, [1, 1, 1, 0, 0]) == "12"
    assert decode_response(tok, ids[:2]) == "12"  # valid None: every token
    # a valid token after the EOS position still counts; only EOS ids and invalid positions are dropped
    assert decode_response(tok, tok.encode("3") + [eos] + tok.encode("4"), np.array([True, True, True])) == "34"
    rows = np.array([tok.encode("ab") + [eos], tok.encode("c") + [eos, pad]])
    assert decode_responses(tok, rows, rows != pad) == ["ab", "c"]


def test_the_users_go_through_the_front_door(tiny_model, tok):
    """The text generator, the inspector and diagnose encode with encode_prompt: the same ids, and the
    same one-line refusal."""
    from ict_jax.diagnostics.diagnose import _prompt_ids
    from ict_jax.diagnostics.inspector import token_report
    from ict_jax.sampling.text_generation import make_text_generator

    gen = make_text_generator(tiny_model, tok, max_new_tokens=2, template="plain", max_prompt_len=64, batch_size=1)
    assert gen.encode("1+2=").tolist() == encode_prompt("1+2=", tok, template="plain").ids.tolist()
    gen = make_text_generator(tiny_model, tok, max_new_tokens=2, template="none", max_prompt_len=16, batch_size=1)
    with pytest.raises(PromptRefused, match="prompt 1: the prompt is 20 tokens after templating, 4 more than "
                                            "max_prompt_len=16"):
        gen(["1+2=", "x" * 20], n=1)
    report = token_report(tiny_model, tok, "1+2=", num_samples=2, max_new_tokens=2, template="plain")
    assert report["prompt_ids"] == encode_prompt("1+2=", tok, template="plain").ids.tolist()
    assert [r["text"] for r in report["responses"]] == decode_responses(tok, report["arrays"]["tokens"],
                                                                        report["arrays"]["valid"])
    mc = Dataset("d", [Example(prompt="A or B?", answer="A")], "mc", "test")
    assert _prompt_ids(mc, tok, "plain", 100)[0].tolist() == encode_prompt(
        "A or B?", tok, template="plain", instruction=MC_INSTRUCTION).ids.tolist()
    with pytest.raises(PromptRefused, match="prompt 0: the prompt has token id"):
        _prompt_ids(mc, tok, "plain", 50)
