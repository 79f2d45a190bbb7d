"""Tokenizers: one protocol, three implementations.

* ``load_tokenizer(path)`` reads a Hugging Face tokenizer directory (``tokenizer.json`` via the
  ``tokenizers`` library, else ``transformers``' fast tokenizer, offline) or a ``.gguf`` file (its
  embedded byte-level BPE vocabulary, merges, special tokens and chat template, read with ``gguf``).
* ``CharTokenizer``: a fixed character vocabulary (< 128 ids) for tests and the arithmetic demo.
* ``QWEN2P5_CHAT_TEMPLATE``: the Qwen2.5 ChatML template, ``<|im_start|>role\\ncontent<|im_end|>\\n``,
  with Qwen's default system prompt when the conversation has none.
* ``decode_response``: the one response decoder (valid tokens, EOS dropped, special tokens skipped).

Chat templates are Jinja, rendered in jinja2's immutable sandbox (the same mechanism Hugging Face uses):
template text from a model file is never handed to eval/exec.
"""

from __future__ import annotations

import functools
import json
import os
import unicodedata
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ict_jax.model.gguf_reader import open_gguf
from ict_jax.model.packaged import resolve_path

QWEN2P5_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# ChatML as Qwen2.5 uses it (tool calls left out: RLVR prompts never carry tools).
QWEN2P5_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN2P5_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Tokens that end a turn in the chat formats we meet; added to eos_ids when the vocabulary has them.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the sampler, trainer and data pipeline need from a tokenizer."""

    eos_ids: tuple[int, ...]  # generation stops at any of these
    pad_id: int
    vocab_size: int  # number of ids the tokenizer can produce (the model may pad its embedding)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render a Jinja chat template in a sandbox (``bos_token``/``eos_token`` may be passed in ``extra``)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
    return _compile_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


# --------------------------------------------------------------------------------------------------
# Hugging Face / GGUF tokenizers (a `tokenizers.Tokenizer` plus the metadata around it)
# --------------------------------------------------------------------------------------------------
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with eos/pad ids and a chat template.

    ``encode`` adds no special tokens except BOS when the tokenizer's config asks for it
    (``add_bos_token``); special tokens written in the text (``<|im_start|>``) map to their ids.
    """

    def __init__(self, backend, *, eos_ids: Sequence[int], pad_id: int, chat_template: str | None = None,
                 bos_id: int | None = None, add_bos: bool = False, bos_token: str = "", eos_token: str = ""):
        if not eos_ids:
            raise ValueError("a tokenizer needs at least one eos id")
        self.backend = backend
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.pad_id = int(pad_id)
        self.bos_id = bos_id
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template
        self._bos_token, self._eos_token = bos_token, eos_token

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos else list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; use template 'plain' or 'none'")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self._bos_token, eos_token=self._eos_token)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, pad_id={self.pad_id})"


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _end_token_ids(backend, first: Sequence[int | None]) -> list[int]:
    ids = [i for i in first if i is not None]
    for tok in _END_TOKENS:
        i = backend.token_to_id(tok)
        if i is not None:
            ids.append(i)
    return ids


def _load_hf_dir(path: str) -> HFTokenizer:
    def read_json(name: str) -> dict:
        p = os.path.join(path, name)
        if not os.path.exists(p):
            return {}
        with open(p, encoding="utf-8") as f:
            return json.load(f)

    config = read_json("tokenizer_config.json")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from tokenizers import Tokenizer as _Backend

        backend = _Backend.from_file(os.path.join(path, "tokenizer.json"))
    else:  # vocab.json + merges.txt only: let transformers build the fast tokenizer
        from transformers import AutoTokenizer

        backend = AutoTokenizer.from_pretrained(path, local_files_only=True).backend_tokenizer
    template = config.get("chat_template")
    jinja_path = os.path.join(path, "chat_template.jinja")  # transformers >= 4.43 writes it separately
    if template is None and os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    eos_tok, pad_tok, bos_tok = (_token_str(config.get(k)) for k in ("eos_token", "pad_token", "bos_token"))
    gen = read_json("generation_config.json").get("eos_token_id")
    gen_ids = gen if isinstance(gen, list) else [gen]
    eos_ids = _end_token_ids(backend, [backend.token_to_id(eos_tok) if eos_tok else None, *gen_ids])
    if not eos_ids:
        raise ValueError(f"{path}: no eos token found (tokenizer_config.json eos_token, generation_config.json)")
    pad_id = backend.token_to_id(pad_tok) if pad_tok else None
    bos_id = backend.token_to_id(bos_tok) if bos_tok else None
    return HFTokenizer(backend, eos_ids=eos_ids, pad_id=eos_ids[0] if pad_id is None else pad_id,
                       chat_template=template, bos_id=bos_id, add_bos=bool(config.get("add_bos_token", False)),
                       bos_token=bos_tok or "", eos_token=eos_tok or "")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies:
    printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100 onwards, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


# llama.cpp's `tokenizer.ggml.pre` names -> the split regex the merges were learned with. Names not here
# use GPT-2's own split (ByteLevel(use_regex=True)). "smollm"/"starcoder" etc. also split digits singly.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT,
                "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}
_GGUF_SINGLE_DIGITS = {"smollm", "starcoder", "refact", "codeshell"}


def _gguf_field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _load_gguf(path: str) -> HFTokenizer:
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as _Backend
    from tokenizers.models import BPE

    reader = open_gguf(path)
    kind = _gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {kind!r}")
    tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges", [])]
    # Byte-level vocabularies are stored already spelled in GPT-2's byte alphabet ("Ġthe"); a token with
    # other characters is respelled from its UTF-8 bytes so that it stays reachable.
    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    backend = _Backend(BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, fuse_unk=False))
    pre = str(_gguf_field(reader, "tokenizer.ggml.pre", "default"))
    if pre in _GGUF_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        steps = [pre_tokenizers.Digits(individual_digits=True)] if pre in _GGUF_SINGLE_DIGITS else []
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    # token types (llama.cpp): 3 = control (special), 4 = user-defined (matched whole, not special).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(spelled, types) if ty == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(spelled, types) if ty == 4])

    def tok_id(key: str) -> int | None:
        v = _gguf_field(reader, f"tokenizer.ggml.{key}")
        return int(v) if v is not None else None

    eos, bos, pad = tok_id("eos_token_id"), tok_id("bos_token_id"), tok_id("padding_token_id")
    eos_ids = _end_token_ids(backend, [eos])
    if not eos_ids:
        raise ValueError(f"{path}: the GGUF names no eos token")
    return HFTokenizer(backend, eos_ids=eos_ids, pad_id=eos_ids[0] if pad is None else pad,
                       chat_template=_gguf_field(reader, "tokenizer.chat_template"), bos_id=bos,
                       add_bos=bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
                       bos_token=spelled[bos] if bos is not None else "",
                       eos_token=spelled[eos] if eos is not None else "")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from its spec: a Hugging Face tokenizer directory, a ``.gguf`` file (its embedded
    tokenizer), ``pkg:<package>/<file>`` or a model split over packages (``ict_jax.model.packaged``), or
    ``"char"``, the built-in :class:`CharTokenizer`. Offline."""
    if os.fspath(path) == "char":
        return CharTokenizer()
    path = resolve_path(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf(path)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    raise FileNotFoundError(f"no tokenizer at {path!r}: expected a Hugging Face tokenizer directory or a .gguf file")


# --------------------------------------------------------------------------------------------------
# The one response decoder
# --------------------------------------------------------------------------------------------------
def decode_response(tokenizer: Any, tokens: Sequence[int], valid: Sequence[Any] | None = None) -> str:
    """The text of one sampled response: its tokens where ``valid`` is true (padding dropped; None = all),
    without the tokenizer's EOS ids (``tokenizer.eos_ids``), decoded with special tokens skipped. Used by
    training (rewards), evaluation, the inspector, diagnose and ``ict-jax sample``."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if valid is not None:  # a numpy mask, not a Python loop over every position (its time grew with N)
        keep = np.asarray(valid).reshape(-1).astype(bool)
        n = min(ids.size, keep.size)  # as zip would pair them
        ids = ids[:n][keep[:n]]
    ids = ids[~np.isin(ids, np.asarray([int(e) for e in tokenizer.eos_ids], dtype=np.int64))]
    return tokenizer.decode(ids.tolist())


def decode_responses(tokenizer: Any, tokens: Sequence[Sequence[int]], valid: Sequence[Sequence[Any]]) -> list[str]:
    """:func:`decode_response` of every row of ``tokens`` / ``valid`` ``[B, N]``."""
    return [decode_response(tokenizer, row, v) for row, v in zip(tokens, valid)]


# --------------------------------------------------------------------------------------------------
# The built-in character tokenizer
# --------------------------------------------------------------------------------------------------
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>", "<system>", "<user>", "<assistant>")
CHAR_ALPHABET = (" \n0123456789+-*/=().,?!:;'\"%$#_^{}[]<>\\|&"
                 "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class UnknownCharacterError(ValueError):
    """A character the :class:`CharTokenizer` cannot represent. ``char``, ``position`` (in ``text``) and
    ``text`` say which; the message is one line. Callers that know where the text came from (a data
    set's example, a command-line prompt) prefix it with that."""

    def __init__(self, char: str, position: int, text: str):
        self.char, self.position, self.text = char, position, text
        name = unicodedata.name(char, "unnamed")
        shown = text if len(text) <= 60 else (text[:57] + "...")
        super().__init__(f"character {char!r} (U+{ord(char):04X} {name}) at position {position} of {shown!r} is "
                         "not in the CharTokenizer's alphabet (ASCII letters, digits, space, newline and "
                         "common punctuation; docs/models.md)")


class CharTokenizer:
    """One id per character, for tests and the arithmetic demo.

    Ids: the specials ``<pad>=0, <bos>=1, <eos>=2, <unk>=3, <system>=4, <user>=5, <assistant>=6``, then
    ``CHAR_ALPHABET`` in order (space, newline, digits, operators, punctuation, letters): 100 ids in
    all, fixed across versions. A character outside the alphabet is refused: :meth:`encode` raises
    :class:`UnknownCharacterError` naming it (a user's text is never changed silently), so
    ``decode(encode(text)) == text`` for every text it accepts (special-token names aside). Special-token
    names written in the text encode to their ids; ``<unk>`` is never produced by :meth:`encode` (a model
    may still generate its id, a special token like the others). Chat format:
    ``<bos>`` then, per message, ``<role>content<eos>``; the generation prompt is ``<assistant>``.
    """

    def __init__(self):
        self.vocab: dict[str, int] = {t: i for i, t in enumerate(CHAR_SPECIALS + tuple(CHAR_ALPHABET))}
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.pad_id, self.bos_id, self.unk_id = self.vocab["<pad>"], self.vocab["<bos>"], self.vocab["<unk>"]
        self.eos_ids = (self.vocab["<eos>"],)
        self.vocab_size = len(self.vocab)

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text[i] == "<":
                end = text.find(">", i)
                tok = text[i:end + 1] if end > 0 else ""
                if tok in CHAR_SPECIALS:
                    ids.append(self.vocab[tok])
                    i = end + 1
                    continue
            tok_id = self.vocab.get(text[i])
            if tok_id is None:
                raise UnknownCharacterError(text[i], i, text)
            ids.append(tok_id)
            i += 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            tok = self.id_to_token.get(int(i), "<unk>")
            if skip_special_tokens and tok in CHAR_SPECIALS:
                continue
            out.append(tok)
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        parts = ["<bos>"]
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: role must be system/user/assistant with string content, got {m!r}")
            parts.append(f"<{role}>{m['content']}<eos>")
        if add_generation_prompt:
            parts.append("<assistant>")
        return "".join(parts)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
