"""``hybrid-kv replay --plot``: reused vs ideal per configuration as a bar chart (matplotlib, optional)."""

from __future__ import annotations

from hybrid_kv_plugin.cli.errors import fail


def require_matplotlib() -> None:
    """Refuse ``--plot`` in one line before anything runs when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail(
            "--plot needs matplotlib, which is not installed here; "
            "install the optional extra: pip install 'hybrid-kv-plugin[plot]'"
        )


def plot_report(report: dict, path: str) -> None:
    """Grouped bars per configuration: ideal, reused from the GPU, reused from the CPU (stacked)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in report["results"] if "refused" not in r]
    names = [r["name"] for r in ran]
    x = list(range(len(ran)))
    fig, ax = plt.subplots(figsize=(1.8 * max(len(ran), 2) + 2, 4))
    ax.bar([i - 0.2 for i in x], [r["ideal_tokens"] for r in ran], width=0.4, label="ideal", color="#bbbbbb")
    gpu = [r["reused_gpu_tokens"] for r in ran]
    ax.bar([i + 0.2 for i in x], gpu, width=0.4, label="reused from GPU", color="#3b75af")
    ax.bar(
        [i + 0.2 for i in x], [r["reused_cpu_tokens"] for r in ran], width=0.4, bottom=gpu,
        label="reused from CPU", color="#ef8636",
    )
    for i, r in enumerate(ran):
        ax.text(i + 0.2, r["reused_tokens"], f"{r['efficiency']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylabel("tokens")
    ax.set_title(f"hybrid-kv replay on vLLM {report['vllm']}: reused vs ideal")
    ax.set_ylim(0, 1.18 * max([r["ideal_tokens"] for r in ran] + [1]))
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
