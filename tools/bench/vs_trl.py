"""The same GRPO job in megarl and in Hugging Face TRL's GRPOTrainer, side by side on this machine.

    python tools/bench/vs_trl.py [--hidden 128] [--layers 4] [--new-tokens 8] [--prompts 8] [--n 8] [--steps 12]
        [--warmup 4] [--repeats 1] [--json results.json] [--only megarl|trl]

One checkpoint is generated for both (Qwen2-shaped, fp32, the quickstart's character tokenizer; `--hidden 64
--layers 2` is the 594k-parameter model of issue 19, `--hidden 512 --layers 8 --new-tokens 128` one where compute
dominates). Both train on the same prompts in the same order (examples/quickstart/rl.jsonl, no shuffling), `--n`
samples per prompt, `--new-tokens` new tokens, temperature 1, AdamW, no KL, one update per batch, the same exact-
answer reward. megarl runs `megarl train` (a local Ray instance, one actor worker, the embedded HF rollout engine,
colocated); TRL runs GRPOTrainer (its own generate, the same 2 cores). TRL is optional: without it (`pip install
trl`) only megarl runs.

Reported: start-up (process start to the end of the first step), teardown (end of the last step to the process's
exit: megarl saves its final checkpoint there, TRL here saves nothing) and the per-step wall time (median and mean after
`--warmup` steps): megarl's `timing/step_s` from metrics.jsonl, TRL's from a callback at every optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "examples" / "quickstart" / "rl.jsonl"


def build_checkpoint(out: Path, hidden: int, layers: int) -> Path:
    from megarl.job import ModelInit
    from megarl.trainer.lifecycle.model_init import build_model_folder

    heads = max(hidden // 32, 2)
    config = dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    config_path = out / "model_config.json"
    config_path.write_text(json.dumps(config))
    return build_model_folder(ModelInit(config=str(config_path), seed=0), out / "model")


MEGARL_CONFIG = """\
run: {{name: vs_trl, dir: {run_dir}, stages: [grpo], seed: 0}}
model: {{path: {model}}}
placement: {{train_gpus: 1}}
cluster: {{cpus_per_worker: {threads}}}
actor:
  model: {{dtype: float32}}
  optim: {{lr: 1.0e-5, clip_grad: 1.0}}
data: {{train_files: [{prompts}], shuffle: false}}
rollout:
  sampling: {{n: {n}, temperature: 1.0, max_new_tokens: {new_tokens}, ignore_eos: true}}
reward: {{fn: gsm8k, num_workers: 0}}
algorithm: {{kl: {{coef: 0.0}}}}
rl: {{num_steps: {steps}, prompts_per_step: {prompts_per_step}, eval_every: 0}}
checkpoint: {{every: 0}}
logging: {{console_every: 1}}
"""


ASYNC_OVERRIDES = [
    "placement.mode=split",
    "placement.rollout_gpus=1",
    "cluster.cpus_per_worker=1",
    "rollout.hf.num_threads=1",
    "rl.mode=async",
    "rl.max_staleness=1",
    "rl.stale_policy=wait",
]
"""megarl's asynchronous GRPO on the same 2 cores: the actor and the hf engine one core each, overlapped."""


def run_megarl(work: Path, model: Path, args, overrides: list[str] | None = None, name: str = "megarl") -> dict:
    overrides = args.set if overrides is None else overrides
    run_dir = work / f"{name.replace(' ', '_')}_run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a repeat starts fresh, not from the last run's checkpoint
    config = work / f"{name.replace(' ', '_')}.yaml"
    config.write_text(
        MEGARL_CONFIG.format(
            run_dir=run_dir,
            model=model,
            prompts=PROMPTS,
            n=args.n,
            new_tokens=args.new_tokens,
            steps=args.steps,
            prompts_per_step=args.prompts,
            threads=os.cpu_count(),
        )
    )
    start = time.time()
    command = [sys.executable, "-m", "megarl.cli", "train", "--config", str(config), *overrides]
    subprocess.run(command, check=True, cwd=work)
    end = time.time()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing/step_s" in r]
    times = [r["timing/step_s"] for r in steps]
    phases = {
        name: statistics.median(r[name] for r in steps[args.warmup :])
        for name in steps[-1]
        if name.startswith("timing/") and name != "timing/step_s"
    }
    # a step's record is written when it ends ("time": wall clock)
    startup, teardown = steps[0]["time"] - start, end - steps[-1]["time"]
    return _summary(name, times, startup, teardown, args.warmup) | {"phases": phases}


TRL_SCRIPT = """\
import json, sys, time
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model_dir, prompts_file, n, new_tokens, prompts_per_step, steps, out = sys.argv[1:]
n, new_tokens, prompts_per_step, steps = int(n), int(new_tokens), int(prompts_per_step), int(steps)
rows = [json.loads(line) for line in open(prompts_file)]
data = Dataset.from_list([{{"prompt": r["prompt"], "label": r["label"]}} for r in rows[: prompts_per_step * steps]])

def exact_answer(completions, label, **_):
    return [float(c.strip().split()[0] == l if c.strip() else 0.0) for c, l in zip(completions, label)]

class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.ends, self.last = [], [], None
    def on_step_begin(self, args, state, control, **kw):
        self.last = self.last or time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.ends.append(time.time())
        self.last = now

tokenizer = AutoTokenizer.from_pretrained(model_dir)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(model_dir)
config = GRPOConfig(
    output_dir=out + ".trainer", per_device_train_batch_size=prompts_per_step * n, num_generations=n,
    max_completion_length=new_tokens, temperature=1.0, learning_rate=1e-5, beta=0.0, max_steps=steps,
    num_iterations=1, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", shuffle_dataset=False,
    seed=0, max_grad_norm=1.0, generation_kwargs={{"min_new_tokens": new_tokens}}, bf16=False, dataloader_num_workers=0,
)
timer = StepTimes()
trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=config, train_dataset=data,
                      processing_class=tokenizer, callbacks=[timer])
ready = time.perf_counter()
trainer.train()
json.dump({{"times": timer.times, "ends": timer.ends, "ready": ready}}, open(out, "w"))
"""


def run_trl(work: Path, model: Path, args) -> dict | None:
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed (pip install trl): only megarl runs")
        return None
    script, out = work / "trl_run.py", work / "trl_times.json"
    script.write_text(TRL_SCRIPT.format())
    start = time.time()
    command = [sys.executable, str(script), str(model), str(PROMPTS), str(args.n), str(args.new_tokens)]
    subprocess.run([*command, str(args.prompts), str(args.steps), str(out)], check=True, cwd=work)
    end = time.time()
    result = json.loads(out.read_text())
    ends = result["ends"]
    return _summary("trl", result["times"], ends[0] - start, end - ends[-1], args.warmup)


def _summary(name: str, times: list[float], startup: float, teardown: float, warmup: int) -> dict:
    """startup: process start to the end of the first step; teardown: end of the last step to process exit."""
    measured = times[warmup:]
    return dict(
        name=name,
        startup_s=round(startup, 2),
        teardown_s=round(teardown, 2),
        step_median_s=round(statistics.median(measured), 4),
        step_mean_s=round(statistics.mean(measured), 4),
        step_spread=round((max(measured) - min(measured)) / statistics.median(measured), 3),
        steps_measured=len(measured),
        times=[round(t, 4) for t in times],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--only", choices=["megarl", "trl"])
    parser.add_argument(
        "--async-too",
        action="store_true",
        help="also run megarl's one-step-off asynchronous GRPO (split placement: actor and engine one core each); "
        "not the same job as TRL's (each batch comes from the weights one step behind)",
    )
    parser.add_argument(
        "--set", nargs="*", default=[], help="megarl config overrides, e.g. actor.micro_batch.packing=false"
    )
    parser.add_argument("--json", help="write the headline numbers here")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run both trainers this many times each, alternating which goes first (megarl, TRL, TRL, megarl, ...: "
        "a drift of the machine's speed falls on both alike); the headline pools the runs",
    )
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"megarl": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        work = Path(tmp)
        model = build_checkpoint(work, args.hidden, args.layers)
        params = _num_parameters(model)
        extra = {}
        for repeat in range(args.repeats):
            order = ["megarl", "trl"] if repeat % 2 == 0 else ["trl", "megarl"]
            for trainer in order:
                if args.only not in (None, trainer):
                    continue
                result = run_megarl(work, model, args) if trainer == "megarl" else run_trl(work, model, args)
                if result is not None:
                    runs[trainer].append(result)
            if repeat == 0 and args.async_too and args.only != "trl":
                overrides = [*ASYNC_OVERRIDES, *args.set]
                extra["megarl_async"] = run_megarl(work, model, args, overrides, "megarl one-step-off async")
    print(
        f"\nmodel: {params / 1e3:.0f}k parameters (hidden {args.hidden}, {args.layers} layers); "
        f"{args.prompts} prompts x {args.n} samples, {args.new_tokens} new tokens\n"
    )
    print("| trainer | start-up s | teardown s | step median s | step mean s | spread (max-min)/median |")
    print("|---|---|---|---|---|---|")
    for r in [*runs["megarl"], *runs["trl"], *extra.values()]:
        cells = [r[k] for k in ("name", "startup_s", "teardown_s", "step_median_s", "step_mean_s", "step_spread")]
        print("| " + " | ".join(map(str, cells)) + " |")
    for r in [*runs["megarl"][:1], *extra.values()]:
        print(f"\n{r['name']} phases (median s): " + ", ".join(f"{k[7:]} {v:.4f}" for k, v in r["phases"].items()))
    headline: dict = {"params": params, "repeats": args.repeats}
    for name, results in [*runs.items(), *((k, [v]) for k, v in extra.items())]:
        for m in ("step_median_s", "startup_s", "teardown_s"):
            if results:  # over repeats: the median of the runs' own values
                headline[f"{name}_{m}"] = round(statistics.median(r[m] for r in results), 4)
    if runs["megarl"] and runs["trl"]:
        pairs = [m["step_median_s"] / t["step_median_s"] for m, t in zip(runs["megarl"], runs["trl"])]
        headline["pair_ratios"] = [round(x, 3) for x in pairs]
        headline["megarl_over_trl"] = round(headline["megarl_step_median_s"] / headline["trl_step_median_s"], 3)
        print(f"\nmegarl / TRL per step: {headline['megarl_over_trl']} (runs side by side: {headline['pair_ratios']})")
    if runs["trl"] and "megarl_async" in extra:
        ratio = extra["megarl_async"]["step_median_s"] / headline["trl_step_median_s"]
        headline["megarl_async_over_trl"] = round(ratio, 3)
        print(f"megarl one-step-off async / TRL per step: {headline['megarl_async_over_trl']}")
    if args.json:
        Path(args.json).write_text(json.dumps(headline | {"results": runs | extra}, indent=1))


def _num_parameters(model: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(model / "model.safetensors").values())


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
