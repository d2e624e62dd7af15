"""One rank of a torchrun launch across the two nodes of an emulated cluster (tests/ep/test_cluster.py).

``python cluster_script.py OUT_DIR``: three clipped AdamW steps of a float64 Qwen3-MoE under DDP with
the default config (the EP group spans both nodes, which the launcher's environment says: the
two-level exchange), against the per-rank exchange and the unsharded model (node_workers.train_arms);
rank r writes its errors and the transports that ran to ``OUT_DIR/rank{r}.json``.
"""

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "support")]

import torch.distributed as dist  # noqa: E402
from node_workers import train_arms  # noqa: E402


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = train_arms(rank, world, {})
    result = {"errors": max(out["errors"].values()), "transports": out["transports"], "node": os.environ["GROUP_RANK"]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
