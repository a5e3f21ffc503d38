"""`megarl convert --from hf --to mcore`: a HF safetensors folder -> a megarl Megatron checkpoint folder.

Every check runs before the first weight is read; the output appears only when complete (staged, then renamed).
Memory: the HF files are memory-mapped and one Megatron parameter is produced at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.bridge.mappings import VocabInfo, pad_vocab_size
from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.checkpoint.carried import carried_note
from megarl.checkpoint.model_dir import (
    EXTRA_DIR,
    HF_DIR,
    MODEL_DIR,
    ModelCheckpointInfo,
    copy_hf_side_files,
    save_manifest,
    write_hf_tensors,
)
from megarl.checkpoint.staging import check_destination, staged_folder
from megarl.conversion.lazy_dist_save import save_lazily
from megarl.conversion.meta_model import build_meta_model, check_checkpoint_matches
from megarl.errors import UserError
from megarl.models.hf_config import config_dtype, dtype_name, load_hf_config, read_config_json, read_hf_weights
from megarl.models.layout import check_parallel_layout
from megarl.models.registry import get_architecture
from megarl.runtime.distributed import single_process_megatron
from megarl.runtime.parallel import ParallelConfig
from megarl.runtime.progress import progress_bar


@dataclass(frozen=True)
class ConversionReport:
    tensors: int
    bytes: int
    seconds: float
    destination: Path
    notes: tuple[str, ...] = ()
    """Things the user should know, e.g. tensors that were skipped."""


def convert_hf_to_mcore(
    src: str | Path,
    dst: str | Path,
    parallel: ParallelConfig | None = None,
    dtype: torch.dtype | None = None,
    vocab_multiple: int = 128,
    overwrite: bool = False,
    show_progress: bool = True,
) -> ConversionReport:
    """Convert; `parallel` is the layout the checkpoint is written for (it sets the vocabulary padding and is
    validated against the model), `dtype` the Megatron parameter dtype (default: the HF checkpoint's)."""
    start = time.monotonic()
    src = Path(src)
    parallel = parallel or ParallelConfig()
    parallel.check("--")
    arch = get_architecture(read_config_json(src).get("model_type"))
    hf_config = load_hf_config(src)
    arch.check_supported(hf_config)
    check_parallel_layout(arch, hf_config, parallel, prefix="--")
    if vocab_multiple < 1:
        raise UserError(f"--vocab-multiple={vocab_multiple} must be a positive integer (Megatron's default: 128)")
    dst = check_destination(dst, overwrite, sources=(src,))
    dtype = dtype or config_dtype(hf_config)
    # FP8 checkpoints read dequantized (megarl.bridge.fp8); a vision-language one's language model as the text model
    checkpoint = read_hf_weights(src, dequantize_to=dtype)
    derived = [name for name in checkpoint.names if arch.is_derived(name)]
    carried = [name for name in checkpoint.names if arch.is_carried(name, hf_config)]
    checkpoint.names = [name for name in checkpoint.names if name not in derived and name not in carried]
    notes = _notes(derived, carried_note(arch, hf_config, carried) if carried else "", checkpoint)
    vocab = VocabInfo(hf_config.vocab_size, pad_vocab_size(hf_config.vocab_size, vocab_multiple, parallel.tp))

    with single_process_megatron():
        meta = build_meta_model(arch, hf_config, vocab, dtype)
        # names and shapes are compared; the dtype asked for here does not matter
        check_checkpoint_matches(checkpoint, meta.hf_specs(lambda name: dtype), str(src))
        sharded_state_dict = meta.chunk.sharded_state_dict()

        def produce(param_name: str) -> torch.Tensor:
            return meta.bridge.to_mcore(meta.binding(param_name), checkpoint.get)

        with staged_folder(dst, overwrite) as tmp:
            (tmp / MODEL_DIR).mkdir()
            with progress_bar(len(meta.bindings), f"hf -> mcore {src.name}", show_progress) as advance:
                save_lazily(sharded_state_dict, tmp / MODEL_DIR, produce, on_param=advance)
            copy_hf_side_files(src, tmp / HF_DIR)
            if carried:
                write_hf_tensors(tmp / EXTRA_DIR, checkpoint, carried)
            save_manifest(tmp, checkpoint.specs())
            ModelCheckpointInfo(
                architecture=arch.name,
                vocab_size=vocab.size,
                padded_vocab_size=vocab.padded_size,
                params_dtype=dtype_name(dtype),
                layout=parallel.layout_dict(),
                source=str(src.resolve()),
                quantization=checkpoint.quantization.config if checkpoint.quantization else None,
            ).save(tmp)
    total = sum(spec.nbytes for spec in checkpoint.specs()) + sum(checkpoint.spec(name).nbytes for name in carried)
    return ConversionReport(len(checkpoint.names) + len(carried), total, time.monotonic() - start, dst, notes)


def _notes(derived: list[str], carried: str, checkpoint: HFCheckpoint) -> tuple[str, ...]:
    notes = []
    if checkpoint.quantization is not None:
        dtype = checkpoint.spec(checkpoint.quantized_names[0]).dtype if checkpoint.quantized_names else None
        notes.append(
            f"dequantized {len(checkpoint.quantized_names)} block-wise FP8 weights (weight_block_size "
            f"{list(checkpoint.quantization.block)}) to {dtype_name(dtype) if dtype else 'nothing'}; the FP8 format is "
            "recorded for rollout (rollout.weights_format)"
        )
    if derived:
        notes.append(f"skipped {len(derived)} tensors recomputed from config.json (e.g. {derived[0]})")
    if carried:
        notes.append(carried)
    return tuple(notes)
