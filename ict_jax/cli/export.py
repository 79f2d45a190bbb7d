"""``ict-jax export``: a training checkpoint as a Hugging Face safetensors directory or a PEFT adapter."""

from __future__ import annotations

from typing import Any


def add_export_args(p: Any) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a run directory, its checkpoints/ folder or one checkpoint's <step>/ directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest finished one)")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype of the written safetensors (default: as trained)")
    p.add_argument("--format", default="merged", choices=("merged", "peft"),
                   help="merged: a transformers directory (LoRA adapters merged into the weights); peft: the LoRA "
                        "adapters alone as a PEFT adapter directory (docs/lora.md)")


def export_main(args: Any) -> int:
    from pathlib import Path

    from ict_jax.outputs import check_output_dir
    from ict_jax.train.export import export_checkpoint
    from ict_jax.train.model_source import resolve_model

    check_output_dir(args.out, "--out")
    source = resolve_model(args.checkpoint, step=args.step, checkpoint=True)
    out = export_checkpoint(source, args.out, dtype=args.dtype, format=args.format)
    print(f"exported step {source.step} of {Path(source.path).parent} to {out}")
    return 0
