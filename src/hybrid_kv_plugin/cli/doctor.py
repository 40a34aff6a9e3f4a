"""``hybrid-kv doctor``: what the plugin would do in a vLLM process on this machine."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from hybrid_kv_plugin.registration import Status


@dataclass
class DoctorReport:
    vllm_version: str
    plugin_version: str
    status: Status
    reason: str
    adapter: str | None
    features: list[dict[str, str]] = field(default_factory=list)
    patches: list[dict[str, str]] = field(default_factory=list)
    serve_check: dict[str, Any] | None = None
    environment_errors: list[str] = field(default_factory=list)  # malformed HYBRID_KV_* variables

    @property
    def ok(self) -> bool:
        return self.status == Status.ACTIVE


def collect(serve_args: list[str] | None = None) -> DoctorReport:
    """Report the decision ``register()`` makes (:func:`hybrid_kv_plugin.registration.decide`), patching nothing."""
    from hybrid_kv_plugin import __version__
    from hybrid_kv_plugin.adapters.detect import SUPPORTED_RANGE
    from hybrid_kv_plugin.config import environment_problems
    from hybrid_kv_plugin.registration import decide

    decision = decide(look_past_disable=True)
    selection, adapter = decision.selection, decision.adapter
    report = DoctorReport(
        vllm_version=selection.installed.raw or "not installed",
        plugin_version=__version__,
        status=decision.status,
        reason=decision.reason,
        adapter=adapter.name if adapter else None,
        environment_errors=environment_problems(),
    )
    if adapter is None:
        return report
    from hybrid_kv_plugin.patches import planned_patches

    report.features = [
        {"feature": v.feature.value, "title": v.feature.title, "support": v.support.value, "reason": v.reason}
        for v in adapter.verdicts()
    ]
    report.patches = [
        {
            "name": p.spec.name,
            "target": p.spec.target,
            "side": p.spec.side.value,
            "why": p.spec.why,
            "upstream": p.spec.upstream,
            "removed_in": p.removed_in,
        }
        for p in planned_patches(adapter)
    ]
    if decision.status is Status.MISMATCH:
        # Every changed target, not only the first one register() logs.
        report.reason = "; ".join(str(m) for m in decision.mismatches) + f"; supported vLLM {SUPPORTED_RANGE}"
    if serve_args:
        from hybrid_kv_plugin.cli.serve_args import check_serve_args

        report.serve_check = asdict(check_serve_args(serve_args, adapter))
    return report


def render(report: DoctorReport, out: TextIO) -> None:
    w = out.write
    w(f"hybrid-kv-plugin {report.plugin_version} on vLLM {report.vllm_version}\n")
    w(f"adapter: {report.adapter or '-'}\n")
    w(f"status:  {report.status} ({report.reason})\n")
    for line in report.environment_errors:
        w(f"error:   {line}\n")
    if report.features:
        w("\nfeature                                                  support      reason\n")
        for f in report.features:
            w(f"{f['title']:<56} {f['support']:<12} {f['reason']}\n")
    if report.patches:
        w("\npatches installed by register() (each process installs its sides' patches):\n")
        for p in report.patches:
            w(f"  {p['name']} [{p['side']}]: {p['target']}\n      why: {p['why']}; upstream: {p['upstream']}; removed in: {p['removed_in']}\n")
    if report.serve_check is not None:
        check = report.serve_check
        w("\nvllm serve arguments: " + ("INVALID" if check["errors"] else "ok") + "\n")
        for line in check["errors"]:
            w(f"  error: {line}\n")
        for line in check["notes"]:
            w(f"  note: {line}\n")
        if not check["errors"]:
            w(f"  mamba cache mode: {check['mamba_cache_mode']}\n")
            if check["reuse_granularity"] is not None:
                w(f"  reuse granularity: {check['reuse_granularity']} tokens; "
                  f"minimum cacheable prefix: {check['min_cacheable_prefix']} tokens\n")
            junction = check.get("junction_checkpoint")
            if junction is not None:
                state = "takes effect" if junction["effective"] else "no effect"
                w(f"  junction checkpoint (switch {'on' if junction['switch'] else 'off'}): {state}: {junction['reason']}\n")


def run_doctor(json_output: bool = False, out: TextIO | None = None, serve_args: list[str] | None = None) -> int:
    out = out or sys.stdout
    report = collect(serve_args)
    if json_output:
        payload: dict[str, Any] = asdict(report)
        out.write(json.dumps(payload, indent=2) + "\n")
    else:
        render(report, out)
    if report.environment_errors or (report.serve_check is not None and report.serve_check["errors"]):
        return 2
    return 0 if report.status in (Status.ACTIVE, Status.DISABLED) else 1
