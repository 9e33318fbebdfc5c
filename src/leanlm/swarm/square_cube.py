"""The square-cube law of Dettmers' thesis section 6.3.1 as arithmetic: a Transformer stage computes O(B L H^2 + B L^2 H)
per micro-batch but sends only its activations, O(B L H), forward and their gradients back. So the larger the
hidden size, the less a slow network matters. `stage_utilization` is the share of a stage's time spent
computing when communication is not overlapped (a lower bound on what SWARM's request queues achieve)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageShape:
    hidden: int  # H
    layers: int  # Transformer layers per stage
    seq_len: int  # L
    micro_batch: int  # B
    ffn_multiple: int = 4  # FFN width / H

    def forward_flops(self) -> float:
        """Multiply-adds x 2 of the stage's forward: projections (4 H^2) + FFN (2 f H^2) per token, plus the two
        attention matmuls (2 L H per token)."""
        tokens = self.micro_batch * self.seq_len
        per_token = 2 * (4 + 2 * self.ffn_multiple) * self.hidden**2 + 2 * 2 * self.seq_len * self.hidden
        return self.layers * tokens * per_token

    def boundary_bytes(self, bytes_per_value: float = 2.0) -> float:
        """Activations sent forward plus gradients sent back across one stage boundary."""
        return 2 * self.micro_batch * self.seq_len * self.hidden * bytes_per_value


def stage_utilization(
    shape: StageShape,
    flops_per_second: float,
    bandwidth_bits: float,
    latency_seconds: float,
    bytes_per_value: float = 2.0,
) -> float:
    """Compute time / (compute + communication) for one micro-batch's forward + backward (backward = 2x forward)
    through one stage: two messages, each paying the latency once."""
    compute = 3 * shape.forward_flops() / flops_per_second
    communication = 2 * latency_seconds + 8 * shape.boundary_bytes(bytes_per_value) / bandwidth_bits
    return compute / (compute + communication)
