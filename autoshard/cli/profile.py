"""``autoshard profile``: this machine's Cluster measured on the ranks of a torchrun job."""

from __future__ import annotations

import os

from .common import HelpFormatter, UsageError

__all__ = ["add_profile", "cmd_profile"]


def add_profile(sub) -> None:
    pp = sub.add_parser("profile", formatter_class=HelpFormatter,
                        help="measure this machine's Cluster (run under torchrun) and save it as JSON",
                        description="Time collectives, a matmul at several sizes, the per-op dispatch cost and "
                                    "the per-call cost of a collective on the ranks of this torchrun job "
                                    "(autoshard.profile), and write the Cluster that the cost model and "
                                    "--mode auto read: reuse it with `autoshard plan --cluster FILE` or "
                                    "shard(mode='auto', cluster=Cluster.load(FILE)).",
                        epilog="example:\n  torchrun --nproc-per-node 8 -m autoshard.cli profile --out cluster.json\n"
                               "  autoshard plan llama:tiny -w 8 -m auto --cluster cluster.json")
    pp.add_argument("--out", "-o", default="cluster.json", metavar="FILE", help="where rank 0 writes the JSON")
    pp.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                    help="ranks sharing a node (default: torchrun's LOCAL_WORLD_SIZE)")


def cmd_profile(args) -> int:
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError("autoshard profile measures the ranks of a torchrun job: run it as "
                          "`torchrun --nproc-per-node N -m autoshard.cli profile --out cluster.json`")
    from ..planning.profile import profile

    if not dist.is_initialized():
        from ..runtime.device import init_process_group

        init_process_group()
    cluster = profile(ranks_per_node=args.ranks_per_node)
    if dist.get_rank() == 0:
        cluster.save(args.out)
        print(f"wrote {args.out}: {cluster.describe()}; per collective call {cluster.call_overhead * 1e6:.0f} µs, "
              f"per op {cluster.op_overhead * 1e6:.1f} µs, a pair of collectives sent together hides "
              f"{cluster.pair_overlap:.0%} of the shorter")
    dist.barrier()
    return 0
