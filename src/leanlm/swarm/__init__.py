"""SWARM parallelism (Dettmers' thesis ch. 6) on hivemind: pipeline stages served by swarms of interchangeable peers,
stochastic wiring by trainers, per-stage gradient averaging with delayed updates, adaptive rebalancing."""

from leanlm.swarm.launch import SwarmRun, run_local_swarm
from leanlm.swarm.model import Stage, SwarmModelConfig, full_model
from leanlm.swarm.peer import SwarmSettings
from leanlm.swarm.routing import PeerBalancer

__all__ = ["SwarmRun", "run_local_swarm", "Stage", "SwarmModelConfig", "full_model", "SwarmSettings", "PeerBalancer"]
