"""A static HTML report of one run, or of several side by side: every DVC plot and the key metrics.

The plots are the ones `dvc plots show` draws: DVC collects the definitions and data of each
revision and fills its Vega-Lite templates (`repo.plots.show` + `match_defs_renderers`, as
`dvc plots show --json` does); vl-convert renders each spec to SVG, which goes inline into one
HTML file. No JavaScript, no network: the page opens offline and can be archived or mailed.

No revision is the workspace; one revision is that run alone; two or more are overlaid, one
colour per revision, as `dvc plots diff` draws them. A past revision is read from git through
DVC's filesystem: the workspace is never checked out.
"""
from __future__ import annotations

import html
import json
import os
import re
import secrets
from datetime import datetime, timezone
from pathlib import Path

from storage.revisions import WORKSPACE, Revision, RevisionError, git

EVALUATE_METRICS = "data/evaluate/metrics.json"
LABEL_METRICS = "data/label/metrics.json"
ARM_SEED_TEMPLATE = ".dvc/plots/arm_seed.json"  # success by arm and seed (bench/hindsight_repro.py --results)


def default_report_path(revs: list[str] | None) -> Path:
    """reports/workspace.html, reports/<rev>.html, or reports/<rev>_vs_<rev>.html."""
    names = [re.sub(r"[^A-Za-z0-9._-]+", "_", r).strip("_") or "rev" for r in revs or [WORKSPACE]]
    return Path("reports") / ("_vs_".join(names) + ".html")


def write_report(revs: list[str] | None, out: Path, repo: Path = Path("."), repro: Path | None = None) -> Path:
    """Writes one self-contained HTML page with every DVC plot and the key metrics of `revs`
    (None: the workspace) of the DVC project at `repo`, and with `repro` (the reproduction bench's
    --results directory) its success by arm and seed; returns the path written."""
    from dvc.render.match import match_defs_renderers
    from dvc.repo import Repo
    from dvc.scm import RevError, resolve_rev

    repo = Path(repo).resolve()
    repro_spec, seeds, repro_rows = read_repro(Path(repro), repo / ARM_SEED_TEMPLATE) if repro is not None else (None, [], None)
    revs = list(dict.fromkeys(revs)) if revs else None  # a revision named twice is drawn once
    shown = revs or [WORKSPACE]
    with Repo(str(repo)) as dvc_repo:
        commits = {}  # rev as named -> commit sha (git revisions and DVC experiment names)
        for rev in shown:
            if rev != WORKSPACE:
                try:
                    commits[rev] = resolve_rev(dvc_repo.scm, rev)
                except RevError as e:
                    raise ValueError(f"report: unknown revision {rev!r} in {repo}") from e
        data = dvc_repo.plots.show(revs=revs)  # revs=None: the workspace
        renderers = match_defs_renderers(data=data, templates_dir=dvc_repo.plots.templates_dir)
        errors = [f"{rev}: {err}" for rev, d in data.items() if (err := d.get("definitions", {}).get("error"))]
        plots = []
        for r in renderers:
            errors += [f"{r.renderer.name} at {rev}, {src}: {_message(e)}" for rev, srcs in r.source_errors.items() for src, e in srcs.items()]
            errors += [f"{r.renderer.name} at {rev}: {_message(e)}" for rev, e in r.definition_errors.items()]
            if r.renderer.TYPE != "vega":
                errors.append(f"{r.renderer.name}: a {r.renderer.TYPE} plot, not drawn in the static report")
                continue
            spec = r.renderer.get_filled_template()
            if spec:
                plots.append((r.renderer.name, r.renderer.get_revs(), spec))
    metrics = {rev: _read_metrics(repo, commits.get(rev, WORKSPACE)) for rev in shown}
    if repro_spec is not None:
        plots.append((f"Success by arm and seed ({repro})", [f"seeds {', '.join(map(str, seeds))}"], repro_spec))
    page = _page(repo, shown, commits, plots, metrics, errors, repro, repro_rows)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out


def _message(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def svg(spec: dict, prefix: str) -> str:
    """The Vega-Lite spec drawn as SVG, its element ids prefixed: several SVGs inline in one page
    would otherwise share ids (every chart has its own `clip1`) and clip each other's marks."""
    import vl_convert

    text = vl_convert.vegalite_to_svg(spec)
    text = re.sub(r'\bid="([^"]+)"', rf'id="{prefix}\1"', text)
    text = re.sub(r"url\(#([^)]+)\)", rf"url(#{prefix}\1)", text)
    return re.sub(r'href="#([^"]+)"', rf'href="#{prefix}\1"', text)


def arm_seed_spec(points: list[dict], template: Path, title: str = "Success by arm and seed") -> dict:
    """The arm_seed template (one point per arm, seed and split; the mean over seeds as a tick)
    filled with `points`, rows {arm, seed, split, success_rate}."""
    spec = json.loads(template.read_text().replace('"<DVC_METRIC_DATA>"', json.dumps(points)))
    spec["title"]["text"] = title
    return spec


def read_repro(results: Path, template: Path) -> tuple[dict, list[int], list[tuple[str, str, list[float]]]]:
    """A reproduction's --results directory: the plot of its success.json, its seeds, and per arm
    from table.json (arm, held-out success "mean ± se", its by seed, held-out mean return "mean ±
    se", and the arm it is paired against with the success difference and its 95% interval over
    episodes). Success and return are the environment's: in the QA teacher, exact-match accuracy
    and the judge's score (Overall / 10). A cell the table lacks is "–"."""
    missing = [str(results / f) for f in ("table.json", "success.json") if not (results / f).is_file()]
    if missing:
        raise ValueError(f"report: {', '.join(missing)} not found: --repro takes the directory bench/hindsight_repro.py --results wrote")
    if not template.is_file():
        raise ValueError(f"report: no plot template {template} in the project")
    table = json.loads((results / "table.json").read_text())
    def paired(arm: str) -> str:
        p = table.get("paired", {}).get(arm)
        if not p:
            return "–"
        d = p["heldout"]["success"]
        return f"{p['against']}: {d['diff']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"

    rows = [(arm, f"{h['mean']:.3f} ± {h['se']:.3f}", h["by_seed"],
             f"{r['mean']:.3f} ± {r['se']:.3f}" if (r := row["heldout"].get("mean_return")) else "–", paired(arm))
            for arm, row in table["policies"].items() if (h := row.get("heldout", {}).get("success_rate"))]
    return arm_seed_spec(json.loads((results / "success.json").read_text()), template), table["seeds"], rows


# -- metrics -----------------------------------------------------------------------------------

def _read_metrics(repo: Path, rev: str) -> dict[str, str]:
    """The table's rows for one revision: label name -> formatted value."""
    rows: dict[str, str] = {}
    revision = Revision(repo, rev)

    def read(path: str) -> dict | None:
        try:
            text = revision.read_text(path)
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return None

    ev = read(EVALUATE_METRICS)
    for policy, r in ((ev or {}).get("policies") or {}).items():
        h = r.get("heldout") or {}
        if h.get("success_rate") is not None:
            rows[f"held-out success: {policy}"] = f"{h['success_rate']:.3f} ± {h.get('success_se', 0):.3f} (n = {h.get('episodes', '?')})"
    lab = read(LABEL_METRICS) or {}
    if "labels" in lab:
        rows["labels"] = str(lab["labels"])
    for key, title in (("by_source", "trajectories"), ("status", "label status"), ("mean_reward", "mean reward"), ("success_rate", "success (labelled)")):
        for name, value in (lab.get(key) or {}).items():
            rows[f"{title}: {name}"] = "–" if value is None else f"{value:g}" if isinstance(value, (int, float)) else str(value)
    cal = lab.get("calibration") or {}
    for key in ("pearson", "mae", "success_agreement"):
        if cal.get(key) is not None:
            rows[f"labeler calibration: {key}"] = f"{cal[key]:g}"
    return rows


# -- the page ----------------------------------------------------------------------------------

STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; }
h1 { margin: 0 0 4px 0; font-size: 22px; }
h2 { font-size: 17px; margin: 28px 0 8px 0; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
p.meta { margin: 2px 0; color: #555; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 10px; text-align: left; }
th { background: #f4f4f4; }
td.num { font-variant-numeric: tabular-nums; }
.plots { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; border: 1px solid #eee; padding: 6px; }
figcaption { font-size: 11px; color: #777; }
ul.errors { color: #a33; font-size: 13px; }
"""


def _describe(repo: Path, commit: str | None) -> str:
    """One line on a revision: short sha, commit date, subject (shortened)."""
    if commit is None:
        return "the files on disk, committed or not"
    try:
        line = git(repo, "log", "-1", "--format=%h %cs %s", commit, "--").strip()
    except RevisionError:
        line = ""
    return (line[:117] + "...") if len(line) > 120 else line or commit


def _page(repo: Path, revs: list[str], commits: dict[str, str], plots: list, metrics: dict[str, dict[str, str]], errors: list[str],
          repro: Path | None = None, repro_rows: list | None = None) -> str:
    e = html.escape
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = "retrosight report: " + (" vs ".join(revs))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    for rev in revs:
        parts.append(f'<p class="meta"><b>{e(rev)}</b>: {e(_describe(repo, commits.get(rev)))}</p>')
    parts.append(f'<p class="meta">project {e(str(repo))}; generated {e(generated)}; '
                 f"{len(plots)} plots, drawn as `dvc plots {'diff' if len(revs) > 1 else 'show'}` draws them</p>")

    parts.append("<h2>Key metrics</h2>")
    names = list(dict.fromkeys(k for rev in revs for k in metrics[rev]))
    groups = list(dict.fromkeys(n.split(":")[0] for n in names))
    names.sort(key=lambda n: groups.index(n.split(":")[0]))  # a policy only one run has stays with the others
    if names:
        head = "".join(f"<th>{e(rev)}</th>" for rev in revs)
        parts.append(f"<table><tr><th>metric</th>{head}</tr>")
        for name in names:
            cells = "".join(f'<td class="num">{e(metrics[rev].get(name, "–"))}</td>' for rev in revs)
            parts.append(f"<tr><td>{e(name)}</td>{cells}</tr>")
        parts.append("</table>")
        parts.append(f'<p class="meta">from {EVALUATE_METRICS} (mean ± standard error over episodes) and {LABEL_METRICS}</p>')
    else:
        parts.append(f'<p class="meta">no {EVALUATE_METRICS} or {LABEL_METRICS} at {e(", ".join(revs))}</p>')

    if repro_rows:
        parts.append(f"<h2>Reproduction: {e(str(repro))}</h2>")
        parts.append("<table><tr><th>arm</th><th>held-out success, mean ± se over seeds</th><th>by seed</th>"
                     "<th>held-out return, mean ± se over seeds</th><th>success minus the arm it is measured against (paired 95%)</th></tr>")
        for arm, cell, by_seed, ret, against in repro_rows:
            parts.append(f'<tr><td>{e(arm)}</td><td class="num">{e(cell)}</td><td class="num">{e(" ".join(f"{x:.3f}" for x in by_seed))}</td>'
                         f'<td class="num">{e(ret)}</td><td class="num">{e(against)}</td></tr>')
        parts.append("</table>")

    parts.append("<h2>Plots</h2>")
    if plots:
        parts.append('<div class="plots">')
        for i, (name, plot_revs, spec) in enumerate(plots):
            parts.append(f"<figure>{svg(spec, f'p{i}-')}<figcaption>{e(name)} ({e(', '.join(plot_revs))})</figcaption></figure>")
        parts.append("</div>")
    else:
        parts.append('<p class="meta">no plots with data at these revisions</p>')
    if errors:
        parts.append("<h2>Not drawn</h2><ul class=\"errors\">")
        parts.extend(f"<li>{e(msg)}</li>" for msg in errors)
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
