"""Verifiable rewards, as pure functions: answer extraction, math-verify equivalence, multiple choice,
reasoning-gym, exact and sum checks.

    check_text("math", response, gold)       # RewardCheck(reward, correct, answer, status), in-process

Kinds (``Dataset.scorer``): "math" and "gsm8k" (extracted answer vs gold with math-verify), "mc" (one
letter), "gym" (reasoning-gym's own scorer on ``meta["gym_entry"]``), "exact" (stripped response equals
the stripped gold), "sum" (the response is ``x+y``, two positive integers that add up to the gold).
Only the last ``RewardSpec.max_response_chars`` characters of a response are read (the final answer is
at the end) and an extracted answer longer than ``MAX_ANSWER_CHARS`` counts as none.

Safety: our code never hands text to eval/exec/sympify/parse_expr; math-verify parses LaTeX itself.
Parsing can still be slow or hang (``10^{10^{10^{10}}}``), so the pool runs every check in a worker
process (forkserver or spawn, never fork) under a hard wall-clock limit; an overrunning worker is
killed (SIGKILL), reaped and replaced, and its response scores ``RewardSpec.wrong``. Workers also run
under an address-space limit (:mod:`ict_jax.rewards.pool`). ``score_text``/``check_text`` here run
in-process, without a time limit. Rules and examples: docs/rewards.md.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["KINDS", "MAX_ANSWER_CHARS", "MAX_RESPONSE_CHARS", "RewardSpec", "RewardCheck", "last_boxed",
           "extract_answer", "extract_choice", "math_equal", "choice_equal", "gym_answer_score",
           "check_text", "score_text", "response_tail", "answer_text", "sft_target", "CUSTOM_KIND", "RewardKind",
           "register_reward_kind", "reward_kinds"]

#: The built-in reward kinds (:func:`reward_kinds` adds the ones a plugin registered)
KINDS = ("math", "gsm8k", "mc", "gym", "exact", "sum")
#: The reward kind scored by the user's function ``rl.reward.fn`` (run in the worker pool, never by
#: :func:`check_text`): docs/rewards.md "Custom reward functions".
CUSTOM_KIND = "custom"
MAX_RESPONSE_CHARS = 16_384  # only the tail of a response is searched for its final answer
MAX_ANSWER_CHARS = 1_000  # a longer "answer" is garbage: treated as no answer, never parsed


@dataclass(frozen=True)
class RewardSpec:
    """Reward values (config-driven format reward): ``correct`` for a right answer, ``wrong`` for a wrong
    one (also timeouts and errors), ``no_answer`` when nothing can be extracted (a negative value is a
    format penalty). ``max_response_chars``: the tail of the response that is read."""

    correct: float = 1.0
    wrong: float = 0.0
    no_answer: float = 0.0
    max_response_chars: int = MAX_RESPONSE_CHARS


@dataclass(frozen=True)
class RewardCheck:
    """One scored response. ``status``: "ok" (checked), "no_answer", "timeout" (worker killed),
    "error" (the checker raised or its worker died)."""

    reward: float
    correct: bool
    answer: str | None
    status: str = "ok"


# ---- Extraction ----
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# "The (final) answer is X" counts only as a final statement (docs/rewards.md, rule 3): it opens a sentence
# (a line start, or after . ! ? : ;), optionally after one or two short lead-ins ending with a comma
# ("Adding up, ") or a connective ("So", "Therefore,"), never after a conditional or a question
# ("Check if the answer is ...", "If ..., the answer is ..."). X is the rest of that sentence.
_LEAD_IN = r"(?!(?:if|when|whether|unless|assuming|suppose|check|verify)\b)[a-z]+(?:[ \t]+[a-z]+){0,3}[ \t]*,[ \t]*"
_CONNECTIVE = r"(?:so|thus|therefore|hence|finally|overall|in[ \t]+(?:conclusion|summary|total))[ \t]*,?[ \t]+"
_ANSWER_IS_RE = re.compile(
    r"(?:^|(?<=[.!?:;])[ \t]+)[ \t>*_#-]*"
    r"(?i:(?:" + _LEAD_IN + r"){0,2}(?:" + _CONNECTIVE + r")?the[ \t]+(?:final[ \t]+)?answer[ \t]+is)"
    r"[ \t]*:?[ \t]*(.+)", re.M)
_SENTENCE_END_RE = re.compile(r"(?<=[.!?])\s")
_HEDGE_RE = re.compile(r"(?i:(?:not|probably|likely|maybe|perhaps|possibly|unclear|unknown|wrong|incorrect)\b)")
_GSM_RE = re.compile(r"####\s*(.+)")


def _braced(text: str, start: int) -> str | None:
    """Content of the ``{...}`` opening at ``text[start]``, nested braces balanced, ``\\{`` ``\\}``
    skipped; None when it never closes."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def last_boxed(text: str, max_tries: int = 8) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``) in ``text``.
    An unclosed last box falls back to the one before (at most ``max_tries`` boxes are tried)."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    for end in reversed(starts[-max_tries:]):
        j = end
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            content = _braced(text, j)
        elif j > end:  # "\boxed 5": up to the next space or $
            m = re.match(r"[^\s$]+", text[j:j + 200])
            content = m.group(0) if m else None
        else:
            content = None
        if content is not None:
            return content.strip()
    return None


def _clean(ans: str) -> str:
    """Strip the wrapping a sentence puts around an answer: $...$, \\(...\\), **bold**, a final period."""
    ans = ans.strip()
    for _ in range(3):
        before = ans
        ans = ans.strip().rstrip(".").strip()
        for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**")):
            if ans.startswith(left) and ans.endswith(right) and len(ans) > len(left) + len(right) - 1:
                ans = ans[len(left):len(ans) - len(right)]
        if ans == before:
            break
    return ans.strip()


_UNITS_RE = re.compile(r"(?<=\d)\s+[A-Za-z][A-Za-z.]*(?:\s+[A-Za-z][A-Za-z.]*)*$")


def _plain(ans: str) -> str:
    """A plain-text answer line ("#### $1,080", "18 dollars"): drop a currency sign before a number and
    trailing words after one (units), which would otherwise parse as products of symbols."""
    ans = re.sub(r"^\\?\$\s*(?=[-\d.])", "", _clean(ans))
    return _UNITS_RE.sub("", ans).strip()


def response_tail(text: str, max_chars: int) -> str:
    """The last ``max_chars`` characters of a response: where its final answer is."""
    return text[-max_chars:] if len(text) > max_chars else text


def _final_statement(text: str) -> str | None:
    """X of the last "The (final) answer is X" that is a final statement (see ``_ANSWER_IS_RE``): X runs
    to the end of its sentence (a . ! ? followed by white space, or the end of the line); a sentence that
    ends with "?" or an X that opens with a hedge or a negation ("not", "probably", ...) is no answer."""
    ms = list(_ANSWER_IS_RE.finditer(text))
    if not ms:
        return None
    rest = ms[-1].group(1).strip()
    sentence = _SENTENCE_END_RE.split(rest, maxsplit=1)[0].strip()
    if sentence.endswith("?") or _HEDGE_RE.match(sentence):
        return None
    if sentence.rstrip(".").endswith("**") and not sentence.startswith("**"):  # "**The answer is 9**"
        sentence = sentence.rstrip(".").rstrip("*")
    return _plain(sentence)


def extract_answer(text: str, max_chars: int = MAX_RESPONSE_CHARS) -> str | None:
    """The final answer of a response, first rule that matches on its last ``max_chars`` characters:
    1. the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces);
    2. the last ``#### n`` (GSM8K), rest of that line;
    3. the last "The (final) answer is X" that is a final statement: it opens a sentence (optionally
       after a lead-in such as "So," or "Adding up,"; never after "if", "check", "whether" ...), X is
       the rest of that sentence, not a question and not hedged ("not", "probably", ...).
    In 2 and 3, ``$...$``, bold, a final period, a leading currency sign and trailing unit words after a
    number are stripped ("The answer is $18 dollars." -> "18").
    None when nothing matches or the answer is empty or longer than ``MAX_ANSWER_CHARS``."""
    text = response_tail(text, max_chars)
    ans = last_boxed(text)
    if ans is None:
        ms = list(_GSM_RE.finditer(text))
        if ms:
            ans = _plain(ms[-1].group(1))
        else:
            ans = _final_statement(text)
    if ans is None or not ans.strip() or len(ans) > MAX_ANSWER_CHARS:
        return None
    return ans.strip()


_LETTERS = "ABCDEFGHIJ"
_CHOICE_PATTERNS = [  # in priority order; the last match of the first pattern that matches wins
    re.compile(r"(?i:answer\s*(?:is\b|:)|correct\s+(?:option|choice)\s+is\b|option\s+is\b)\s*:?\s*"
               r"(?i:option\s+|choice\s+)?[*_$\s]*\(?\s*([A-J])\s*\)?(?![A-Za-z0-9])"),
    re.compile(r"\*\*\s*\(?([A-J])\)?[.:]?\s*\*\*"),
]
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textrm)\s*\{([^{}]*)\}")


def _letter(s: str) -> str | None:
    """"B", "(B)", "B.", "\\text{B}", "B) 42", "(B) 42" -> "B"."""
    s = _TEXT_WRAP_RE.sub(r"\1", s).strip().strip("*$ ").strip()
    m = re.fullmatch(r"\(?\s*([A-J])\s*\)?\s*[.:]?", s) or re.match(r"\(?([A-J])[).:]\s", s)
    return m.group(1) if m else None


def extract_choice(text: str, choices: Sequence[str] | None = None, max_chars: int = MAX_RESPONSE_CHARS) -> str | None:
    """The chosen letter (A-J): the last ``\\boxed{}`` holding a letter ("C", "(C)", "\\text{C}",
    "C) 42"); else the last "answer is (B)" / "Answer: D" / "correct option is C"; else the last bold
    "**B**"; else a response that is only a letter; else, with ``choices``, a boxed answer or "answer
    is" text equal to one option's text. None when nothing matches."""
    text = response_tail(text, max_chars)
    boxed = last_boxed(text)
    if boxed is not None and (letter := _letter(boxed)):
        return letter
    for pattern in _CHOICE_PATTERNS:
        ms = list(pattern.finditer(text))
        if ms:
            return ms[-1].group(1)
    if (letter := _letter(text)) is not None:
        return letter
    if choices:
        ans = extract_answer(text, max_chars)
        if ans is not None:
            norm = [str(c).strip().lower() for c in choices]
            if ans.strip().lower() in norm:
                return _LETTERS[norm.index(ans.strip().lower())]
    return None


def _gold_letter(gold: Any) -> str:
    if isinstance(gold, (int, np.integer)):
        return _LETTERS[int(gold)]
    return _letter(str(gold)) or str(gold).strip().upper()


def choice_equal(pred: str | None, gold: Any) -> bool:
    """``pred`` letter equals the gold letter (gold: "B", "(B)" or a 0-based index)."""
    return pred is not None and pred.upper() == _gold_letter(gold)


# ---- Equivalence ----
@functools.cache
def _math_verify():
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "Timeout is disabled" on every call
    from math_verify import parse, verify

    return parse, verify


def math_equal(pred: str | None, gold: Any) -> bool:
    """``pred`` and ``gold`` denote the same mathematical object, by math-verify: each is parsed as the
    content of a ``\\boxed{}`` (LaTeX, plain numbers, "1,000", "50\\%", intervals, sets, "x = 5" ...) and
    ``verify(gold, pred)`` decides. A gold containing "#### n" is reduced to n first. Unparseable
    -> False. No time limit here (math-verify's signal-based timeouts are off so that this works in
    any thread): bound it with :class:`RewardPool`."""
    if pred is None or not str(pred).strip():
        return False
    gold = str(gold)
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1].strip()
    parse, verify = _math_verify()
    try:
        g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        p = parse("\\boxed{" + str(pred) + "}", parsing_timeout=None)
        return bool(g and p and verify(g, p, timeout_seconds=None))
    except Exception:  # math-verify raises on some malformed input; that is a wrong answer
        return False


@functools.cache
def _gym_scorer(name: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(name)
    except Exception:  # a default config that does not construct: build a small seeded dataset
        return reasoning_gym.create_dataset(name, size=1, seed=0).score_answer


def gym_answer_score(answer: str | None, meta: Mapping[str, Any]) -> float:
    """reasoning-gym's scorer for ``meta["gym_entry"]`` (dataset ``meta["gym_dataset"]``, else the
    entry's ``metadata.source_dataset``): ``score_answer(answer, entry)`` clipped to [0, 1]."""
    entry = meta["gym_entry"]
    name = meta.get("gym_dataset") or entry["metadata"]["source_dataset"]
    return float(min(1.0, max(0.0, _gym_scorer(name)(answer, entry))))


_GYM_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.S)
# "sum": the whole stripped response is two positive integers of at most 18 digits, "x+y" (no signs,
# no spaces inside); Python's int() of a bounded digit string is the only conversion.
_SUM_RE = re.compile(r"([0-9]{1,18})\+([0-9]{1,18})")
_DIGITS_RE = re.compile(r"[0-9]{1,18}")


def sum_split_equal(ans: str | None, gold: Any) -> bool:
    """``"x+y"`` with positive integers x and y (leading zeros allowed) and x + y == gold."""
    m = _SUM_RE.fullmatch(ans or "")
    if m is None:
        return False
    target = str(gold).strip()
    if not _DIGITS_RE.fullmatch(target):  # a gold that is not a bounded digit string matches nothing
        return False
    x, y = int(m.group(1)), int(m.group(2))
    return x >= 1 and y >= 1 and x + y == int(target)


# ---- The registry of reward kinds: each kind's check and the reverse of its extraction ----
@dataclass(frozen=True)
class RewardKind:
    """A reward kind: ``check(text, gold, meta, spec) -> RewardCheck`` scores the tail ``text`` of a response
    (:func:`response_tail`), ``answer(gold) -> str`` writes an answer the check reads back as correct
    (:func:`answer_text`: the SFT targets of data sets without worked solutions)."""

    check: Callable[[str, Any, Mapping[str, Any], RewardSpec], RewardCheck]
    answer: Callable[[Any], str] = str


_REWARD_KINDS: dict[str, RewardKind] = {}


def register_reward_kind(name: str, check: Callable[[str, Any, Mapping[str, Any], RewardSpec], RewardCheck], *,
                         answer: Callable[[Any], str] = str, overwrite: bool = False) -> None:
    """Register the reward kind ``name`` (a data set's ``reward=<name>``): the one place a kind's name, check
    and answer form are written. A plugin module (``plugins: [module]``) registers more; the reward workers
    import the plugins too, so its check runs there under the time limit."""
    if name == CUSTOM_KIND:
        raise ValueError(f"reward kind {name!r} is rl.reward.fn's (docs/rewards.md)")
    if name in _REWARD_KINDS and not overwrite:
        raise ValueError(f"reward kind {name!r} is already registered (pass overwrite=True to replace it)")
    _REWARD_KINDS[name] = RewardKind(check, answer)


def reward_kinds() -> tuple[str, ...]:
    """The registered reward kinds, the built-ins (:data:`KINDS`) first."""
    return tuple(_REWARD_KINDS)


def _verdict(ans: str | None, ok: bool, spec: RewardSpec) -> RewardCheck:
    if ans is None:
        return RewardCheck(spec.no_answer, False, None, "no_answer")
    return RewardCheck(spec.correct if ok else spec.wrong, bool(ok), ans)


def _check_mc(text: str, gold: Any, meta: Mapping[str, Any], spec: RewardSpec) -> RewardCheck:
    ans = extract_choice(text, meta.get("choices"), spec.max_response_chars)
    return _verdict(ans, choice_equal(ans, gold), spec)


def _check_math(text: str, gold: Any, meta: Mapping[str, Any], spec: RewardSpec) -> RewardCheck:
    ans = extract_answer(text, spec.max_response_chars)
    return _verdict(ans, math_equal(ans, gold), spec)


def _check_exact(text: str, gold: Any, meta: Mapping[str, Any], spec: RewardSpec) -> RewardCheck:
    ans = text.strip() or None
    return _verdict(ans, ans is not None and ans == str(gold).strip(), spec)


def _check_sum(text: str, gold: Any, meta: Mapping[str, Any], spec: RewardSpec) -> RewardCheck:
    ans = text.strip()
    ans = ans if _SUM_RE.fullmatch(ans) else None  # not "x+y": no answer (RewardSpec.no_answer)
    return _verdict(ans, sum_split_equal(ans, gold), spec)


def _check_gym(text: str, gold: Any, meta: Mapping[str, Any], spec: RewardSpec) -> RewardCheck:
    tags = _GYM_TAG_RE.findall(text)  # reasoning-gym's own <answer> tags, else our extraction
    ans = tags[-1].strip() if tags else extract_answer(text, spec.max_response_chars)
    if ans is None or len(ans) > MAX_ANSWER_CHARS:
        return RewardCheck(spec.no_answer, False, None, "no_answer")
    s = gym_answer_score(ans, meta)
    return RewardCheck(spec.wrong + (spec.correct - spec.wrong) * s, s >= 1.0, ans)


def _sum_answer(answer: Any) -> str:
    target = str(answer).strip()
    return f"1+{int(target) - 1}" if _DIGITS_RE.fullmatch(target) and int(target) >= 2 else target


register_reward_kind("math", _check_math, answer=lambda a: f"The answer is \\boxed{{{a}}}.")
register_reward_kind("gsm8k", _check_math, answer=lambda a: f"#### {a}")
register_reward_kind("mc", _check_mc, answer=lambda a: f"The answer is ({_gold_letter(a)}).")
register_reward_kind("gym", _check_gym, answer=lambda a: f"<answer>{a}</answer>")
register_reward_kind("exact", _check_exact)
register_reward_kind("sum", _check_sum, answer=_sum_answer)
assert reward_kinds() == KINDS


def check_text(kind: str, response: str, gold: Any, meta: Mapping[str, Any] | None = None,
               spec: RewardSpec | None = None) -> RewardCheck:
    """Score one response in-process (no time limit; the pool's workers call this) by the registered
    reward kind ``kind``."""
    entry = _REWARD_KINDS.get(kind)
    if entry is None:
        raise ValueError(f"unknown reward kind {kind!r}; expected one of {reward_kinds()}")
    spec = spec or RewardSpec()
    return entry.check(response_tail(str(response), spec.max_response_chars), gold, meta or {}, spec)


def score_text(kind: str, response: str, gold: Any, meta: Mapping[str, Any] | None = None,
               spec: RewardSpec | None = None) -> float:
    """The reward of one response, in-process (tests, notebooks): ``check_text(...).reward``."""
    return check_text(kind, response, gold, meta, spec).reward


# ---- The reverse of extraction: an answer written so that its kind's check reads it back ----
def answer_text(kind: str, answer: Any) -> str:
    """``answer`` written in the form the extraction of ``kind`` reads back, so that
    ``check_text(kind, answer_text(kind, gold), gold)`` is correct (a test checks every kind):
    ``math`` ``The answer is \\boxed{a}.``, ``gsm8k`` ``#### a``, ``mc`` ``The answer is (B).`` (the gold
    letter, also for a 0-based index), ``gym`` ``<answer>a</answer>``, ``exact`` ``a``, ``sum`` ``1+(N-1)``
    (one of the correct splits of N >= 2), ``custom`` ``a`` (the user's function decides)."""
    if kind == CUSTOM_KIND:
        return str(answer)
    entry = _REWARD_KINDS.get(kind)
    if entry is None:
        raise ValueError(f"unknown reward kind {kind!r}; expected one of {reward_kinds() + (CUSTOM_KIND,)}")
    return entry.answer(answer)


def sft_target(example: Any, kind: str) -> str:
    """The SFT target text of an example (anything with ``.answer`` and a ``.meta`` dict): its worked
    solution (``meta["solution"]``) if the dataset has one, else :func:`answer_text` of its gold answer."""
    solution = example.meta.get("solution") if isinstance(example.meta, dict) else None
    if solution:
        return str(solution)
    return answer_text(kind, example.answer)
