"""One device window on a 4-GPU host: training scaling and its profile, the multi-process GPU test,
async disaggregated.

    python bench/multigpu_window.py --deadline 570 --out $OUT/window1.tar.gz
    python bench/multigpu_window.py --deadline 570 --out $OUT/window2.tar.gz --parts procs4,async4,...
    python bench/multigpu_window.py --dry-run --deadline 900 --out /tmp/window.tar.gz  # CPU, tiny shapes

Parts run in the order of ``--parts`` (comma-separated); ``a+b`` runs a and b side by side on
disjoint GPUs (a on the first ones). The default order puts first what the docs owe most:
  train        bench/train_scaling.py, 1.7B then 4B, FSDP on 1, 2, 4 GPUs, 4,096 tokens per GPU
               (1 and 2 GPUs side by side on GPUs 0 and 1-2, then 4)
  procsN       the N-process GPU test (tests/e2e/test_multihost_counts.py, N = 2 or 4)
  asyncN       bench/async_step.py on N GPUs: sync colocated vs async disaggregated (half the GPUs
               decode), tool latency log-normal median 1 s (cap 6 s), max_staleness 1
  asyncN_lat0  the same with tool latency 0;  asyncN_sK: async only, max_staleness K
  asyncN_stream  the streaming arm (--stream-args), skipped with a line if the bench has no such option
  train_xla    1.7B on 1, 2, 4 GPUs with XLA's attention and full remat: only if a cuDNN row on
               several GPUs failed in `train` (then it gives the same-attention baseline)
  train_hlo    1.7B's update compiled for 4 GPUs (no run): its matmuls over all or a quarter of
               the tokens, its collectives (train_scaling.py --hlo)
  prof4        1.7B's FSDP update on 1 GPU, then on 4, each timed and then traced for 2 steps
               (train_scaling.py --profile), and bench/trace_summary.py's table of the traces:
               per GPU and step, compute, collectives by kind, exposed collectives, idle. The
               traces stay in --work (scratch/prof4); the tar has the summary and each
               perfetto_trace.json.gz under 5 MiB
Before a stage starts, its estimate on H100s (from the runs in docs/benchmarks.md) is compared
with the time left before ``--deadline`` seconds; a stage that does not fit is skipped, and the
end prints the command that runs what was skipped. A process still running at the deadline is
killed with its process group. Every process's whole stdout and stderr go to logs/.
At the end: env.json, summary.json, tables.md (bench/multigpu_tables.py), all in one tar file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DEFAULT_PARTS = ("train,procs2+async2,procs4,async4,train_xla,train_hlo,async2_lat0+async2_s2,async4_lat0,"
                 "async2_s4+async2_stream")
# Seconds on H100s. train: per worker ~15 s compile (measured 13 s, 1.7B) + ~25 s start and init;
# two rounds (1 and 2 GPUs, then 4) per shape. procs2: the 2-GPU test measured 248 s for its four
# runs. asyncN: ~14 s per synchronous and ~10 s per async step (2 x H200, 8-16 steps each) plus
# ~80 s start, compile and warm-up per mode.
# prof4: two train workers one after the other (~60 s each, as in train) plus writing and
# reading their traces (not measured on a GPU yet: ~30 s each, a guess).
ESTIMATE_S = {"train": 240, "train_xla": 150, "train_hlo": 60, "procs2": 270, "procs4": 300, "prof4": 200}
ESTIMATE_S.update({f"async{n}{arm}": s for n in (2, 4) for arm, s in
                   (("", 300), ("_lat0", 190), ("_s2", 150), ("_s4", 150), ("_stream", 300))})
# 4 x H200 (1432672): sync and 6 of async's 8 steps took 522 s; the stream alone 292 s
ESTIMATE_S.update(async4=570, async4_stream=330)
RESERVE_S = 15  # the tables and the tar at the end
ASSETS_LOG = os.path.join("logs", "async_assets.log")


class Window:
    """The run's settings, its folders and its clock."""

    def __init__(self, args: argparse.Namespace, stage_dir: str, scratch: str, t0: float):
        self.args, self.stage_dir, self.t0 = args, stage_dir, t0
        self.scratch = scratch  # checkpoints and model assets: never packed

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.t0) - RESERVE_S


# A process of a part: (argv, GPU ids it may see, log file name).
Proc = tuple[list[str], list[str], str]


def train_steps(w: Window, gpus: list[str], sizes, attention: str) -> list[list[Proc]]:
    """Per shape: 1 and 2 GPUs side by side, then 4 (each train_scaling.py worker sees only its GPUs)."""
    steps = []
    for size, extra in sizes:
        for round_ in ([(1, gpus[:1]), (2, gpus[1:3])], [(4, gpus[:4])]):
            step = []
            for n, ids in round_:
                tag = f"{size}_{n}gpu_{attention}"
                cmd = [PY, "bench/train_scaling.py", "--layouts", "fsdp", "--gpus", str(n), "--attention", attention,
                       "--out", os.path.join(w.stage_dir, f"train_{tag}.jsonl"),
                       "--log-dir", os.path.join(w.stage_dir, "logs", "train_workers"), *extra]
                cmd += ["--tiny"] if w.args.dry_run else ["--sizes", size, "--gpu-ids", ",".join(ids)]
                step.append((cmd, ids, f"train_{tag}.log"))
            steps.append(step)
    return steps


def cudnn_failed(w: Window) -> bool:
    rows = []
    for name in os.listdir(w.stage_dir):
        if name.startswith("train_") and name.endswith("_cudnn.jsonl"):
            with open(os.path.join(w.stage_dir, name)) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    return any("error" in r and r["gpus"] > 1 for r in rows)


def async_steps(w: Window, name: str, gpus: list[str]) -> list[list[Proc]]:
    """bench/async_step.py for part ``asyncN[_lat0|_sK|_stream]`` on ``gpus``."""
    arm = name.partition("_")[2]
    work = os.path.join(w.scratch, name)
    size = "tiny" if w.args.dry_run else "1.7b"
    os.makedirs(work, exist_ok=True)
    for folder in ("model", "tokenizer"):  # one random checkpoint for every arm (bench/rl_step.py reuses it)
        if not os.path.exists(os.path.join(work, folder)):
            os.symlink(os.path.join(w.scratch, f"assets_{size}", folder), os.path.join(work, folder))
    cmd = [PY, "bench/async_step.py", "--work-dir", work, "--tool-cap", "6"]
    if w.args.dry_run:
        cmd += ["--size", "tiny", "--cpu", str(len(gpus)), "--steps", "4", "--warmup", "1", "--prompts", "2",
                "--group", "2", "--turns", "2", "--new-tokens", "8", "--tool-median", "0.01"]
    else:  # 4 timed steps after the warm-up, and for async the ramp and the drain of max_staleness steps
        extra = w.args.stream_args.split() if arm == "stream" else []
        staleness = (int(arm[1:]) if arm[1:].isdigit() else
                     int(extra[extra.index("--max-staleness") + 1]) if "--max-staleness" in extra else 1)
        cmd += ["--size", "1.7b", "--steps", str(2 + 2 * staleness + 4), "--warmup", "2"]
    if arm == "lat0":
        cmd += ["--tool-median", "0"]
    elif arm == "stream":
        if "stream" not in subprocess.run([PY, "bench/async_step.py", "--help"], cwd=ROOT, capture_output=True,
                                          text=True).stdout.lower():
            print(f"{name}: bench/async_step.py has no streaming option here: skipped", flush=True)
            return []
        cmd += w.args.stream_args.split()
    elif arm:  # sK
        cmd += ["--modes", "async", "--max-staleness", arm[1:]]
    return [[(cmd, gpus, f"{name}.log")]]


def part_steps(w: Window, name: str, gpus: list[str]) -> list[list[Proc]]:
    if name == "train":
        return train_steps(w, gpus, [("1.7b", []), ("4b", ["--remat", "full", "--chunk-size", "2048"])], "cudnn")
    if name == "train_xla":
        if not w.args.dry_run and not cudnn_failed(w):
            print("train_xla: no cuDNN row on several GPUs failed (in --work): skipped", flush=True)
            return []
        return train_steps(w, gpus, [("1.7b", ["--remat", "full"])], "xla")
    if name == "train_hlo":  # compile only: do the 4 GPUs each compute their share of the rows?
        cmd = [PY, "bench/train_scaling.py", "--hlo", "--gpus", "4", "--layouts", "fsdp"]
        cmd += ["--tiny"] if w.args.dry_run else ["--sizes", "1.7b", "--gpu-ids", ",".join(gpus)]
        return [[(cmd, gpus, "train_hlo.log")]]
    if name == "prof4":
        return prof_steps(w, gpus)
    if name in ("procs2", "procs4"):
        # JAX_PLATFORMS=cpu: the test process itself must not take the GPUs its processes use
        return [[(["env", "JAX_PLATFORMS=cpu", PY, "-m", "pytest", "-p", "no:xdist", "-m", "gpu", "-s", "-q",
                   "tests/e2e/test_multihost_counts.py", "-k", name[-1] + "proc",
                   "--basetemp", os.path.join(w.scratch, name)], gpus, f"{name}.log")]]
    return async_steps(w, name, gpus)


def prof_steps(w: Window, gpus: list[str]) -> list[list[Proc]]:
    """1.7B on 1 GPU then 4, timed and traced; the traces' summary; the small traces into the tar."""
    traces, kept = os.path.join(w.scratch, "prof4"), os.path.join(w.stage_dir, "prof4_traces")
    rows = os.path.join(w.stage_dir, "prof4_rows.jsonl")
    for folder in (traces, kept):  # an earlier window's (same --work): its traces would be summed in
        shutil.rmtree(folder, ignore_errors=True)
    if os.path.exists(rows):  # (and its rows, appended to)
        os.remove(rows)
    cmd = [PY, "bench/train_scaling.py", "--layouts", "fsdp", "--gpus", "1,4", "--attention", "cudnn", "--steps", "4",
           "--profile", traces, "--out", rows,
           "--log-dir", os.path.join(w.stage_dir, "logs", "prof4_workers")]
    cmd += ["--tiny"] if w.args.dry_run else ["--sizes", "1.7b", "--gpu-ids", ",".join(gpus)]
    summary = [PY, "bench/trace_summary.py", traces, "--json", os.path.join(w.stage_dir, "prof4_summary.json")]
    keep = ["bash", "-c", (f"mkdir -p {kept} && cd {traces} && find . -name '*.gz' -printf '%s bytes %p\\n' && "
                           f"find . -name perfetto_trace.json.gz -size -5M -exec cp --parents {{}} {kept}/ \\;")]
    return [[(cmd, gpus, "prof4_train.log")], [(summary, [], "prof4_summary.log")], [(keep, [], "prof4_keep.log")]]


def gpus_of(name: str) -> int:
    if name.startswith("train"):
        return 4
    return int(name.removeprefix("procs").removeprefix("async").removeprefix("prof")[0])


def run_proc(w: Window, proc: Proc) -> dict:
    cmd, gpus, log = proc
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if not w.args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    path = os.path.join(w.stage_dir, "logs", log)
    t0 = time.monotonic()
    with open(path, "w") as f:
        f.write(f"$ CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')} {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=max(w.left(), 1))
        except subprocess.TimeoutExpired:  # the deadline: the process and what it started
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = "deadline"
    return {"log": f"logs/{log}", "rc": rc, "seconds": round(time.monotonic() - t0, 1)}


def run_part(w: Window, name: str, gpus: list[str], record: dict) -> None:
    t0 = time.monotonic()
    record.update(name=name, gpus=gpus, estimate_s=ESTIMATE_S[name], procs=[])
    try:
        run_steps(w, part_steps(w, name, gpus), record)
    except Exception as e:  # a part's own failure (a file, a path) must not stop the window or lose its tar
        record["procs"].append({"log": "-", "rc": f"{type(e).__name__}: {e}", "seconds": 0})
    rcs = [p["rc"] for p in record["procs"]]
    record["status"] = ("skipped" if not rcs else "deadline" if "deadline" in rcs else
                        "ok" if all(rc == 0 for rc in rcs) else "failed")
    record["seconds"] = round(time.monotonic() - t0, 1)
    print(f"{name}: {record['status']} in {record['seconds']:.0f} s (estimate {record['estimate_s']} s)", flush=True)


def run_steps(w: Window, steps: list[list[Proc]], record: dict) -> None:
    for step in steps:  # a step's processes side by side, the steps one after the other
        results: dict[int, dict] = {}

        def one(i: int, proc: Proc, results=results) -> None:
            results[i] = run_proc(w, proc)

        threads = [threading.Thread(target=one, args=(i, proc)) for i, proc in enumerate(step)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        record["procs"] += [results[i] for i in range(len(step))]


def record_env(w: Window) -> dict:
    """The machine, the commit and the command, in env.json (and nvidia-smi's view in env.txt)."""
    def out(cmd):
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{cmd[0]}: {e}"
        return proc.stdout.strip() if proc.returncode == 0 else f"{cmd[0]}: {proc.stderr.strip()[:200]}"
    smi = out(["nvidia-smi", "-L"])
    gpus = [line.split(":", 1)[1].split("(")[0].strip() for line in smi.splitlines() if line.startswith("GPU ")]
    commit = w.args.commit or out(["git", "rev-parse", "HEAD"])
    env = {"commit": commit, "dirty": not w.args.commit and bool(out(["git", "status", "--short", "-uno"])),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpus": len(gpus),
           "device": f"{len(gpus)} x {gpus[0]}" if gpus else "CPU (dry run)" if w.args.dry_run else "?",
           "jax": out([PY, "-c", "import importlib.metadata as m; print(m.version('jax'))"]),
           "command": w.args.command}
    with open(os.path.join(w.stage_dir, "env.txt"), "w") as f:
        f.write(f"{smi}\n\n{out(['nvidia-smi', 'topo', '-m'])}\n\n{out(['nvidia-smi'])}\n")
    with open(os.path.join(w.stage_dir, "env.json"), "w") as f:
        json.dump(env, f, indent=1)
    return env


def prepare_assets(w: Window) -> bool:
    """The async arms' random checkpoint, once, in a CPU-only process (JAX on the GPUs here would
    take the cards from the parts); False (and the log) if it failed."""
    size = "tiny" if w.args.dry_run else "1.7b"
    folder = os.path.join(w.scratch, f"assets_{size}")
    if os.path.exists(os.path.join(folder, "model", "config.json")):
        return True
    code = f"from bench.rl_step import prepare_assets; prepare_assets({folder!r}, {size!r})"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    t0 = time.monotonic()
    with open(os.path.join(w.stage_dir, ASSETS_LOG), "w") as f:
        try:
            rc = subprocess.run([PY, "-c", code], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(w.left(), 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "deadline"
    print(f"async assets ({size}): rc {rc} in {time.monotonic() - t0:.0f} s", flush=True)
    return rc == 0


def run_window(w: Window, stages: list[list[str]]) -> list[dict]:
    """Every stage that fits before the deadline, in order; one record per part. The async arms'
    model is written on the CPU meanwhile (a minute or so for 1.7B), ready when they start."""
    records, assets = [], {}
    preparing = threading.Thread(target=lambda: assets.update(ok=prepare_assets(w)), daemon=True)
    if any(n.startswith("async") and ESTIMATE_S[n] <= w.left() for stage in stages for n in stage):
        preparing.start()
    for stage in stages:
        need = max(ESTIMATE_S[n] for n in stage)
        if sum(gpus_of(n) for n in stage) > w.args.gpus or need > w.left():
            why = f"needs {need} s, {w.left():.0f} s left" if need > w.left() else "not enough GPUs side by side"
            print(f"{'+'.join(stage)}: skipped ({why})", flush=True)
            records += [{"name": n, "status": "not run", "why": why, "estimate_s": ESTIMATE_S[n]} for n in stage]
            continue
        if any(n.startswith("async") for n in stage):
            preparing.join()  # (started: this stage fits, so it fitted at the start)
            if not assets.get("ok"):
                records += [{"name": n, "status": "failed", "why": f"the assets failed: {ASSETS_LOG}"} for n in stage]
                continue
        first = 0
        threads, stage_records = [], []
        for name in stage:
            ids = [str(i) for i in range(first, first + gpus_of(name))]
            first += len(ids)
            stage_records.append({})
            threads.append(threading.Thread(target=run_part, args=(w, name, ids, stage_records[-1])))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        records += stage_records
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the tar file to write (e.g. $OUT/window.tar.gz)")
    p.add_argument("--deadline", type=float, required=True, help="seconds from now to have the tar written")
    p.add_argument("--parts", default=DEFAULT_PARTS, help="comma-separated stages; a+b: side by side")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "multigpu_window"),
                   help="kept between invocations on one machine: a second command adds to the first's results "
                        "(its tar has both) and reuses the async arms' model")
    p.add_argument("--gpus", type=int, default=4, help="GPUs of the machine")
    p.add_argument("--commit", default="", help="the commit to record (default: git rev-parse HEAD, where git "
                                                "and the repository's .git are there)")
    p.add_argument("--stream-args", default="--modes stream",
                   help="what bench/async_step.py takes for the streaming arm")
    p.add_argument("--dry-run", action="store_true", help="CPU, fake devices and tiny shapes: checks the plumbing")
    args = p.parse_args(argv)
    args.command = " ".join(["python", "bench/multigpu_window.py", *(sys.argv[1:] if argv is None else argv)])
    stages = [stage.split("+") for stage in args.parts.split(",") if stage]
    unknown = sorted({n for stage in stages for n in stage} - set(ESTIMATE_S))
    if unknown:
        p.error(f"--parts: unknown {unknown}; known: {sorted(ESTIMATE_S)}")
    w = Window(args, os.path.join(args.work, "window"), os.path.join(args.work, "scratch"), time.monotonic())
    os.makedirs(os.path.join(w.stage_dir, "logs"), exist_ok=True)
    os.makedirs(w.scratch, exist_ok=True)
    records = []
    try:
        env = record_env(w)
        print(f"{env['device']}, commit {env['commit'][:7]}, jax {env['jax']}; deadline {args.deadline:.0f} s; "
              f"work {args.work}", flush=True)
        records = run_window(w, stages)
    finally:
        finish(w, stages, records)


def finish(w: Window, stages: list[list[str]], records: list[dict]) -> None:
    """summary.json (this invocation added to the earlier ones), tables.md and the tar; prints the
    tables and the command for what did not run."""
    done = {r["name"] for r in records if r.get("status") in ("ok", "failed", "skipped")}
    rest = ",".join("+".join(s) for s in stages if not set(s) <= done)
    rerun = (f"python bench/multigpu_window.py --deadline {w.args.deadline:.0f} --out <tar> --work {w.args.work} "
             f"--parts {rest}" + (" --dry-run" if w.args.dry_run else "")) if rest else ""
    path = os.path.join(w.stage_dir, "summary.json")
    runs = []
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)["runs"]
    runs.append({"command": w.args.command,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "parts": records, "rerun": rerun,
                 "seconds": round(time.monotonic() - w.t0, 1)})
    with open(path, "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    tables = subprocess.run([PY, "bench/multigpu_tables.py", w.stage_dir], cwd=ROOT, capture_output=True, text=True)
    with open(os.path.join(w.stage_dir, "tables.md"), "w") as f:
        f.write(tables.stdout + (f"\n(bench/multigpu_tables.py failed: {tables.stderr[-2000:]})" if tables.returncode
                                 else ""))
    os.makedirs(os.path.dirname(os.path.abspath(w.args.out)), exist_ok=True)
    with tarfile.open(w.args.out, "w:gz") as tar:
        tar.add(w.stage_dir, arcname="multigpu_window")
    with open(os.path.join(w.stage_dir, "tables.md")) as f:
        print("\n" + f.read())
    print(f"wrote {w.args.out} after {time.monotonic() - w.t0:.0f} s" + (f"\nnot run: {rest}\nto run it: {rerun}"
                                                                           if rest else ""), flush=True)


if __name__ == "__main__":
    main()
