"""The `megarl` command line. Surface only: every command calls into the package that owns the logic."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence

from megarl.errors import RunFailure, UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str, flag: str) -> int:
    """'5GB' | '500MB' | '2GiB' | '123' (bytes) -> bytes."""
    match = _SIZE.match(text)
    unit = (match.group(2) or "").lower() if match else None
    if unit is not None and unit and not unit.endswith("b"):
        unit += "b"
    if not match or unit not in _UNITS:
        raise UserError(f"{flag}={text!r} is not a size; valid examples: 5GB, 500MB, 2GiB, 1000000")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UserError(f"{flag}={text!r} must be positive")
    return size


def _add_convert(commands) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert checkpoints between Hugging Face safetensors and Megatron distributed checkpoints",
        description="Convert a HF safetensors folder to a Megatron distributed checkpoint folder (--from hf --to "
        "mcore), or back (--from mcore --to hf). The destination appears only when complete.",
    )
    convert.add_argument("--from", dest="src_format", required=True, choices=["hf", "mcore"])
    convert.add_argument("--to", dest="dst_format", required=True, choices=["hf", "mcore"])
    convert.add_argument("src", help="source folder (--from hf: or a Hub model id, org/name[@revision])")
    convert.add_argument("dst", help="destination folder (must not exist unless --overwrite)")
    convert.add_argument("--tp", type=int, default=1, help="tensor-parallel size the checkpoint is written for")
    convert.add_argument("--pp", type=int, default=1, help="pipeline-parallel size the checkpoint is written for")
    convert.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage")
    for edge in ("first", "last"):
        convert.add_argument(
            f"--pp-{edge}-stage-layers",
            type=int,
            default=None,
            help=f"decoder layers of the {edge} pipeline stage when uneven (default: an even split)",
        )
    convert.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    convert.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    convert.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="weights dtype (default: the source's)")
    convert.add_argument(
        "--vocab-multiple", type=int, default=128, help="pad the vocabulary to a multiple of this x tp"
    )
    convert.add_argument("--max-shard-size", default="5GB", help="largest HF safetensors file written (--to hf)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    convert.add_argument(
        "--verify",
        action="store_true",
        help="--to mcore: load what was written at its layout (one process per rank, CPU) and compare its logits "
        "with the HF model's on fixed sequences; fail above the tolerance (both models in fp32 host memory)",
    )
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    convert.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from megarl.models.hf_config import parse_dtype
    from megarl.runtime.parallel import ParallelConfig

    dtype = parse_dtype(args.dtype, key="--dtype") if args.dtype else None
    direction = (args.src_format, args.dst_format)
    if direction == ("hf", "mcore"):
        from megarl.checkpoint.hub import resolve_model_path
        from megarl.conversion.hf_to_mcore import convert_hf_to_mcore

        args.src = resolve_model_path(args.src, "SRC")  # a Hub id: fetched into (or found in) the HF cache

        parallel = ParallelConfig(
            tp=args.tp,
            pp=args.pp,
            vpp=args.vpp,
            ep=args.ep,
            etp=args.etp,
            pp_first_stage_layers=args.pp_first_stage_layers,
            pp_last_stage_layers=args.pp_last_stage_layers,
        )
        parallel.check("--")  # names the flags: "--vpp=2 needs pipeline parallelism (--pp > 1)"
        report = convert_hf_to_mcore(
            args.src, args.dst, parallel, dtype, args.vocab_multiple, args.overwrite, not args.no_progress
        )
        print(f"wrote {report.destination}: {_written(report)}")
        for note in report.notes:
            print(f"note: {note}")
        if args.verify:  # after the line above: the checkpoint stays written even when it fails the check
            from megarl.conversion.verify_parity import verify_conversion

            print(f"verified: {verify_conversion(args.src, args.dst, parallel).describe(parallel)}")
        return 0
    elif direction == ("mcore", "hf"):
        from megarl.conversion.mcore_to_hf import convert_mcore_to_hf

        layout = (args.tp, args.pp, args.vpp, args.ep, args.etp, args.pp_first_stage_layers, args.pp_last_stage_layers)
        if layout != (1, 1, 1, 1, None, None, None):
            print("megarl: note: layout flags (--tp, --pp, ...) have no effect with --to hf", file=sys.stderr)
        if args.verify:
            print("megarl: note: --verify has no effect with --to hf (it checks --to mcore)", file=sys.stderr)
        max_shard = parse_size(args.max_shard_size, "--max-shard-size")
        report = convert_mcore_to_hf(
            args.src, args.dst, dtype, max_shard, overwrite=args.overwrite, show_progress=not args.no_progress
        )
    else:
        raise UserError(
            f"--from {args.src_format} --to {args.dst_format} is not a conversion; valid: "
            "--from hf --to mcore, --from mcore --to hf"
        )
    print(f"wrote {report.destination}: {_written(report)}")
    return 0


def _written(report) -> str:
    return f"{report.tensors} tensors, {report.bytes / 1e9:.3f} GB in {report.seconds:.1f} s"


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """What `train` and `plan` both take: a job config and overrides on its keys."""
    parser.add_argument("--config", required=True, help="the job's YAML file (see configs/)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")


def _add_train(commands) -> None:
    train = commands.add_parser(
        "train",
        help="run a training job (sft, grpo, ppo, rm stages) from a YAML config",
        description="Run the stages of a job config. Overrides are key=value pairs on config keys, e.g. "
        "rl.num_steps=10 actor.model.parallel.tp=2. A run folder with checkpoints resumes from the latest one.",
    )
    _add_job_arguments(train)
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="run every pre-flight check (files included), print the resolved config, the placement and the SGLang "
        "launch commands, and exit without starting anything (0: the job would start)",
    )
    train.set_defaults(run=_run_train)


_TRAINED = False
"""A `megarl train` returned (not raised): everything it started is stopped (see `entry`)."""


def _run_train(args: argparse.Namespace) -> int:
    from megarl.config import load_config
    from megarl.job import JobConfig

    if args.dry_run:  # like `megarl plan`, also where the data files exist only on the cluster
        from megarl.plan_command import load_for_planning
        from megarl.trainer.lifecycle.run import dry_run

        config, notes = load_for_planning(args.config, args.overrides)
        return dry_run(config, notes)
    config = load_config(JobConfig, args.config, args.overrides)
    from megarl.trainer.lifecycle.ray_start import early_ray_start

    ray_start = early_ray_start(config)
    try:
        from megarl.trainer.lifecycle.run import train  # imports torch while Ray boots

        code = train(config, ray_start)
    finally:
        if ray_start is not None:
            ray_start.close()
    global _TRAINED
    _TRAINED = True
    return code


def _add_plan(commands) -> None:
    plan = commands.add_parser(
        "plan",
        help="will this job fit? memory per GPU, placement and weight-sync time, without starting anything",
        description="Print per role the parallel layout and the memory per GPU at its peak, where each role runs, "
        "and an estimate of one weight sync; exit 1 when something does not fit, naming the role and by how much.",
    )
    _add_job_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object on stdout")
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from megarl.plan_command import plan_command

    return plan_command(args.config, args.overrides, as_json=args.json)


def _add_plot(commands) -> None:
    plot = commands.add_parser("plot", help="write PNG plots of a run's metrics (run_dir/plots/)")
    plot.add_argument("run_dir", help="a run folder (holds metrics.jsonl)")
    plot.set_defaults(run=lambda args: _plot_command(args.run_dir))


def _plot_command(run_dir: str) -> int:
    from megarl.trainer.observability.plots import plot_command

    return plot_command(run_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="RLHF / RLVR training on Megatron-Core")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(commands)
    _add_convert(commands)
    _add_plan(commands)
    _add_plot(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from megarl.runtime.quiet import silence_expected_warnings
    from megarl.runtime.versions import check_versions

    silence_expected_warnings()
    args = build_parser().parse_args(argv)
    try:
        check_versions()
        return args.run(args)
    except UserError as err:
        if args.debug:
            raise
        print(f"megarl: error: {err}", file=sys.stderr)
        return 2
    except RunFailure as err:
        if args.debug:
            raise
        print(f"megarl: run failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("megarl: interrupted; the last complete checkpoint (if any) stands", file=sys.stderr)
        return 130
    except Exception as err:  # a bug, not bad input: say so briefly, keep the traceback behind --debug
        if args.debug:
            raise
        print(
            f"megarl: internal error: {type(err).__name__}: {err} (run with --debug for the traceback)", file=sys.stderr
        )
        return 1


def entry() -> None:
    """The `megarl` command. After `megarl train` (its files closed, Ray stopped, every worker gone) the process
    leaves at once: what is left is the interpreter tearing down torch's, Megatron's and Ray's modules, seconds of
    CPU on a small machine for nothing."""
    code = main()
    if not _TRAINED:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    entry()
