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
    from ict_jax.outputs import check_output_dir
    from ict_jax.train.checkpoints import Checkpointer, export_checkpoint, resolve_checkpoint_dir

    check_output_dir(args.out, "--out")
    directory, step = resolve_checkpoint_dir(args.checkpoint, args.step)
    with Checkpointer(directory, read_only=True) as ckpt:
        step = ckpt.resolve_step(step)
    out = export_checkpoint(directory, args.out, step=step, dtype=args.dtype, format=args.format)
    print(f"exported step {step} of {directory} to {out}")
    return 0
