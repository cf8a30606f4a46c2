"""The markdown tables of a bench/multigpu_window.py run, for docs/benchmarks.md.

    python bench/multigpu_tables.py window.tar.gz      # or the unpacked multigpu_window/ folder

Reads env.json (commit, card, date, command), the training-scaling rows (train_*.jsonl), the
multi-process test's `MULTIHOST_REPORT` lines and the async bench's tables from their logs,
the profiled steps' rows and bench/trace_summary.py's table (prof4), and summary.json
(which parts ran, failed or were not run). Prints markdown.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train_scaling import table as train_table  # noqa: E402


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def train_section(folder: str) -> list[str]:
    out = []
    for attention in ("cudnn", "xla"):
        rows = [json.loads(line) for path in sorted(glob.glob(os.path.join(folder, f"train_*_{attention}.jsonl")))
                for line in _read(path).splitlines() if line.strip()]
        if rows:  # the 1.7B rows first, then by GPU count (the window ran them side by side)
            rows.sort(key=lambda r: (r["size"] != "1.7b", r["size"], r["gpus"]))
            out += [f"{attention} attention:", "", train_table(rows), ""]
            out += [f"- {r['size']} on {r['gpus']} GPU{'s' if r['gpus'] > 1 else ''} failed: `{r['error']}` (whole output: "
                    f"`logs/{r['log'].split('/logs/', 1)[-1] if r.get('log') else '-'}`)" for r in rows if "error" in r]
    return out or ["(no training rows)"]


def profile_section(folder: str) -> list[str]:
    """prof4's timed rows (1 and 4 GPUs) and its trace summary as bench/trace_summary.py printed it."""
    rows_path, log = os.path.join(folder, "prof4_rows.jsonl"), os.path.join(folder, "logs", "prof4_summary.log")
    if not os.path.exists(rows_path) and not os.path.exists(log):
        return ["(not profiled)"]
    out = []
    if os.path.exists(rows_path):
        out += [train_table([json.loads(line) for line in _read(rows_path).splitlines() if line.strip()]), ""]
    summary = _read(log).splitlines()[1:] if os.path.exists(log) else ["(no trace summary)"]  # (less its `$ cmd`)
    return out + summary


def _state(d: dict) -> str:
    return "bitwise equal" if d["bitwise"] else f"{d['max_abs']:.2e} (at `{d['at']}`)"


def procs_section(folder: str) -> list[str]:
    out = ["| processes x 1 GPU | test | every host logs the same | every host holds the same weights | step: same "
           "trajectories as 1 process (loss N / 1) | state after step 1, N vs 1 | after step 2 | after step 3, "
           "N->1 vs 1->N resumed | seconds (N, 1, N->1, 1->N) |", "|---|---|---|---|---|---|---|---|---|"]
    for n in (2, 4):
        path = os.path.join(folder, "logs", f"procs{n}.log")
        if not os.path.exists(path):
            continue
        text = _read(path)
        outcome = re.findall(r"^[= ]*(\d+ (?:passed|failed|skipped|error).*?) in [\d.]+s", text, re.M)
        outcome = outcome[-1] if outcome else "no pytest summary (killed?)"
        reports = [json.loads(line.split("MULTIHOST_REPORT ", 1)[1]) for line in text.splitlines()
                   if "MULTIHOST_REPORT " in line]
        if not reports:
            out.append(f"| {n} | {outcome} | - | - | - | - | - | - | - |")
            continue
        r = reports[-1]
        steps = "; ".join(f"{s['step']}: {'yes' if s['same_trajectories'] else 'no'} ({s['loss'][0]:.6g} / "
                          f"{s['loss'][1]:.6g})" for s in r["steps"])
        out.append(f"| {n} | {outcome} | {'yes' if r['hosts_log_the_same'] else 'NO'} | "
                   f"{'yes' if r['hosts_hold_the_same_weights'] else 'NO'} | {steps} | "
                   f"{_state(r['state_after_step_1'])} | {_state(r['state_after_step_2'])} | "
                   f"{_state(r['state_after_step_3_resumed'])} | "
                   f"{', '.join(str(round(v)) for v in r['seconds'].values())} |")
    return out if len(out) > 2 else ["(the multi-process test did not run)"]


def async_section(folder: str) -> list[str]:
    """bench/async_step.py's own table rows, one arm (log) after the other, then each arm's device
    and speed-up lines."""
    header, rows, notes = None, [], []
    for path in sorted(glob.glob(os.path.join(folder, "logs", "async[0-9]*.log"))):
        arm = os.path.basename(path)[: -len(".log")]
        lines = _read(path).splitlines()
        table = [line for line in lines if re.match(r"^\| (sync|async|stream)", line)]
        header = header or next((line for line in lines if line.startswith("| mode |")), None)
        rows += [f"| {arm} {row}" for row in table]
        said = [line for line in lines if line.startswith(("device:", "async / sync"))]
        notes.append(f"- {arm}: " + ("; ".join(said) if table else f"no table: `{(lines or ['empty log'])[-1][:200]}`"))
    if not notes:
        return ["(the async bench did not run)"]
    if not header:
        return notes
    return [f"| arm {header}", "|---" * header.count("|") + "|", *rows, "", *notes]


def parts_section(folder: str) -> list[str]:
    runs = json.loads(_read(os.path.join(folder, "summary.json")))["runs"]
    out = ["| run | part | status | seconds | estimate (H100) | logs |", "|---|---|---|---|---|---|"]
    for i, run in enumerate(runs, 1):
        for r in run["parts"]:
            logs = ", ".join(f"`{p['log']}` (rc {p['rc']})" for p in r.get("procs", [])) or r.get("why", "-")
            out.append(f"| {i} | {r['name']} | {r['status']} | {r.get('seconds', '-')} | {r.get('estimate_s', '-')} "
                       f"| {logs} |")
    out += [""] + [f"{i}. `{run['command']}` ({run['date']}, {run['seconds']:.0f} s)" for i, run in enumerate(runs, 1)]
    if runs and runs[-1]["rerun"]:
        out += ["", f"Not run: `{runs[-1]['rerun']}`"]
    return out


def render(folder: str) -> str:
    env = json.loads(_read(os.path.join(folder, "env.json")))
    lines = [f"{env['device']}, jax {env['jax']}, commit {env['commit'][:7]}"
             f"{' (uncommitted changes)' if env.get('dirty') else ''}, {env['date']}:", "",
             f"    {env['command']}", "", "### Training over several GPUs", "", *train_section(folder),
             "", "### Processes as hosts", "", *procs_section(folder), "", "### Async on several GPUs", "",
             *async_section(folder), "", "### Profile of the training step", "", *profile_section(folder), "",
             "### The window's parts", "", *parts_section(folder)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python bench/multigpu_tables.py WINDOW.tar.gz | multigpu_window/")
    path = argv[0]
    if os.path.isdir(path):
        print(render(path), end="")
        return
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(path) as tar:
        tar.extractall(tmp, filter="data")
        print(render(os.path.join(tmp, "multigpu_window")), end="")


if __name__ == "__main__":
    main()
