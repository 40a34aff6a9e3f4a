"""``hybrid-kv doctor``: what the plugin would do in a vLLM process on this machine.

The table lists every feature under its one name with the option that turns it on; the
patches are grouped by the feature they serve (``FEATURE`` of each patch module) or as
standalone vLLM fixes. A serve line naming a local model directory is checked against the
geometry vLLM resolves for it (:mod:`hybrid_kv_plugin.models`), never an assumed block size.
A configuration error is one line on stderr and exit 2.
"""

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
    # Where the prefix-match unit equals a large hybrid block: the finest unit vLLM accepts, and its cost.
    unit_advice: dict[str, Any] | None = None
    environment_errors: list[str] = field(default_factory=list)  # malformed HYBRID_KV_* variables
    # HybridMooncakeStoreConnector: whether it can start here (its store client imports), and why not.
    mooncake_store: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        return self.status == Status.ACTIVE

    @property
    def configuration_errors(self) -> list[str]:
        """Malformed HYBRID_KV_* variables and serve-line errors (exit 2)."""
        serve_errors = self.serve_check["errors"] if self.serve_check is not None else []
        return [*self.environment_errors, *serve_errors]


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

    report.features = _feature_rows(adapter)
    from hybrid_kv_plugin.mooncake_store.options import doctor_row

    report.mooncake_store = doctor_row()
    report.patches = [
        {
            "name": p.spec.name,
            "feature": p.feature,
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
        verdict, report.unit_advice = check_serve_line(serve_args, adapter)
        report.serve_check = asdict(verdict)
    return report


def _feature_rows(adapter: Any) -> list[dict[str, str]]:
    """One row per feature: the adapter's verdict, or for the plugin's own options whether their patches go in."""
    from hybrid_kv_plugin.adapters.capabilities import FEATURES, Support
    from hybrid_kv_plugin.patches import PATCH_MODULES, planned_patches

    planned = {p.feature for p in planned_patches(adapter)}
    rows = []
    for row in FEATURES:
        if row.verdict_of is not None:
            verdict = adapter.verdict(row.verdict_of)
            support, reason = verdict.support.value, verdict.reason
        elif row.key in planned:
            support, reason = Support.PLUGIN.value, "the plugin's patches for it go into this wheel"
        else:
            first = min(
                (m.INSTALLS.since for m in PATCH_MODULES if m.FEATURE == row.key),
                key=lambda v: tuple(int(x) for x in v.split(".")),
                default="?",
            )
            support, reason = Support.UNAVAILABLE.value, f"the plugin adds it from vLLM {first} on"
        rows.append({"feature": row.key, "title": row.title, "option": row.option, "support": support, "reason": reason})
    return rows


def check_serve_line(argv: list[str], adapter: Any) -> tuple[Any, dict[str, Any] | None]:
    """The serve line's verdict, its block sizes and unit the ones vLLM resolves for the named model.

    Where the line names a local model directory, vLLM's geometry replaces the line's own
    ``--block-size`` / ``--mamba-block-size`` / ``--prefix-match-unit`` in the plugin's checks;
    a geometry vLLM refuses is the one error (the other checks of the line still run)."""
    import os

    from hybrid_kv_plugin.cli.serve_args import check_serve_args
    from hybrid_kv_plugin.models.geometry import GeometryError, parse_serve_line, resolve

    try:
        serve = parse_serve_line(argv)
    except GeometryError:
        return check_serve_args(argv, adapter), None  # it reports the same unreadable line
    if not serve.model or not os.path.isfile(os.path.join(serve.model, "config.json")):
        return check_serve_args(argv, adapter), None
    rest = _without_geometry(argv, serve.model)
    try:
        geometry = resolve(serve)
    except GeometryError as exc:
        verdict = check_serve_args([*rest, "--block-size", "16"], adapter)  # block-neutral: the other checks
        verdict.errors.insert(0, str(exc))
        verdict.reuse_granularity = verdict.min_cacheable_prefix = None
        return verdict, None
    resolved = [
        "--block-size", str(geometry.attention_block_size),
        "--mamba-block-size", str(geometry.mamba_block_size),
        "--prefix-match-unit", str(geometry.hash_block_size),
    ]  # fmt: skip
    verdict = check_serve_args([*rest, *resolved], adapter)
    verdict.geometry = geometry.as_dict()
    verdict.notes.insert(
        0,
        f"geometry resolved by vLLM from {serve.model}: {geometry.architecture}, attention block "
        f"{geometry.attention_block_size} / Mamba block {geometry.mamba_block_size} {geometry.mamba_cache_mode} / "
        f"prefix-match unit {geometry.hash_block_size}; max model len {geometry.max_model_len}",
    )
    advice = None
    block = max(geometry.attention_block_size, geometry.mamba_block_size)
    if not verdict.errors and verdict.reuse_granularity == block:
        from hybrid_kv_plugin.models.unit_advice import finer_unit

        found = finer_unit(serve, geometry)
        if found is not None:
            advice = found.as_dict()
            verdict.notes.append(found.describe())
    return verdict, advice


_GEOMETRY_FLAGS = ("--block-size", "--mamba-block-size", "--prefix-match-unit", "--model")


def _without_geometry(argv: list[str], model: str) -> list[str]:
    """``argv`` without ``vllm serve``, the model and the flags vLLM's resolution replaces."""
    argv = list(argv)
    if argv[:2] == ["vllm", "serve"]:
        argv = argv[2:]
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _GEOMETRY_FLAGS:
            skip = True
            continue
        if arg == model or arg.split("=", 1)[0] in _GEOMETRY_FLAGS:
            continue
        out.append(arg)
    return out


def render(report: DoctorReport, out: TextIO) -> None:
    w = out.write
    w(f"hybrid-kv-plugin {report.plugin_version} on vLLM {report.vllm_version}\n")
    w(f"adapter: {report.adapter or '-'}\n")
    w(f"status:  {report.status} ({report.reason})\n")
    for line in report.environment_errors:
        w(f"error:   {line}\n")
    if report.features:
        w("\nfeature                                                                   support      reason\n")
        for f in report.features:
            w(f"{f['title']:<73} {f['support']:<12} {f['reason']}\n      {f['feature']}: {f['option']}\n")
    if report.mooncake_store is not None:
        m = report.mooncake_store
        w(f"\n{m['title']:<73} {m['support']:<12} {m['reason']}\n      {m['feature']}: {m['option']}\n")
    if report.patches:
        w("\npatches installed by register() (each process installs its sides' patches), by what they serve:\n")
        for key, title in _patch_groups(report):
            w(f"  {title} ({key}):\n")
            for p in (p for p in report.patches if p["feature"] == key):
                w(f"    {p['name']} [{p['side']}]: {p['target']}\n"
                  f"        why: {p['why']}; upstream: {p['upstream']}; removed in: {p['removed_in']}\n")
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
            if report.unit_advice is not None:
                w(f"  finer unit: --prefix-match-unit {report.unit_advice['unit']} "
                  f"(reuse every {report.unit_advice['unit']} tokens instead of {report.unit_advice['block']})\n")
            junction = check.get("junction_checkpoint")
            if junction is not None:
                state = "takes effect" if junction["effective"] else "no effect"
                w(f"  junction checkpoint (switch {'on' if junction['switch'] else 'off'}): {state}: {junction['reason']}\n")


def _patch_groups(report: DoctorReport) -> list[tuple[str, str]]:
    """(tag, title) of each group that has a planned patch: features in table order, then the fixes."""
    from hybrid_kv_plugin.adapters.capabilities import PLUGIN_CONFIG, PLUGIN_CONFIG_TITLE, VLLM_FIX, VLLM_FIX_TITLE

    titles = [(f["feature"], f["title"]) for f in report.features]
    titles += [(PLUGIN_CONFIG, PLUGIN_CONFIG_TITLE), (VLLM_FIX, "vLLM fix: " + VLLM_FIX_TITLE)]
    present = {p["feature"] for p in report.patches}
    return [(key, title) for key, title in titles if key in present]


def run_doctor(
    json_output: bool = False, out: TextIO | None = None, serve_args: list[str] | None = None, err: TextIO | None = None
) -> int:
    """Print the report; a configuration error is one line on ``err`` and exit 2 (the text report is then left out)."""
    out, err = out or sys.stdout, err or sys.stderr
    report = collect(serve_args)
    errors = report.configuration_errors
    if json_output:
        payload: dict[str, Any] = asdict(report)
        out.write(json.dumps(payload, indent=2) + "\n")
    elif not errors:
        render(report, out)
    if errors:
        err.write("hybrid-kv doctor: error: " + "; ".join(errors) + "\n")
        return 2
    return 0 if report.status in (Status.ACTIVE, Status.DISABLED) else 1
