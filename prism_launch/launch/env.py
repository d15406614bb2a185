"""The environment each logical rank sees: exactly what torchrun's elastic agent sets
(checked against torch 2.13's ``SimpleElasticAgent._start_workers``). The project's own
contract with a rank is one more variable, the rank plan (:mod:`prism_launch.config.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    world_size: int
    nproc_per_node: int
    nnodes: int

    def local_rank(self, rank: int) -> int:
        return rank % self.nproc_per_node

    def node_rank(self, rank: int) -> int:
        return rank // self.nproc_per_node

    def local_world_size(self, rank: int) -> int:
        node = self.node_rank(rank)
        return min(self.nproc_per_node, self.world_size - node * self.nproc_per_node)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "nproc_per_node": self.nproc_per_node, "nnodes": self.nnodes}


def torchrun_env(
    rank: int,
    topo: Topology,
    *,
    master_addr: str,
    master_port: int,
    run_id: str,
    max_restarts: int,
    role: str = "default",
    omp_threads: str = "1",
) -> dict[str, str]:
    """Variables torchrun's agent exports to worker ``rank``."""
    return {
        "LOCAL_RANK": str(topo.local_rank(rank)),
        "RANK": str(rank),
        "GROUP_RANK": str(topo.node_rank(rank)),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(topo.local_world_size(rank)),
        "WORLD_SIZE": str(topo.world_size),
        "GROUP_WORLD_SIZE": str(topo.nnodes),
        "ROLE_WORLD_SIZE": str(topo.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": omp_threads,
    }
