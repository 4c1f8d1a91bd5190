"""The PNG of `llmctl bench --plot`: latency and throughput against the load level.

Two panels sharing the x axis (concurrency or request rate): TTFT and end-to-end latency
(p50 solid, p99 dashed), then output tokens/s and requests/s. A reader tuning autoscaling
looks for the knee: where throughput stops growing and latency starts to.
"""

from __future__ import annotations

from pathlib import Path

from ops.llmctl.bench.stats import BenchReport


def plot_report(report: BenchReport, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    levels = [s.level for s in report.levels]
    xlabel = "concurrent requests" if report.mode == "concurrency" else "requests per second (offered)"
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, attr, color in (("TTFT", "ttft_ms", "tab:blue"), ("end-to-end", "e2e_ms", "tab:orange")):
        for pct, style, marker in (("p50", "-", "o"), ("p99", "--", "^")):
            values = [getattr(getattr(s, attr), pct) for s in report.levels]
            latency.plot(levels, _nan(values), style, marker=marker, color=color, label=f"{name} {pct}")
    latency.set(xlabel=xlabel, ylabel="latency (ms)", title="Latency")
    latency.legend(fontsize=8)

    throughput.plot(
        levels, [s.output_throughput for s in report.levels], "-o", color="tab:green", label="output tokens/s"
    )
    throughput.set(xlabel=xlabel, ylabel="output tokens/s", title="Throughput")
    requests = throughput.twinx()
    requests.plot(levels, [s.request_throughput for s in report.levels], "--s", color="tab:purple", label="requests/s")
    requests.set_ylabel("requests/s")
    lines = throughput.get_lines() + requests.get_lines()
    throughput.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper left")
    for axis in (latency, throughput):
        axis.grid(alpha=0.3)
        if len(levels) > 2 and max(levels) / min(levels) >= 8:  # 1,4,16,64 read better on a log axis
            axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [f"{level:g}" for level in levels])  # the levels run, not powers of 2

    errors = sum(sum(s.errors.values()) for s in report.levels)
    fig.suptitle(
        f"{report.model} at {report.base_url} ({report.api}; prompt {report.prompt_tokens}, "
        f"output {report.output_tokens}; {errors} failed requests)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _nan(values: list[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]
