"""The tables of benchmarks/gpu_validation.py: JSON and markdown from its report dict, the
two check criteria, and the margins a GPU run supports.

Rendering is a pure function of the report, so a partial report (the deadline came first)
renders too: what was not measured says why. ``POINT_COLUMNS`` and ``PLAN_COLUMNS`` are the
columns the CI test checks.

Example:
  >>> text = markdown({"status": "running", "points": [], "plans": {}, "jobs": []})
  >>> "| model | point |" in text and "not measured" in text
  True
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["PLAN_COLUMNS", "POINT_COLUMNS", "checks", "console_summary", "margin_rows",
           "markdown", "write"]

MIB = 1 << 20
POINT_COLUMNS = ["model", "point", "micro x accum", "need here MiB", "need deviceless MiB",
                 "peak MiB", "bytes_limit MiB", "peak / need", "peak / deviceless", "status"]
PLAN_COLUMNS = ["model", "E", "plan here (micro x accum)", "limit here", "budget MiB",
                "deviceless limit", "largest tested that ran", "first tested that failed",
                "planned OOM", "pool unused at limit"]
UNUSED_LIMIT = 0.05
"""Check criterion: the planned micro-batch leaves at most this share of the pool unused."""


def mib(value: Any) -> str:
    return f"{value / MIB:,.1f}" if isinstance(value, int | float) else "-"


def _why(result: Any) -> str:
    if not result:
        return "not measured"
    return str(result.get("skipped") or result.get("error") or "")


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "/").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _gpu(report: dict) -> bool:
    return bool(report.get("gpu")) and (report.get("device") or {}).get("platform") == "gpu"


# --- per point ---------------------------------------------------------------------------------


def _deviceless_need(report: dict, point: dict) -> int | None:
    found = report.get("deviceless", {}).get(point["size"], {})
    return (found.get("needs") or {}).get(f"{point['micro_batch']}x{point['accum_steps']}")


def point_rows(report: dict) -> list[list[Any]]:
    rows = []
    for p in report.get("points", []):
        head = [p["size"], p.get("role", ""), f"{p['micro_batch']} x {p['accum_steps']}"]
        if "need" not in p:
            rows.append([*head, *["-"] * 6, _why(p)[:120]])
            continue
        deviceless = _deviceless_need(report, p)
        ran = p.get("status") == "ran"
        peak = p.get("peak")
        ratio = f"{peak / p['need']:.3f}" if ran and peak and p["need"] else "-"
        dl_ratio = f"{peak / deviceless:.3f}" if ran and peak and deviceless else "-"
        status = p.get("status", "")
        if status == "oom":
            status = f"oom: {p.get('error', '')[:80]}"
        rows.append([*head, mib(p["need"]), mib(deviceless), mib(peak) if ran else "-",
                     mib(p.get("bytes_limit")), ratio, dl_ratio, status])
    return rows


# --- per plan ------------------------------------------------------------------------------------


def plan_summary(report: dict, size: str) -> dict[str, Any]:
    """The plan here against the tested points of ``size``: the largest that ran, the first
    that failed, whether the planned micro-batch ran out of memory, the pool it left."""
    plan = report.get("plans", {}).get(size, {})
    points = [p for p in report.get("points", []) if p["size"] == size and "status" in p]
    ran = [p["micro_batch"] for p in points if p["status"] == "ran"]
    failed = [p["micro_batch"] for p in points if p["status"] == "oom"]
    best = plan.get("limit")
    at_plan = next((p for p in points if p["micro_batch"] == best), None)
    out: dict[str, Any] = {"plan": best, "largest_ran": max(ran, default=None),
                           "first_failed": min(failed, default=None),
                           "planned_oom": None, "unused": None, "next_failed": None}
    if at_plan is not None:
        out["planned_oom"] = at_plan["status"] == "oom"
        limit, peak = at_plan.get("bytes_limit"), at_plan.get("peak")
        if at_plan["status"] == "ran" and limit and peak:
            out["unused"] = max(0.0, (limit - peak) / limit)
    nxt = next((p for p in points if best and p["micro_batch"] == best + 1), None)
    if nxt is not None:
        out["next_failed"] = nxt["status"] == "oom"
    return out


def plan_rows(report: dict) -> list[list[Any]]:
    rows = []
    gpu = _gpu(report)
    for size, plan in report.get("plans", {}).items():
        if "micro_batch" not in plan:
            rows.append([size, plan.get("effective_batch", "-"), *["-"] * 7, _why(plan)[:120]])
            continue
        dl = report.get("deviceless", {}).get(size, {}).get("plan") or {}
        s = plan_summary(report, size)
        planned_oom = "-" if s["planned_oom"] is None else "yes" if s["planned_oom"] else "no"
        if not gpu:
            planned_oom += " (not capped on a CPU)" if s["planned_oom"] is not None else ""
        unused = "-" if s["unused"] is None else f"{s['unused']:.1%}"
        rows.append([size, plan["effective_batch"], f"{plan['micro_batch']} x "
                     f"{plan['accum_steps']}", plan["limit"], mib(plan["budget"]),
                     dl.get("limit", _why(dl) or "-"),
                     s["largest_ran"] if s["largest_ran"] is not None else "-",
                     s["first_failed"] if s["first_failed"] is not None else "none tested",
                     planned_oom, unused if gpu else "n/a (no pool on a CPU)"])
    return rows


def checks(report: dict) -> list[list[str]]:
    """``[criterion, verdict, detail]``: zero planned OOMs; at most 5% of the pool unused."""
    sizes = list(report.get("plans", {}))
    summaries = {s: plan_summary(report, s) for s in sizes}
    measured = {s: v for s, v in summaries.items() if v["planned_oom"] is not None}
    if not _gpu(report):
        where = "on a CPU the points run uncapped (RSS, no pool)"
        return [["zero planned OOMs", "not measured", f"{where}; see the back-off row"],
                ["at most 5% of the pool unused", "not measured", where]]
    ooms = [s for s, v in measured.items() if v["planned_oom"]]
    rows = [["zero planned OOMs",
             "not measured" if not measured else "fail" if ooms else "pass",
             f"{len(measured)} planned micro-batch(es) run; out of memory: "
             f"{', '.join(ooms) or 'none'}"]]
    verdicts, details = [], []
    for s, v in measured.items():
        if v["unused"] is None:
            continue
        ok = v["unused"] <= UNUSED_LIMIT
        granular = not ok and v["next_failed"] is True
        verdicts.append("pass" if ok or granular else "fail")
        details.append(f"{s}: {v['unused']:.1%} unused"
                       + (" (one more example runs out of memory)" if granular else "")
                       + ("" if ok or granular or v["next_failed"] is None
                          else " and micro-batch plan + 1 ran"))
    verdict = ("not measured" if not verdicts else "fail" if "fail" in verdicts else "pass")
    rows.append(["at most 5% of the pool unused", verdict, "; ".join(details) or "-"])
    return rows


# --- the other rows ----------------------------------------------------------------------------


def oom_rows(report: dict) -> list[list[Any]]:
    rows = []
    b = report.get("backoff")
    if b and "micro_batch" in b:
        probes = ", ".join(f"{m}{'' if ok else ' OOM'}" for m, ok, _ in b.get("probes", []))
        plan = report.get("plans", {}).get(next(iter(report.get("plans", {})), ""), {})
        where = "" if _gpu(report) else f" under an address-space cap of {mib(b.get('cap'))} MiB"
        rows.append(["back-off (method=\"backoff\")",
                     f"E={b['effective_batch']}{where}: real steps {probes}; "
                     f"{b['real_ooms']} real out-of-memory error(s) backed off; largest that ran "
                     f"{b['limit']} (the compile-only plan's limit here: {plan.get('limit', '-')}, "
                     f"compiled with donation; back-off steps hold the state twice); "
                     f"{b['seconds']} s"])
    else:
        rows.append(["back-off (method=\"backoff\")", _why(b)])
    e = report.get("elastic")
    if e and "final" in e:
        recovered = e["final"] != e["planned"]
        rows.append(["elastic recovery", (
            f"planned {e['planned'][0]} x {e['planned'][1]}, memory squeezed after step 2; "
            + (f"recovered at {e['final'][0]} x {e['final'][1]}, {e['steps']} steps done"
               if recovered else f"no out-of-memory happened ({e['steps']} steps)")
            + (f"; {e['events'][0][:300]}" if e.get("events") else ""))])
    else:
        rows.append(["elastic recovery", _why(e)])
    return rows


def t4_rows(report: dict) -> list[list[Any]]:
    t4 = report.get("t4", {})
    cfg = t4.get("config", {})
    what = (f"{cfg.get('name', '?')}: Gemma3-4B's shapes, {cfg.get('layers', '?')} of its 34 "
            "layers, "
            f"LoRA {cfg.get('lora_rank')}, seq {cfg.get('seq')}, bf16")
    dl = (report.get("deviceless", {}).get("t4") or {})
    plan = dl.get("plan") or {}
    rows = [["model", what]]
    rows.append(["deviceless T4 plan (a laptop's)", (
        f"{plan['micro_batch']} x {plan['accum_steps']} (limit {plan['limit']}), need "
        f"{mib(plan['need'])} MiB of a {mib(plan['budget'])} MiB budget"
        if "limit" in plan else _why(plan or dl))])
    capped = t4.get("capped")
    if capped and "plan" in capped:
        p = capped["plan"]
        rows.append(["plan on this GPU, pool capped to a T4's",
                     f"fraction {t4.get('fraction')}: bytes_limit {mib(capped.get('bytes_limit'))}"
                     f" MiB; {p['micro_batch']} x {p['accum_steps']} (limit {p['limit']}), "
                     f"need {mib(p['need'])} MiB of a {mib(p['budget'])} MiB budget"])
        rows.append(["trains at that plan?", (
            f"yes: {capped.get('steps')} steps, peak {mib(capped.get('peak'))} MiB"
            if capped.get("status") == "trains" else f"no: {capped.get('error', '')[:160]}")])
    else:
        rows.append(["plan and training on a T4-sized pool", _why(capped)])
    return rows


def throughput_rows(report: dict) -> list[list[Any]]:
    t = report.get("throughput")
    if not t or "micro_batch" not in t:
        return [["-", "-", "-", "-", _why(t)]]
    base = (t.get("autoaccum accumulated step") or {}).get("examples_per_s")
    rows = []
    for name in ("autoaccum accumulated step", "native batch", "optax.MultiSteps"):
        r = t.get(name) or {}
        split = (f"{t['micro_batch'] * t['accum_steps']} x 1" if name == "native batch"
                 else f"{t['micro_batch']} x {t['accum_steps']}")
        if "examples_per_s" in r:
            rel = f"{r['examples_per_s'] / base:.2f}" if base else "-"
            rows.append([name, split, r["examples_per_s"], rel, f"{r['step_s']} s per step"])
        else:
            rows.append([name, split, "-", "-", _why(r)])
    return rows


def _measured_points(report: dict) -> list[Any]:
    from _margins_fit import MeasuredPoint

    out = []
    for p in report.get("points", []):
        if p.get("status") == "ran" and p.get("kind") == "gpu" and p.get("peak"):
            out.append(MeasuredPoint(need=p["need"], peak=p["peak"],
                                     need_deviceless=_deviceless_need(report, p),
                                     bytes_limit=p.get("bytes_limit"), context=p.get("context")))
    return out


def margin_rows(report: dict) -> list[list[Any]]:
    """Each margin of this run's profile, its provenance, and what this run says it should be
    (a GPU run only), plus the on-device margin of ``autoaccum/planning/_budget.py``."""
    from _margins_fit import suggest_margins

    from autoaccum.devices import find_profile
    from autoaccum.planning._budget import DEVICE_MARGIN_FRACTION, DEVICE_MARGIN_MIN_BYTES

    key = report.get("profile")
    try:
        profile = find_profile(key) if key else None
    except ValueError:
        profile = None
    if profile is None:
        return [["-", "-", "-", "-", "-", "no profile for this device"]]
    gpu = _gpu(report)
    points = _measured_points(report) if gpu else []
    device = report.get("device") or {}
    where = (f"{device.get('kind')}, jax {device.get('jax')}, commit {report.get('commit')}, "
             "docs/accuracy.md")
    suggested = suggest_margins(points, profile.margins, provenance=where) if points else []
    by_name = {s.name: s for s in suggested}
    rows = []
    for m in profile.margins:
        s = by_name.get(m.name)
        says = ("CPU run: GPU margins not measured" if not gpu
                else "not measured: no point ran" if not points
                else f"{s.suggested.mib:g} MiB ({s.why})" if s and s.suggested else s.why)
        rows.append([f"{profile.key}: {m.name}", f"{m.mib:g}", m.where, m.when,
                     m.provenance, says])
    for s in suggested:
        if s.current is None and s.suggested is not None:
            rows.append([f"{profile.key}: {s.name} (new)", "-", "pool", "deviceless", "-",
                         f"{s.suggested.mib:g} MiB ({s.why})"])
    gaps = [(p.peak - p.need, p.bytes_limit) for p in points if p.bytes_limit]
    worst = max(gaps, default=None)
    rows.append([
        "on-device margin (autoaccum/planning/_budget.py)",
        f"{DEVICE_MARGIN_FRACTION:.0%} of bytes_limit, at least "
        f"{DEVICE_MARGIN_MIN_BYTES // MIB}", "pool", "on the device",
        "estimate: docs/guides/margins.md; not measured on a GPU yet",
        ("CPU run: not measured" if not gpu else "not measured: no point ran" if worst is None
         else f"at least {worst[0] / MIB:+.1f} MiB = {worst[0] / worst[1]:.2%} of bytes_limit "
              "(largest peak - need compiled here)")])
    return rows


# --- the page ----------------------------------------------------------------------------------


def _header(report: dict) -> list[str]:
    gpu, device = report.get("gpu"), report.get("device") or {}
    where = (f"{gpu['name']} (profile `{gpu['profile']}`), JAX's pool at "
             f"{gpu['fraction']:.2f} ({gpu['fraction_source']})" if gpu
             else f"no GPU on this machine: the CPU path (a CPU device, resident-set growth "
                  f"instead of `peak_bytes_in_use`, deviceless compiles for "
                  f"`{report.get('profile')}`)")
    jobs = report.get("jobs", [])
    done = sum(1 for j in jobs if j["status"] == "ok")
    status = report.get("status", "running")
    if status == "deadline":
        status = (f"deadline reached after {report.get('seconds', '?')} s: {done} of "
                  f"{len(jobs)} jobs measured, the rest say why not")
    return [
        f"- status: {status}",
        f"- device: {where}",
        f"- jax {device.get('jax', '?')}, Python {report.get('python', '?')}, autoaccum commit "
        f"{report.get('commit', '?')}, started {report.get('started', '?')}, "
        f"{report.get('seconds', '?')} s of a {report.get('deadline_s', '?')} s deadline",
        f"- command: `{report.get('command', '')}`",
    ]


def markdown(report: dict) -> str:
    """The whole page: device, points, plans, checks, real OOMs, T4, throughput, margins."""
    gpu = _gpu(report)
    sizes = report.get("sizes", {})
    parts = ["## Device and run", *_header(report), ""]
    if sizes:
        parts += ["Models (Flax, `benchmarks/_gpu_models.py`): "
                  + "; ".join(f"{n}: {s['describe']}" for n, s in sizes.items()), ""]
    parts += ["## Compiled need against the real peak", _table(POINT_COLUMNS, point_rows(report)),
              "",
              ("`peak` is `memory_stats()['peak_bytes_in_use']` of a fresh process after one "
               "warm-up and the measured donated accumulated steps (`autoaccum.train_step`); "
               "`need` = argument + output - alias + temp of the same step compiled here "
               "(`autoaccum.measure`) and deviceless for the profile in a CPU-only process."
               if gpu else
               "CPU path: `peak` = the step's arguments as XLA counts them + the resident-set "
               "growth during the measured steps (after a warm-up step; Linux `VmHWM` reset); "
               "`bytes_limit` has no meaning on a CPU; `need deviceless` is the same step "
               f"compiled for `{report.get('profile')}` in a CPU-only process."), ""]
    parts += ["## The planner's micro-batch against the largest that really runs",
              _table(PLAN_COLUMNS, plan_rows(report)), "",
              "Points: a quarter of the planned micro-batch, the plan, and plan + 1 (each at the "
              "point's accumulation). `deviceless plan` is the same plan made in a CPU-only "
              "process for the profile (a laptop's `device=` plan)." if gpu else
              "On a CPU each size is planned against a budget (settings.cpu_budget_mib in the "
              "JSON) and the points run uncapped; the back-off row below is the real-OOM "
              "counterpart.", ""]
    parts += ["## Checks", _table(["criterion", "verdict", "detail"], checks(report)), ""]
    parts += ["## Real out-of-memory: back-off and elastic recovery",
              _table(["check", "result"], oom_rows(report)), ""]
    parts += ["## The T4 story", _table(["what", "result"], t4_rows(report)), ""]
    parts += ["## Throughput at the same micro-batch x accumulation",
              _table(["variant", "micro x accum", "examples/s", "vs autoaccum", "detail"],
                     throughput_rows(report)), ""]
    parts += ["## Margins: where each figure comes from, and what this run says",
              _table(["margin", "MiB", "where", "when", "provenance", "this run says"],
                     margin_rows(report)), ""]
    jobs = [[j["job"], j["where"], j["status"], j["wall_s"], j["at_s"]]
            for j in report.get("jobs", [])]
    parts += ["## Jobs", _table(["job", "process", "status", "seconds", "done at s"], jobs), ""]
    return "\n".join(parts)


def write(report: dict, *, json_path: Path, markdown_path: Path) -> None:
    """Writes both files (each replaced whole, so a reader never sees half of one). A table
    that fails to render says so in the markdown; the JSON keeps every figure regardless."""
    try:
        page = markdown(report)
    except Exception as error:  # never lose a GPU run's figures to a rendering bug
        page = f"The tables could not be rendered ({error!r}); the JSON has every figure."
    title = "# How accurate is the plan? (benchmarks/gpu_validation.py)\n\n"
    for path, text in ((json_path, json.dumps(report, indent=2, default=str)),
                       (markdown_path, title + page)):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)


def console_summary(report: dict) -> str:
    """The main tables for the terminal (rich), as text."""
    import io

    from rich.console import Console
    from rich.table import Table

    out = io.StringIO()
    console = Console(file=out, width=180)
    for title, headers, rows in (
            ("compiled need against the real peak", POINT_COLUMNS, point_rows(report)),
            ("plans", PLAN_COLUMNS, plan_rows(report)),
            ("checks", ["criterion", "verdict", "detail"], checks(report)),
            ("real out-of-memory", ["check", "result"], oom_rows(report))):
        table = Table(*headers, title=title)
        for row in rows:
            table.add_row(*(str(c) for c in row))
        console.print(table)
    return out.getvalue()
