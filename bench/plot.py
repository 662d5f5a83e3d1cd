"""One PNG of the four benchmarks' JSON results (``offpeak bench plot``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import RESULTS_DIR


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _draw_e2e(ax: Any, e2e: dict[str, Any]) -> None:
    """Per size: the best raw leg, run_batch and Offpeak, output tokens/s side by side."""
    sizes = list(e2e["sizes"].items())
    keys = ("best", "run_batch", "offpeak")
    names = {"best": "best LLM.chat", "run_batch": "vllm run_batch", "offpeak": "Offpeak"}
    colors = {"best": "#888888", "run_batch": "#c77c3a", "offpeak": "#2f6db5"}
    x = np.arange(len(sizes))
    width = 0.27
    for i, key in enumerate(keys):
        values = [
            size["legs"][size["best_raw"] if key == "best" else key]["output_tokens_per_s"]
            for _, size in sizes
        ]
        bars = ax.bar(x + (i - 1) * width, values, width, label=names[key], color=colors[key])
        ax.bar_label(bars, fmt="%.0f")
    ax.set_xticks(x, [f"{int(n):,} requests\n(best: {s['best_raw']})" for n, s in sizes])
    ratios = ", ".join(f"{int(n):,}: {s['legs']['offpeak']['over_best_raw']:.2f}" for n, s in sizes)
    ax.set_title(f"End to end on {e2e['params']['model']}\nOffpeak / best raw leg: {ratios}")
    ax.set_ylabel("output tokens/s")
    ax.legend(loc="lower right")
    ax.margins(y=0.2)


def draw(results: Path | None, output: Path) -> Path:
    """Draw e2e tokens/s, intake MB/s, control-plane phases and worker RSS into ``output``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = results or RESULTS_DIR
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (e2e_ax, intake_ax), (control_ax, memory_ax) = axes

    e2e = _load(folder, "e2e")
    if e2e and "sizes" in e2e:
        _draw_e2e(e2e_ax, e2e)
    elif e2e:  # an older result: one size, one raw leg
        legs = e2e["legs"]
        labels = ["(a) LLM.chat\ngeneration only", "(b) vllm run_batch\nwhole process",
                  "(c) Offpeak\nupload → download"]  # fmt: skip
        keys = ("a_raw_engine", "b_run_batch", "c_offpeak")
        values = [legs[k]["output_tokens_per_s"] for k in keys]
        bars = e2e_ax.bar(labels, values, color=["#888888", "#c77c3a", "#2f6db5"])
        e2e_ax.bar_label(bars, fmt="%.0f")
        ratios = e2e["ratios"]
        e2e_ax.set_title(
            f"End to end, {e2e['params']['requests']} requests on {e2e['params']['model']}\n"
            f"c/a = {ratios['c_over_a']:.2f}, c/b = {ratios['c_over_b']:.2f}"
        )
        e2e_ax.set_ylabel("output tokens/s")

    intake = _load(folder, "intake")
    if intake:
        runs = intake["runs"]
        labels = [f"{r['file_mb']:.0f} MB" for r in runs]
        bars = intake_ax.bar(labels, [r["mb_per_s"] for r in runs], color="#2f6db5")
        intake_ax.bar_label(
            bars, labels=[f"{r['mb_per_s']:.1f} MB/s\nAPI +{r['api_rss_growth_mb']:.0f} MiB RSS"
                          for r in runs])  # fmt: skip
        intake_ax.axhline(intake["targets"]["mb_per_s"], color="#c0392b", ls="--", label="target")
        intake_ax.set_title(f"Intake: upload + validation + rows, {runs[0]['lines']:,} lines")
        intake_ax.set_ylabel("MB/s")
        intake_ax.legend(loc="lower right")
        intake_ax.margins(y=0.25)

    control = _load(folder, "control")
    if control:
        (run,) = control["runs"]
        left = 0.0
        for phase, color in (("validate_s", "#8fb3de"), ("run_s", "#2f6db5"),
                             ("finalize_s", "#c77c3a"), ("download_s", "#888888")):  # fmt: skip
            control_ax.barh([0], [run[phase]], left=left, color=color, label=phase[:-2])
            left += run[phase]
        target_s = run["lines"] / control["targets"]["requests_per_s"]
        control_ax.axvline(target_s, color="#c0392b", ls="--", label="target (3,000 req/s)")
        control_ax.set_yticks([])
        control_ax.set_xlabel("seconds")
        control_ax.set_title(
            f"Control plane, instant engine: {run['lines']:,} lines, "
            f"{run['requests_per_s']:,.0f} requests/s"
        )
        control_ax.legend(loc="upper right", fontsize=8)
        control_ax.set_ylim(-1, 1.5)

    memory = _load(folder, "memory")
    if memory:
        runs = memory["runs"]
        width = 0.35
        xs = range(len(runs))
        for i, (worker, color) in enumerate((("engine", "#2f6db5"), ("control", "#c77c3a"))):
            bars = memory_ax.bar([x + i * width for x in xs],
                                 [r[f"{worker}_rss_peak_mb"] for r in runs], width,
                                 color=color, label=f"{worker} worker")  # fmt: skip
            memory_ax.bar_label(bars, fmt="%.0f")
        memory_ax.set_xticks([x + width / 2 for x in xs], [f"{r['lines']:,} lines" for r in runs])
        memory_ax.set_ylabel("peak RSS, MiB")
        memory_ax.set_title("Worker memory over a batch (instant engine)")
        memory_ax.legend(loc="lower right")
        memory_ax.margins(y=0.15)

    fig.suptitle("Offpeak benchmarks (2-core CPU, no GPU; see docs/benchmarks.md)")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def draw_colocate(result: dict[str, Any], output: Path) -> Path:
    """One row per leg of ``bench colocate``: each real-time request's TTFT and TPOT at its
    send time (ms, log scale) against the targets, and batch output tokens/s in 5 s bins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "a": "(a) real-time alone",
        "b": "(b) + batch, lane off (max_num_seqs in flight)",
        "c": "(c) + batch, lane controller at its defaults",
        "d": "(d) batch alone",
    }
    legs = result["timelines"]
    fig, axes = plt.subplots(len(legs), 1, figsize=(12, 2.6 * len(legs)), squeeze=False)
    targets = result["targets"]
    phase = result["params"]["phase_seconds"]
    for ax, (leg, timeline) in zip(axes[:, 0], legs.items(), strict=True):
        rt = timeline["realtime"]
        if rt:
            at = [r[0] for r in rt]
            ax.scatter(at, [1000 * r[1] for r in rt], s=8, color="#c77c3a", label="TTFT")
            tpot = [(r[0], 1000 * r[2]) for r in rt if r[2] is not None]
            if tpot:
                ax.scatter(*zip(*tpot, strict=True), s=8, color="#2f6db5", label="TPOT")
        for key, color in (("ttft_p95_s", "#c77c3a"), ("tpot_p95_s", "#2f6db5")):
            if targets.get(key):
                ax.axhline(1000 * targets[key], color=color, ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        if leg != "d":
            for boundary in (phase, 2 * phase):
                ax.axvline(boundary, color="#888888", lw=0.8)
        batch = timeline["batch_tokens"]
        twin = ax.twinx()
        if batch:
            end = phase if leg == "d" else 3 * phase
            bins = np.arange(0, end + 5, 5.0)
            sums, _ = np.histogram([a for a, _ in batch], bins, weights=[t for _, t in batch])
            twin.step(bins[:-1], sums / 5.0, where="post", color="#2a9d4b", label="batch tok/s")
        twin.set_ylabel("batch tokens/s", color="#2a9d4b")
        ax.set_title(titles.get(leg, leg), fontsize=10)
        if rt:
            ax.legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("seconds (phases: quiet | busy | quiet)")
    fig.suptitle(
        "Co-serving through one vllm serve (2-core CPU): real-time latency per request, "
        "batch tokens/s; dashed: targets"
    )
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def draw_colocate_trace(result: dict[str, Any], output: Path) -> Path:
    """One row per leg of ``bench colocate --trace``: each real-time request's TTFT and TPOT at
    its send time (ms, log scale) against the whole replay's targets, the windows' edges, and
    batch output tokens/s in bins of a fiftieth of the replay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legs = result["timelines"]
    fig, axes = plt.subplots(len(legs), 1, figsize=(12, 2.6 * len(legs)), squeeze=False)
    targets = result["targets_whole_s"]
    duration = result["params"]["replay_seconds"]
    width = max(1.0, duration / 50)
    for ax, (leg, timeline) in zip(axes[:, 0], legs.items(), strict=True):
        rt = timeline["realtime"]
        if rt:
            ax.scatter([r[0] for r in rt], [1000 * r[1] for r in rt], s=6, color="#c77c3a",
                       label="TTFT")  # fmt: skip
            tpot = [(r[0], 1000 * r[2]) for r in rt if r[2] is not None]
            if tpot:
                ax.scatter(*zip(*tpot, strict=True), s=6, color="#2f6db5", label="TPOT")
            ax.legend(loc="upper left", fontsize=8)
        for key, color in (("ttft", "#c77c3a"), ("tpot", "#2f6db5")):
            if targets.get(key):
                ax.axhline(1000 * targets[key], color=color, ls="--", lw=1)
        for w in result["legs"][leg]["windows"][1:] if leg != "d" else []:
            ax.axvline(w["start"], color="#bbbbbb", lw=0.6)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        batch = timeline["batch_tokens"]
        if batch:
            twin = ax.twinx()
            end = max(a for a, _ in batch) + width
            bins = np.arange(0, end + width, width)
            sums, _ = np.histogram([a for a, _ in batch], bins, weights=[t for _, t in batch])
            twin.step(bins[:-1], sums / width, where="post", color="#2a9d4b")
            twin.set_ylabel("batch tokens/s", color="#2a9d4b")
        ax.set_title(f"({leg})", fontsize=10)
    axes[-1, 0].set_xlabel("replay seconds (grey: windows)")
    p = result["params"]
    fig.suptitle(
        f"Trace replay ({Path(p['trace']).name}, time × {p['time_scale']:.3g}, prompts × "
        f"{p['token_scale']:g}) through one vllm serve; dashed: targets"
    )
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
