"""``autoshard export`` and ``autoshard convert``: a sharded checkpoint as a dense Hugging
Face folder, and our format to and from DCP, in one process."""

from __future__ import annotations

import sys

from .common import HelpFormatter

__all__ = ["add_export", "cmd_export", "add_convert", "cmd_convert"]


def add_export(sub) -> None:
    ep = sub.add_parser("export", formatter_class=HelpFormatter, help="write a sharded checkpoint as a dense HF folder",
                        description="Merge a checkpoint written by save_checkpoint (any mode, any world size; "
                                    "e.g. a step_NNNNNN folder of examples/finetune.py) into a Hugging Face "
                                    "folder that AutoModelFor....from_pretrained loads: config.json naming the "
                                    "class that was sharded, and safetensors. One process, no torchrun.",
                        epilog="example:\n  autoshard export ckpt/step_000030 my-model/\n"
                               "  python -c \"import transformers as t; "
                               "t.AutoModelForSequenceClassification.from_pretrained('my-model')\"\n\n"
                               "exit status: 0 written, 2 bad arguments or an unreadable checkpoint.")
    ep.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder (manifest.json + rank files)")
    ep.add_argument("out", metavar="OUT", help="the folder to write")
    ep.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="split the weights into files of at most SIZE (e.g. 500MB)")
    ep.add_argument("--model-class", default=None, metavar="CLASS",
                    help="transformers class to name in config.json (default: the class that was sharded)")


def cmd_export(args) -> int:
    from ..io.builder import resolve_class
    from ..io.export import export_checkpoint

    cls = resolve_class(None, args.model_class) if args.model_class else None
    from pathlib import Path

    if (Path(args.checkpoint) / "adapter_config.json").exists():     # saved from a sharded peft model
        from ..adapters import export_merged

        out = export_merged(args.checkpoint, args.out, model_class=cls, max_shard_size=args.max_shard_size)
        print(f"wrote {out} (the LoRA adapter merged into the base: "
              f"{', '.join(sorted(p.name for p in out.iterdir()))})")
        return 0
    out = export_checkpoint(args.checkpoint, args.out, model_class=cls, max_shard_size=args.max_shard_size,
                            progress=sys.stderr.isatty())
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


def add_convert(sub) -> None:
    cp = sub.add_parser("convert", formatter_class=HelpFormatter, help="convert between our checkpoint format and DCP",
                        description="Convert a checkpoint in one process, no torchrun. Our sharded format "
                                    "(manifest.json + rank files, from save_checkpoint) becomes a "
                                    "torch.distributed.checkpoint (DCP) folder that autoshard.io.dcp.load reads "
                                    "in any mode and world size; a DCP folder (from autoshard.io.dcp.save) becomes "
                                    "a dense Hugging Face folder, which from_pretrained loads in any mode and "
                                    "save_checkpoint writes in our format. The source's kind is detected.",
                        epilog="examples:\n  autoshard convert ckpt/step_000030 ckpt-dcp/     # ours -> DCP\n"
                               "  autoshard convert ckpt-dcp/ my-model/              # DCP -> HF folder\n\n"
                               "exit status: 0 written, 2 bad arguments or an unreadable checkpoint.")
    cp.add_argument("source", metavar="SOURCE", help="our checkpoint folder, or a DCP folder (.metadata)")
    cp.add_argument("out", metavar="OUT", help="the folder to write")


def cmd_convert(args) -> int:
    from pathlib import Path

    from ..io.dcp import checkpoint_to_dcp, dcp_to_folder
    from ..ir.errors import CheckpointError

    src = Path(args.source)
    if (src / ".metadata").exists():
        out = dcp_to_folder(src, args.out, progress=sys.stderr.isatty())
        print(f"wrote {out}: a dense Hugging Face folder ({', '.join(sorted(p.name for p in out.iterdir()))})")
    elif (src / "manifest.json").exists():
        out = checkpoint_to_dcp(src, args.out)
        print(f"wrote {out}: a DCP checkpoint (load it with autoshard.io.dcp.load in any mode)")
    else:
        raise CheckpointError(f"{src}: neither our checkpoint (manifest.json) nor a DCP one (.metadata)")
    return 0
