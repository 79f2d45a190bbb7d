"""Built-in procedural tasks, generated from a seed (no files): ``arith`` (multi-digit arithmetic, exact
answers, optionally with a column-by-column scratchpad) and ``split`` (write N as x+y). docs/data.md."""

from __future__ import annotations

import random

from ict_jax.data.example import Example


def addition_scratchpad(a: int, b: int) -> str:
    """Column-by-column working of ``a + b``, least significant digit first, then the sum:
    ``57 + 38`` -> ``"7+8=15,5+3+1=9,95"`` (a column shows ``+1`` when a carry comes in; a missing digit
    is 0). Every character follows from the problem, so the whole string is the exact-match answer."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    parts, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        parts.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
        carry = s // 10
    return ",".join(parts + [str(a + b)])


def arith_examples(*, size: int, seed: int, digits: int = 3, ops: str = "+-", allow_negative: bool = False,
                   scratchpad: bool = False, source: str = "arith") -> list[Example]:
    """Seeded multi-digit problems ``"12+345="`` with exact integer answers ``"357"``; operands have 1 to
    ``digits`` digits; with ``allow_negative=False`` subtraction puts the larger operand first.
    ``scratchpad=True`` (addition only): the answer is the column-by-column working then the sum
    (:func:`addition_scratchpad`), a longer response whose tokens depend on earlier sampled ones."""
    if digits < 1 or not ops or set(ops) - set("+-*"):
        raise ValueError(f"arith: digits >= 1 and ops from '+-*' required, got digits={digits}, ops={ops!r}")
    if scratchpad and ops != "+":
        raise ValueError(f"arith: scratchpad=True needs ops='+' (got ops={ops!r})")
    rng = random.Random(f"arith:{seed}:{digits}:{ops}")
    out = []
    for i in range(size):
        a, b = (rng.randint(0, 10 ** rng.randint(1, digits) - 1) for _ in range(2))
        op = rng.choice(ops)
        if op == "-" and not allow_negative and b > a:
            a, b = b, a
        value = a + b if op == "+" else a - b if op == "-" else a * b
        answer = addition_scratchpad(a, b) if scratchpad else str(value)
        out.append(Example(f"{a}{op}{b}=", answer, {"source": source, "index": i}))
    return out


def split_examples(*, size: int, seed: int, digits: int = 3, force_x: bool = False,
                   source: str = "split") -> list[Example]:
    """Seeded problems ``"N="``: write N (2 to ``10**digits - 1``) as a sum ``x+y`` of two positive integers;
    the gold is ``str(N)`` and every such pair is correct (scorer "sum"). The SFT target
    (``meta["solution"]``) draws x uniformly from 1..N-1, zero-padded to ``digits`` characters, and
    writes y = N - x plainly: ``"95="`` -> ``"007+88"``. x is a free choice that decides nothing; y is
    the computation, and it depends on the x this rollout chose (docs/data.md).

    ``force_x=True``, the x-forced evaluation: the same problems with that x teacher-forced into the
    prompt, ``"95=07+"``, and only y scored (gold ``"88"``, scorer "exact"): the subtraction N - x for x
    uniform in 1..N-1, apart from the choice of an easy decomposition."""
    if digits < 1:
        raise ValueError(f"split: digits >= 1 required, got digits={digits}")
    if not isinstance(force_x, bool):
        raise ValueError(f"split: force_x must be true or false, got {force_x!r}")
    rng = random.Random(f"split:{seed}:{digits}")
    out = []
    for i in range(size):
        n = rng.randint(2, 10 ** digits - 1)
        x = rng.randint(1, n - 1)
        meta = {"source": source, "index": i, "solution": f"{x:0{digits}d}+{n - x}"}
        if force_x:
            out.append(Example(f"{n}={x:0{digits}d}+", str(n - x), {**meta, "solution": str(n - x)}))
        else:
            out.append(Example(f"{n}=", str(n), meta))
    return out

