"""SWARM on this machine (Dettmers' thesis section 6.4 at toy scale), three parts, written to benchmarks/results/swarm.json + .png:

- convergence (Fig 6.4): training loss against samples for a local swarm (3 stages, 6 peers, 2 trainers, 8-bit
  activations and gradients) and for the same model trained in one process with the same batch per step;
- rebalancing (Table 6.5 structure): throughput with heterogeneous peers (the peers of stage 1 are slowed by a
  fixed time per sample) without rebalancing, with rebalancing every T seconds, and with an ideal assignment;
- square-cube (section 6.3.1): compute share of a stage against bandwidth and latency for the hidden sizes here
  and Dettmers' thesis', from this CPU's measured matmul speed (the loopback is too fast to show network effects).

    python benchmarks/swarm.py                          # about 11 minutes
    python benchmarks/swarm.py --only square-cube
    python benchmarks/swarm.py --report                  # the saved tables
"""

from __future__ import annotations

import argparse
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leanlm.bench import Study, print_report, study_arguments  # noqa: E402
from leanlm.data import plain_text  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402
from leanlm.swarm import Stage, SwarmModelConfig, SwarmRun, SwarmSettings, full_model, run_local_swarm  # noqa: E402
from leanlm.swarm.model import byte_blocks  # noqa: E402
from leanlm.swarm.square_cube import StageShape, stage_utilization  # noqa: E402

MODEL = SwarmModelConfig(stages=3, layers_per_stage=2, hidden=128, heads=4, seq_len=128)
SETTINGS = SwarmSettings(model=MODEL, micro_batch=4, target_batch=32, rebalance_seconds=0)


def single_process_losses(samples: int, settings: SwarmSettings, seed: int = 0) -> list[float]:
    """The same model, batch per step and optimizer in one process: one loss per micro-batch."""
    torch.manual_seed(seed)
    model = full_model(settings.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    blocks = byte_blocks(plain_text("lambada-dev"), settings.model.seq_len)
    generator = torch.Generator().manual_seed(seed)
    losses, accumulated = [], 0
    while len(losses) * settings.micro_batch < samples:
        ids = blocks[torch.randint(0, len(blocks), (settings.micro_batch,), generator=generator)]
        loss = Stage.loss(model(ids), ids)
        (loss * settings.micro_batch / settings.target_batch).backward()
        losses.append(loss.item())
        accumulated += settings.micro_batch
        if accumulated >= settings.target_batch:
            optimizer.step()
            optimizer.zero_grad()
            accumulated = 0
    return losses


def steady_throughput(record: dict) -> float:
    """Samples per second over the second half of the run (after start-up)."""
    status = record["status"]
    half = status[len(status) // 2 :]
    if len(half) < 2:
        return record["samples_per_second"]
    return sum(line["samples_per_second"] for line in half) / len(half)


def cpu_flops() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 1024**3 / (time.perf_counter() - started)


def plot_results(payload: dict, path) -> None:
    fig, (loss, speed, util) = plt.subplots(1, 3, figsize=(16, 4.2))
    for name, losses in payload.get("convergence", {}).get("losses", {}).items():
        curve = torch.tensor(losses)
        window = max(1, len(curve) // 20)
        samples = [SETTINGS.micro_batch * (i + window) for i in range(len(curve) - window + 1)]
        loss.plot(samples, curve.unfold(0, window, 1).mean(dim=1), label=name)
    loss.set_xlabel("samples")
    loss.set_ylabel("training loss (moving mean)")
    loss.legend(fontsize=8)
    rebalancing = payload.get("rebalancing", {})
    speed.bar(list(rebalancing), [r["steady_samples_per_second"] for r in rebalancing.values()])
    speed.set_ylabel("samples/s (second half of the run)")
    for name, row in payload.get("square_cube", {}).get("utilization", {}).items():
        util.plot(list(row), [100 * v for v in row.values()], marker="o", label=name)
    util.set_xlabel("latency (ms), 500 Mb/s")
    util.set_ylabel("compute share of a stage (%)")
    util.legend(fontsize=8)
    save_figure(fig, path, "SWARM on hivemind, 127.0.0.1")


def report(payload: dict) -> str:
    out = []
    rebalancing = payload.get("rebalancing", {})
    if rebalancing:
        ideal = rebalancing.get("ideal", {}).get("steady_samples_per_second")
        out.append(
            format_table(
                ["rebalancing", "samples/s", "% of ideal", "peers per stage at the end"],
                [
                    [
                        name,
                        row["steady_samples_per_second"],
                        f"{100 * row['steady_samples_per_second'] / ideal:.1f}" if ideal else None,
                        " / ".join(map(str, row["final_peers_per_stage"])),
                    ]
                    for name, row in rebalancing.items()
                ],
                markdown=True,
            )
        )
    utilization = payload.get("square_cube", {}).get("utilization", {})
    if utilization:
        latencies = list(next(iter(utilization.values())))
        out.append(
            format_table(
                ["stage (2 blocks)", *(f"{lat} ms" for lat in latencies)],
                [[name, *(f"{100 * row[lat]:.0f}%" for lat in latencies)] for name, row in utilization.items()],
                markdown=True,
            )
        )
    return "\n\n".join(out)


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), model=False)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of the convergence run")
    parser.add_argument("--seconds", type=float, default=120.0, help="length of each rebalancing run")
    # 0.3 s per sample caps stage 1 at ~7 samples/s with its two round-robin peers, below what the other stages
    # serve, so where the peers sit decides throughput.
    parser.add_argument("--slowdown", type=float, default=0.3, help="seconds per sample added on stage 1's peers")
    args = parser.parse_args()
    if args.report:
        return print_report("swarm", report)
    # The square-cube part depends on no setting.
    study = Study(
        "swarm",
        {"steps": args.steps, "seconds": args.seconds, "slowdown": args.slowdown},
        args,
        plot=plot_results,
        independent=("square_cube",),
    )

    if study.pending("convergence"):
        swarm = run_local_swarm(SwarmRun(SETTINGS, peers=6, trainers=2, max_steps=args.steps, max_seconds=900))
        baseline = single_process_losses(len(swarm["losses"]) * SETTINGS.micro_batch, SETTINGS)
        study.set(
            "convergence",
            {
                "swarm": {k: v for k, v in swarm.items() if k not in ("losses", "status")},
                "losses": {"swarm (6 peers, 2 trainers)": swarm["losses"], "single process": baseline},
            },
        )
    slow = {i: args.slowdown for i in range(6) if i % 3 == 1}  # round-robin: peers 1 and 4 serve stage 1
    # Each run trains for --seconds from its first micro-batch (start-up excluded, it varies with load).
    timing = {"max_steps": 10**6, "max_seconds": args.seconds + 180, "train_seconds": args.seconds}
    runs = {
        "none": SwarmRun(SETTINGS, peers=6, trainers=2, slow_peers=slow, **timing),
        "T=10 s": SwarmRun(
            SwarmSettings(**{**SETTINGS.__dict__, "rebalance_seconds": 10.0}),
            peers=6,
            trainers=2,
            slow_peers=slow,
            **timing,
        ),
        # the slow peers plus two fast ones on stage 1
        "ideal": SwarmRun(SETTINGS, peers=6, trainers=2, slow_peers=slow, assignment=(0, 1, 1, 2, 1, 1), **timing),
    }
    for name in study.todo("rebalancing", runs):
        record = run_local_swarm(runs[name])
        study.record(
            "rebalancing",
            name,
            {
                "steady_samples_per_second": steady_throughput(record),
                "samples_per_second": record["samples_per_second"],
                "final_peers_per_stage": record["status"][-1]["peers_per_stage"],
            },
            summary=lambda row: f"{row['steady_samples_per_second']:.2f} samples/s",
        )
    if study.pending("square_cube", "square-cube"):
        flops = cpu_flops()
        latencies = (0.0, 0.01, 0.05, 0.1, 0.2)
        shapes = {
            "ours (H=128, 2 layers, B=4, L=128)": StageShape(128, 2, 128, 4),
            "SmolLM2 width (H=576)": StageShape(576, 2, 128, 4),
            "xxlarge (H=4096)": StageShape(4096, 2, 512, 1),
            "GPT-3 (H=12288)": StageShape(12288, 2, 512, 1),
        }
        study.set(
            "square_cube",
            {
                "cpu_flops_per_second": flops,
                "bandwidth_bits": 500e6,
                "utilization": {
                    name: {str(int(1000 * lat)): stage_utilization(shape, flops, 500e6, lat) for lat in latencies}
                    for name, shape in shapes.items()
                },
            },
        )
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
