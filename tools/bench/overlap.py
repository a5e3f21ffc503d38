"""Benchmark the overlap of rollout and training in asynchronous RL: step time of the synchronous loop and of the
asynchronous one (rl.mode=async, max_staleness=1, stale_policy=wait: one-step-off), next to the ideal
max(rollout, train) of a perfectly overlapped loop.

    python tools/bench/overlap.py [--steps 10] [--warmup 3] [--hidden 256] [--layers 4] [--prompts 16] [--n 4]
        [--tokens 48] [--repeats 1] [--json results.json] [--keep DIR [--reuse]]

Each mode is one real `megarl train` run (a subprocess, as a user runs it) of a GRPO job on a generated Qwen3-shaped
model (fp32, no hub) with split placement: the Megatron actor on one logical GPU, the hf rollout engine on another,
one CPU thread each (cluster.cpus_per_worker=1, rollout.hf.num_threads=1), so the two sides can run at the same
time on two cores. The reward is a rule in the driver (fraction of digits), no eval, no checkpoint before the end.
Times are means over the steps after `--warmup`, from the run's metrics.jsonl:
- rollout = timing/rollout_s of the synchronous run (generate + reward);
- train = timing/logprobs_s + timing/update_s + timing/sync_s of the synchronous run;
- ideal = max(rollout, train): what a perfectly overlapped loop would take per step (the asynchronous loop still
  pauses generation for the weight sync, so its floor is a little above this when rollout is the longer side);
- sync step and async step = timing/step_s of each run.
The two runs do not see the same machine (other work comes and goes), so the async run is also set against its own
phases: max(generation + reward of a batch, log-probs + update + sync of a step), both measured in that run (there
the two sides slow each other down where they share cores).
Targets: async step within 1.15x of the ideal; sync step close to rollout + train.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

REWARD = """
def digit_fraction(samples):
    return [sum(c.isdigit() for c in s.response) / max(len(s.response), 1) for s in samples]
"""


def model_config(hidden: int, layers: int) -> dict:
    return dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=101,  # the char tokenizer megarl builds for a fresh model
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def write_job(folder: Path, args: argparse.Namespace, mode: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_config.json").write_text(json.dumps(model_config(args.hidden, args.layers)))
    (folder / "reward.py").write_text(REWARD)
    with (folder / "prompts.jsonl").open("w") as f:
        for i in range(256):
            f.write(json.dumps({"prompt": f"Question {i}: count to", "label": str(i % 10)}) + "\n")
    rl = f"num_steps: {args.steps}, prompts_per_step: {args.prompts}, eval_at_start: false, num_sample_logs: 0"
    if mode == "async":
        rl += ", mode: async, max_staleness: 1, stale_policy: wait"
    job = folder / "job.yaml"
    job.write_text(
        f"""
run: {{name: overlap-{mode}, dir: {folder / "run"}, stages: [grpo], seed: 1}}
cluster: {{cpus_per_worker: 1}}
model: {{path: {folder / "model"}, init: {{config: {folder / "model_config.json"}}}}}
placement: {{mode: split, train_gpus: 1, rollout_gpus: 1}}
actor:
  model: {{dtype: float32}}
  optim: {{lr: 1.0e-4}}
rollout:
  sampling: {{n: {args.n}, temperature: 1.0, max_new_tokens: {args.tokens}, ignore_eos: true}}
  hf: {{num_threads: 1}}
reward: {{fn: "{folder / "reward.py"}:digit_fraction", num_workers: 0}}
data: {{train_files: [{folder / "prompts.jsonl"}]}}
rl: {{{rl}}}
checkpoint: {{save_at_end: false}}
logging: {{tensorboard: false, plots: false, progress: false}}
"""
    )
    return job


def run(job: Path, reuse: bool = False) -> tuple[list[dict], list[float]]:
    """The run's per-step metrics, and the 1-minute load average sampled every 5 s while it ran (`reuse`: read the
    metrics of an earlier run in the same folder instead, if there is one)."""
    sys.path.insert(0, str(REPO))
    from megarl.trainer.observability.metrics import read_metrics

    def steps() -> list[dict]:
        return [m for m in read_metrics(job.parent / "run") if "timing/step_s" in m and "reward/mean" in m]

    if reuse and (job.parent / "run" / "metrics.jsonl").is_file():
        return steps(), []
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(job)]
    loads, done = [], threading.Event()

    def sample():
        while not done.wait(5.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    done.set()
    if out.returncode != 0:
        raise SystemExit(f"megarl train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return steps(), loads


def mean(steps: list[dict], *names: str) -> float:
    return statistics.fmean(sum(s.get(name, 0.0) for name in names) for s in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the means")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per completion (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode (alternating); steps pooled")
    parser.add_argument("--json", type=Path, help="write the numbers here too")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument("--reuse", action="store_true", help="with --keep: report the runs already there")
    args = parser.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="megarl-overlap-"))
    load_before = os.getloadavg()[0]
    runs: dict[str, tuple[list[dict], list[float]]] = {"sync": ([], []), "async": ([], [])}
    for repeat in range(args.repeats):
        for mode in ("sync", "async"):
            steps, loads = run(write_job(root / f"{mode}-{repeat}", args, mode), args.reuse)
            runs[mode][0].extend(steps[args.warmup :])
            runs[mode][1].extend(loads)
    results = {}
    for mode, (steps, loads) in runs.items():
        results[mode] = {
            "step_s": mean(steps, "timing/step_s"),
            "rollout_s": mean(steps, "timing/rollout_s"),
            "train_s": mean(steps, "timing/logprobs_s", "timing/update_s", "timing/sync_s"),
            "sync_s": mean(steps, "timing/sync_s"),
            "wait_s": mean(steps, "timing/wait_s"),
            "rollout_busy_s": mean(steps, "async/rollout_busy_s"),
            "batch_rollout_s": mean(steps, "async/generate_s", "async/reward_s"),
            "rollout_idle_s": mean(steps, "async/rollout_idle_s"),
            "interrupted": mean(steps, "async/interrupted"),
            "load_mean": statistics.fmean(loads) if loads else float("nan"),  # nan: --reuse
            "load_max": max(loads, default=float("nan")),
        }
    sync, asyn = results["sync"], results["async"]
    rollout, train = sync["rollout_s"], sync["train_s"]
    ideal = max(rollout, train)
    print(
        f"model hidden {args.hidden} x {args.layers} layers; {args.prompts} prompts x {args.n} completions x "
        f"{args.tokens} tokens per step; means of steps {args.warmup + 1}..{args.steps} of {args.repeats} run(s) "
        f"per mode; 1-minute load average {load_before:.2f} before, during the runs (mean / max, this benchmark "
        f"included): sync {sync['load_mean']:.2f} / {sync['load_max']:.2f}, async {asyn['load_mean']:.2f} / "
        f"{asyn['load_max']:.2f}\n"
    )
    async_rollout, async_train = asyn["batch_rollout_s"], asyn["train_s"]
    async_ideal = max(async_rollout, async_train)
    print("| per step, s | sync run | async run |")
    print("|---|---|---|")
    print(f"| rollout: generate + reward | {rollout:.3f} | {async_rollout:.3f} |")
    print(f"| train: log-probs + update + sync | {train:.3f} | {async_train:.3f} |")
    print(f"| ideal: max(rollout, train) | {ideal:.3f} | {async_ideal:.3f} |")
    print(f"| rollout + train | {rollout + train:.3f} | {async_rollout + async_train:.3f} |")
    print()
    print("| mode | step s | x ideal (sync run's phases) | x ideal (own phases) | x (rollout + train) ", end="")
    print("| trainer waits s |")
    print("|---|---|---|---|---|---|")
    print(
        f"| sync | {sync['step_s']:.3f} | {sync['step_s'] / ideal:.2f} | {sync['step_s'] / ideal:.2f} | "
        f"{sync['step_s'] / (rollout + train):.2f} | |"
    )
    print(
        f"| async, max_staleness=1 | {asyn['step_s']:.3f} | {asyn['step_s'] / ideal:.2f} | "
        f"{asyn['step_s'] / async_ideal:.2f} | {asyn['step_s'] / (async_rollout + async_train):.2f} | "
        f"{asyn['wait_s']:.3f} |"
    )
    print(
        f"\nasync run: rollout idle {asyn['rollout_idle_s']:.3f} s/step, samples interrupted by syncs "
        f"{asyn['interrupted']:.1f}/step, sync {asyn['sync_s']:.3f} s/step (sync run: {sync['sync_s']:.3f})"
    )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None, "keep": None}, **results}, indent=2))


if __name__ == "__main__":
    main()
